"""DynaSpec's router: which token clusters the draft's next token is likely in.

A small MLP (Flax NNX) reads the draft's final hidden state h_t, the vector the LM head
would score, and scores the M clusters of `vocab_clusters`; the union of the top-k
clusters is the head's shortlist. The paper's router reads [embedding(x_t), h_{t−1}] so
that it can run on a parallel stream beside an EAGLE-style draft layer. In self-speculative
decoding the draft is the target's own forward on one stream, so the router can wait for
h_t at no extra latency, and it then sees exactly what the head sees.

It is trained by distillation (optax, AdamW): the label of a position is the target's own
next-token distribution summed per cluster (soft cross-entropy), because the draft must
find the target's choice, not the text's next token, and a distribution teaches more than
one token. Since the labels come from the target, any text gives pairs: prompts with no
continuation count too, so training can use hundreds of prompts at the price of one
forward each.

Measured on SmolLM2-135M (1024 clusters, held-out sequences, recall of the target's top
token at top-8 / top-32 clusters): the paper's inputs and the text's next token gave
0.57 / 0.64 from 48 sequences. h_t with soft labels gave 0.82 / 0.89, and with 300 more
prompts 0.97 / 0.99. The full-vocabulary acceptance a shortlist keeps follows that recall.
On Qwen2.5-1.5B recall at 16 clusters on held-out outputs grew 0.929 → 0.955 → 0.969
from 160 to 320 to 624 training sequences (`experiments/router_ablation.py`).

`k_schedule` gives k per draft position: flat by default, or the paper's decay, where k
shrinks after the second position. `RouterPlan` carries the router into the jitted draft
step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.models import checkpoint
from specjax.models.source import artefact_key
from specjax.offline.vocab_clusters import VocabClusters

VERSION = 2  # 2: reads h_t, distilled. 1 read [embedding(x_t), h_{t-1}] (refused on load)


class RouterMismatchError(SpecjaxError, ValueError):
  pass


def _rms(x):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Router(nnx.Module):
  def __init__(self, embed_dim: int, num_clusters: int, hidden: int = 1024, *,
               rngs: nnx.Rngs):
    self.l1 = nnx.Linear(embed_dim, hidden, rngs=rngs)
    self.l2 = nnx.Linear(hidden, num_clusters, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    """Final hidden states [..., D] (before the final norm) -> cluster logits [..., M]."""
    return self.l2(jax.nn.gelu(self.l1(_rms(h))))


def k_schedule(k: int, positions: int, decay: bool = False) -> tuple[int, ...]:
  """Clusters per draft position: k everywhere; with `decay` (the paper's schedule) k for
  t <= 1, then floor(k / ((t+1)*2)), at least 1."""
  return tuple(k if t <= 1 or not decay else max(k // ((t + 1) * 2), 1)
               for t in range(positions))


@flax.struct.dataclass
class RouterPlan:
  """The router inside a `DraftPlan`: params and the cluster table are traced, the
  module structure and the per-position k are static."""

  graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
  state: nnx.State
  table: jax.Array  # int32[M, capacity], -1 padded
  ks: tuple[int, ...] = flax.struct.field(pytree_node=False)  # k per draft position
  # An untied LM head [D, V] as rows [V, D], held once (`session.Session.with_head_rows`):
  # each draft step then gathers its shortlist's rows, not columns a row of the head apart
  # (a few thousand scattered columns cost more than reading the whole head).
  head_rows: jax.Array | None = None

  def shortlist(self, h: jax.Array, k: int) -> jax.Array:
    """Vocabulary ids of the top-k clusters for hidden state h[D], -1 padded:
    int32[k · capacity]."""
    _, top = jax.lax.top_k(nnx.merge(self.graphdef, self.state)(h), k)
    return self.table[top].reshape(-1)


# --- training data -------------------------------------------------------------------------


@dataclasses.dataclass
class Pairs:
  hidden: np.ndarray  # float32[N, D] the target's final hidden state at a position
  mass: np.ndarray  # float16[N, M] its next-token probability summed per cluster
  target: np.ndarray  # int32[N] its top token there
  group: np.ndarray  # int32[N] which sequence (for splits by sequence)


def _padded_length(n: int, step: int = 128) -> int:
  """`n` rounded up to a multiple of `step` (64 below it): few shapes to compile, and little
  padding to run — a power of two padded Spec-Bench's 520–768-token prompts to 1024, a
  third of the forward spent on padding."""
  return 64 if n <= 64 else -(-n // step) * step


def collect_pairs(model, sequences, clusters: VocabClusters, verbose: bool = True,
                  save_dir: Path | None = None, chunk: int = 16) -> Pairs:
  """(H_t, cluster mass of p(· | s_≤t), argmax) for every position of each sequence, from
  one full forward of the target per sequence. With `save_dir`, each `chunk` of sequences
  is written there as it is done and found again on a rerun (one forward of a 1.5B model
  takes seconds on a CPU, so a crash would otherwise lose half an hour)."""
  from tqdm.auto import tqdm

  from specjax.kv_cache import KVCache
  from specjax.model import apply
  from specjax.plan import DraftPlan

  cfg = model.config
  if clusters.assignment.size != cfg.vocab_size:
    raise RouterMismatchError(f"the clusters cover {clusters.assignment.size} tokens; "
                              f"{model.name} has {cfg.vocab_size}")
  full, assignment = DraftPlan.full(cfg.num_layers), jnp.asarray(clusters.assignment)
  M = clusters.num_clusters

  # The cache and plan are arguments, not values made inside the jit: as constants XLA
  # spent seconds constant-folding reductions over the zero cache in every compile.
  @jax.jit
  def forward(state, cache, tokens, plan):
    out, _ = apply(state, cache, tokens, jnp.arange(tokens.shape[1])[None], plan,
                   graphdef=model.graphdef, logits="all")
    p = jax.nn.softmax(out.logits[0], axis=-1)  # [T, V]
    mass = jax.ops.segment_sum(p.T, assignment, num_segments=M).T  # [T, M]
    return out.hidden[0], mass.astype(jnp.float16), jnp.argmax(p, -1).astype(jnp.int32)

  def one(g: int, seq: list[int]) -> dict[str, np.ndarray]:
    T = min(_padded_length(len(seq)), cfg.max_context)
    toks = jnp.asarray([seq + [0] * (T - len(seq))], jnp.int32)
    h, mass, top = forward(model.state, KVCache.create(cfg, 1, T), toks, full)
    n = len(seq)
    return dict(hidden=np.asarray(h[:n], np.float32), mass=np.asarray(mass[:n]),
                target=np.asarray(top[:n]), group=np.full(n, g, np.int32))

  seqs = [list(s)[: cfg.max_context] for s in sequences]
  parts = []
  bar = tqdm(total=len(seqs), desc="router pairs", unit="seq", disable=not verbose)
  for start in range(0, len(seqs), chunk):
    block = [(g, s) for g, s in enumerate(seqs[start:start + chunk], start) if len(s) >= 2]
    key = _chunk_key(artefact_key(model), clusters, block)
    path = save_dir and Path(save_dir) / f"pairs-{start // chunk:05d}-{key}.npz"
    if path and path.exists():
      with np.load(path) as f:
        rows = {k: f[k] for k in f.files}
    else:
      done = [one(g, s) for g, s in block]
      rows = {k: np.concatenate([d[k] for d in done]) if done else np.zeros((0,))
              for k in ("hidden", "mass", "target", "group")}
      if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **rows)
        tmp.replace(path)
    if rows["target"].size:
      parts.append(rows)
    bar.update(len(seqs[start:start + chunk]))
  bar.close()
  if not parts:
    raise ValueError("no sequence of two or more tokens to collect router pairs from")
  return Pairs(**{k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


def _chunk_key(model: str, clusters: VocabClusters, block) -> str:
  """What a saved chunk of pairs depends on: the model, the clusters and its sequences."""
  h = hashlib.sha256(model.encode())
  h.update(np.ascontiguousarray(clusters.assignment).tobytes())
  h.update(repr(block).encode())
  return h.hexdigest()[:12]


# --- training ------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
  router: Router
  train_loss: list[float]  # per epoch
  val_loss: list[float]
  val_recall: list[float]  # recall of the target's top token at top-k_max clusters
  best_epoch: int = 0  # the router kept (lowest validation loss; 0 = before training)


def train_router(pairs: Pairs, clusters: VocabClusters, *, k_max: int, hidden: int = 1024,
                 epochs: int = 10, batch: int = 256, lr: float = 2e-3, val_share: float = 0.15,
                 seed: int = 0, weight: np.ndarray | None = None,
                 verbose: bool = True) -> TrainResult:
  """AdamW on the soft cross-entropy to the target's cluster mass; the validation split is
  by sequence, and the router returned is the epoch of lowest validation loss. `weight`
  (float[N], default 1) weighs each pair's loss, in training and validation, e.g. up for
  positions inside the model's own continuations, which are what a draft predicts."""
  from tqdm.auto import tqdm

  labels = clusters.assignment[pairs.target]
  groups = np.unique(pairs.group)
  rng = np.random.default_rng(seed)
  val_groups = rng.choice(groups, max(1, int(round(val_share * groups.size))), replace=False)
  is_val = np.isin(pairs.group, val_groups)
  tr, va = np.flatnonzero(~is_val), np.flatnonzero(is_val)
  D, M = pairs.hidden.shape[1], clusters.num_clusters
  router = Router(D, M, hidden, rngs=nnx.Rngs(seed))
  w = np.ones(pairs.target.size, np.float32) if weight is None else np.asarray(weight,
                                                                               np.float32)
  opt = nnx.Optimizer(router, optax.adamw(optax.cosine_decay_schedule(lr, epochs * max(
      1, tr.size // batch))), wrt=nnx.Param)

  def weighted_ce(logits, mass, w):
    ce = optax.softmax_cross_entropy(logits, mass.astype(jnp.float32))
    return jnp.sum(ce * w) / jnp.sum(w)

  def loss_fn(r, h, mass, w):
    return weighted_ce(r(h), mass, w)

  @nnx.jit
  def step(r, o, h, mass, w):
    loss, grads = nnx.value_and_grad(loss_fn)(r, h, mass, w)
    o.update(r, grads)
    return loss

  @nnx.jit
  def evaluate(r, h, mass, y, w):
    logits = r(h)
    loss = weighted_ce(logits, mass, w)
    _, top = jax.lax.top_k(logits, k_max)
    return loss, jnp.mean(jnp.any(top == y[:, None], axis=-1))

  def val():
    loss, recall = evaluate(router, pairs.hidden[va], pairs.mass[va], labels[va], w[va])
    return float(loss), float(recall)

  result = TrainResult(router, [float("nan")], *([v] for v in val()))
  best = (result.val_loss[0], nnx.clone(router))
  bar = tqdm(range(epochs), desc="router", unit="epoch", disable=not verbose)
  for _ in bar:
    order = rng.permutation(tr)
    batches = (order[i : i + batch] for i in range(0, order.size - batch + 1, batch))
    # Losses stay on the device until the epoch ends: one host read per epoch, not per step.
    losses = [step(router, opt, pairs.hidden[b], pairs.mass[b], w[b]) for b in batches]
    vl, vr = val()
    result.train_loss.append(float(np.mean(jax.device_get(losses))) if losses else float("nan"))
    result.val_loss.append(vl)
    result.val_recall.append(vr)
    bar.set_postfix(train=f"{result.train_loss[-1]:.3f}", val=f"{vl:.3f}", recall=f"{vr:.2f}")
    if vl < best[0]:
      best = (vl, nnx.clone(router))
  result.router = best[1]
  result.best_epoch = int(np.argmin(result.val_loss))
  return result


def recall_at(router: Router, pairs: Pairs, clusters: VocabClusters, k: int,
              core=None) -> float:
  """Share of positions whose target top token lies in the router's top-k clusters (or in
  `core`, ids scored at every step): for the all-layer draft, the share of its greedy
  drafts a k-cluster shortlist keeps."""
  _, top = jax.lax.top_k(router(jnp.asarray(pairs.hidden)), k)
  labels = clusters.assignment[pairs.target]
  hit = np.array(jnp.any(top == labels[:, None], axis=-1))
  if core is not None:
    hit |= np.isin(pairs.target, np.asarray(core))
  return float(np.mean(hit))


def select(pairs: Pairs, mask: np.ndarray) -> Pairs:
  """The pairs at the positions `mask` marks."""
  return Pairs(pairs.hidden[mask], pairs.mass[mask], pairs.target[mask], pairs.group[mask])


# --- storage -------------------------------------------------------------------------------


@dataclasses.dataclass
class RouterBundle:
  """Everything DynaSpec needs, saved together: router, clusters, and what it was for."""

  model: str
  router: Router
  clusters: VocabClusters
  k_max: int  # clusters per shortlist (the first ones, with `decay`)
  hidden: int
  decay: bool = False  # the paper's shrinking k schedule (`k_schedule`)

  def plan_field(self, positions: int, k: int | None = None, core=None,
                 decay: bool | None = None) -> RouterPlan:
    """The router for a draft plan; `k` clusters per shortlist (default k_max), shrinking
    over the draft positions with `decay` (default: the bundle's). `core`: token ids the
    draft scores at every step anyway (`DraftPlan.vocab`); they are taken out of the
    clusters, so that no token is scored twice."""
    graphdef, state = nnx.split(self.router)
    decay = self.decay if decay is None else decay
    return RouterPlan(graphdef, state, jnp.asarray(self.clusters.without(core)),
                      k_schedule(self.k_max if k is None else k, positions, decay))


def save_bundle(directory: str | Path, bundle: RouterBundle, **meta) -> None:
  c = bundle.clusters
  tree = {"router": nnx.to_pure_dict(nnx.state(bundle.router)), "centroids": c.centroids,
          "assignment": c.assignment, "table": c.table}
  checkpoint.save_tree(Path(directory), tree, dict(
      model=bundle.model, version=VERSION, k_max=bundle.k_max, hidden=bundle.hidden,
      decay=bundle.decay,
      clusters=c.num_clusters, capacity=c.capacity, embed_dim=int(c.centroids.shape[1]),
      vocab=int(c.assignment.size), objective=list(c.objective), **meta))


def load_bundle(directory: str | Path, *, model: str) -> RouterBundle:
  directory = Path(directory)
  meta = checkpoint.load_meta(directory)
  if meta.get("model") != model:
    raise RouterMismatchError(f"the router at {directory} was trained for "
                              f"{meta.get('model')}, not {model}: train one with "
                              f"`specjax router train --model {model}`")
  if meta.get("version", 1) != VERSION:
    raise RouterMismatchError(f"the router at {directory} is of an older design (version "
                              f"{meta.get('version', 1)}, this is {VERSION}): train it again "
                              f"with `specjax router train --model {model}`")
  D, M, cap, V = meta["embed_dim"], meta["clusters"], meta["capacity"], meta["vocab"]
  router = Router(D, M, meta["hidden"], rngs=nnx.Rngs(0))
  like = {"router": nnx.to_pure_dict(nnx.state(router)),
          "centroids": np.zeros((M, D), np.float32), "assignment": np.zeros(V, np.int32),
          "table": np.zeros((M, cap), np.int32)}
  tree = checkpoint.restore_tree(directory, like)
  state = nnx.state(router)
  nnx.replace_by_pure_dict(state, tree["router"])
  nnx.update(router, state)
  clusters = VocabClusters(np.asarray(tree["centroids"]), np.asarray(tree["assignment"]),
                           np.asarray(tree["table"]), tuple(meta.get("objective", ())))
  return RouterBundle(model, router, clusters, meta["k_max"], meta["hidden"],
                      bool(meta.get("decay", False)))


def is_current(directory: str | Path) -> bool:
  """A saved router exists at `directory` and is of this design."""
  path = Path(directory) / "meta.json"
  return path.exists() and checkpoint.load_meta(Path(directory)).get("version", 1) == VERSION
