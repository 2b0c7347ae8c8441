"""DynaSpec's router: which token clusters the draft's next token is likely in.

A small MLP (Flax NNX) scores the M clusters of `vocab_clusters`; the union of the top-k
clusters is the head's shortlist. What it reads is the bundle's `inputs`:

- "embed_prev", the paper's: [E(x_t), h̃_{t−1}], the embedding of the token the draft
  step feeds and the final hidden state of the position before it. Neither waits for the
  step's forward, so the router can run beside it (the paper's parallel stream). At a
  round's first step h̃_{t−1} is the target's own, from verification (or the prefill);
  later steps read the draft's.
- "hidden", our variant: the draft step's own final hidden state h_t, the vector the
  head scores. In self-speculative decoding the draft is the target's forward on one
  stream, so waiting for h_t costs no latency on a CPU, and the router then sees exactly
  what the head sees.

It is trained by distillation (optax, AdamW): the label of a position is the target's own
next-token distribution summed per cluster (soft cross-entropy), because the draft must
find the target's choice, not the text's next token, and a distribution teaches more than
one token. Since the labels come from the target, any text gives pairs: prompts with no
continuation count too, so training can use hundreds of prompts at the price of one
forward each.

How recall (of the target's top token in the top-k clusters, on held-out sequences)
depends on the input, the labels and the amount of text is measured by
`experiments/router_ablation.py`; the figures are in docs/results/vocab.md.

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

# 3: either input, distilled (`INPUTS`). 2: h_t, distilled (read as a "hidden" router).
# 1: [embedding(x_t), h_{t-1}] with hard labels and no record of its input (refused).
VERSION = 3
INPUTS = ("embed_prev", "hidden")  # the paper's [E(x_t), h̃_{t−1}]; our h_t
DEFAULT_INPUTS = "embed_prev"


class RouterMismatchError(SpecjaxError, ValueError):
  pass


def _rms(x):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def check_inputs(inputs: str) -> str:
  if inputs not in INPUTS:
    raise ValueError(f"a router reads one of {', '.join(INPUTS)}, not {inputs!r}")
  return inputs


def features(inputs: str, *, hidden=None, embed=None, prev=None):
  """The router's input vector(s) [..., P·D]: `hidden` (h_t) for a "hidden" router;
  [embed, prev] (E(x_t), h̃_{t−1}) for an "embed_prev" one. numpy in, numpy out."""
  if inputs == "hidden":
    return hidden
  xp = np if isinstance(embed, np.ndarray) else jnp
  return xp.concatenate([embed.astype(xp.float32), prev.astype(xp.float32)], axis=-1)


class Router(nnx.Module):
  def __init__(self, embed_dim: int, num_clusters: int, hidden: int = 1024, *,
               inputs: str = DEFAULT_INPUTS, rngs: nnx.Rngs):
    self.inputs = check_inputs(inputs)
    self.parts = 2 if inputs == "embed_prev" else 1
    self.l1 = nnx.Linear(self.parts * embed_dim, hidden, rngs=rngs)
    self.l2 = nnx.Linear(hidden, num_clusters, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """`features` [..., P·D] -> cluster logits [..., M]. Each of the P vectors is
    RMS-normalised apart: a final hidden state before the final norm and an embedding
    (Gemma's scaled by √D) differ in scale by orders of magnitude."""
    parts = x.reshape(*x.shape[:-1], self.parts, -1)
    return self.l2(jax.nn.gelu(self.l1(_rms(parts).reshape(x.shape))))


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
  inputs: str = flax.struct.field(pytree_node=False)  # what the router reads (`INPUTS`)
  # An untied LM head [D, V] as rows [V, D], held once (`session.Session.with_head_rows`):
  # each draft step then gathers its shortlist's rows, not columns a row of the head apart
  # (a few thousand scattered columns cost more than reading the whole head).
  head_rows: jax.Array | None = None

  def features(self, hidden: jax.Array, embed: jax.Array, prev: jax.Array) -> jax.Array:
    """The router's input at a draft step: `hidden` its final hidden state h_t, `embed`
    E(x_t) of the token it fed, `prev` h̃_{t−1} (all [D])."""
    return features(self.inputs, hidden=hidden, embed=embed, prev=prev)

  def shortlist(self, x: jax.Array, k: int) -> jax.Array:
    """Vocabulary ids of the top-k clusters for router input x (`features`), -1 padded:
    int32[k · capacity]."""
    _, top = jax.lax.top_k(nnx.merge(self.graphdef, self.state)(x), k)
    return self.table[top].reshape(-1)


# --- training data -------------------------------------------------------------------------


@dataclasses.dataclass
class Pairs:
  """One row per position of each training sequence, sequence by sequence, in order."""

  hidden: np.ndarray  # float32[N, D] the target's final hidden state at a position
  mass: np.ndarray  # float16[N, M] its next-token probability summed per cluster
  target: np.ndarray  # int32[N] its top token there
  group: np.ndarray  # int32[N] which sequence (for splits by sequence)
  embed: np.ndarray | None = None  # float16[N, D] E(x_t), the embedding of the token there

  def usable(self, inputs: str) -> np.ndarray:
    """Rows a router of `inputs` can read: all for "hidden"; for "embed_prev" those with
    a previous position in their sequence (h̃_{t−1}), the row before (rows hold whole
    sequences, as `collect_pairs` and `select` of whole sequences leave them)."""
    if check_inputs(inputs) == "hidden":
      return np.arange(self.group.size)
    if self.embed is None:
      raise ValueError("these pairs hold no token embeddings: collect them again")
    return np.flatnonzero(np.r_[False, self.group[1:] == self.group[:-1]])

  def features(self, rows: np.ndarray, inputs: str) -> np.ndarray:
    """The router's input at `rows` (from `usable`): float32[n, P·D]."""
    if inputs == "hidden":
      return self.hidden[rows]
    return features(inputs, embed=self.embed[rows], prev=self.hidden[rows - 1])


def _padded_length(n: int, step: int = 128) -> int:
  """`n` rounded up to a multiple of `step` (64 below it): few shapes to compile, and little
  padding to run — a power of two padded Spec-Bench's 520–768-token prompts to 1024, a
  third of the forward spent on padding."""
  return 64 if n <= 64 else -(-n // step) * step


def collect_pairs(model, sequences, clusters: VocabClusters, verbose: bool = True,
                  save_dir: Path | None = None, chunk: int = 16) -> Pairs:
  """(h_t, cluster mass of p(· | s_≤t), argmax, E(x_t)) for every position of each
  sequence, from one full forward of the target per sequence. With `save_dir`, each
  `chunk` of sequences is written there as it is done and found again on a rerun (one
  forward of a 1.5B model takes seconds on a CPU, so a crash would otherwise lose half an
  hour)."""
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
    embed = nnx.merge(model.graphdef, state).embed(tokens)[0]  # what a draft step embeds
    return (out.hidden[0], mass.astype(jnp.float16), jnp.argmax(p, -1).astype(jnp.int32),
            embed.astype(jnp.float16))

  def one(g: int, seq: list[int]) -> dict[str, np.ndarray]:
    T = min(_padded_length(len(seq)), cfg.max_context)
    toks = jnp.asarray([seq + [0] * (T - len(seq))], jnp.int32)
    h, mass, top, embed = forward(model.state, KVCache.create(cfg, 1, T), toks, full)
    n = len(seq)
    return dict(hidden=np.asarray(h[:n], np.float32), mass=np.asarray(mass[:n]),
                target=np.asarray(top[:n]), group=np.full(n, g, np.int32),
                embed=np.asarray(embed[:n]))

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
              for k in _PAIR_FIELDS}
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


_PAIR_FIELDS = ("hidden", "mass", "target", "group", "embed")


def _chunk_key(model: str, clusters: VocabClusters, block) -> str:
  """What a saved chunk of pairs depends on: the model, the clusters, its sequences, and
  the fields a chunk holds (chunks saved before `embed` was kept are collected again)."""
  h = hashlib.sha256(repr((model, _PAIR_FIELDS)).encode())
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
                 inputs: str = DEFAULT_INPUTS, epochs: int = 10, batch: int = 256,
                 lr: float = 2e-3, val_share: float = 0.15, seed: int = 0,
                 weight: np.ndarray | None = None, verbose: bool = True) -> TrainResult:
  """AdamW on the soft cross-entropy to the target's cluster mass, for a router reading
  `inputs` (`INPUTS`); the validation split is by sequence, and the router returned is
  the epoch of lowest validation loss. `weight` (float[N], default 1) weighs each pair's
  loss, in training and validation, e.g. up for positions inside the model's own
  continuations, which are what a draft predicts."""
  from tqdm.auto import tqdm

  labels = clusters.assignment[pairs.target]
  groups = np.unique(pairs.group)
  rng = np.random.default_rng(seed)
  val_groups = rng.choice(groups, max(1, int(round(val_share * groups.size))), replace=False)
  rows = pairs.usable(inputs)
  is_val = np.isin(pairs.group[rows], val_groups)
  tr, va = rows[~is_val], rows[is_val]
  D, M = pairs.hidden.shape[1], clusters.num_clusters
  router = Router(D, M, hidden, inputs=inputs, rngs=nnx.Rngs(seed))
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
    loss, recall = evaluate(router, pairs.features(va, inputs), pairs.mass[va], labels[va],
                            w[va])
    return float(loss), float(recall)

  result = TrainResult(router, [float("nan")], *([v] for v in val()))
  best = (result.val_loss[0], nnx.clone(router))
  bar = tqdm(range(epochs), desc="router", unit="epoch", disable=not verbose)
  for _ in bar:
    order = rng.permutation(tr)
    batches = (order[i : i + batch] for i in range(0, order.size - batch + 1, batch))
    # Losses stay on the device until the epoch ends: one host read per epoch, not per step.
    losses = [step(router, opt, pairs.features(b, inputs), pairs.mass[b], w[b])
              for b in batches]
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
              core=None, where: np.ndarray | None = None) -> float:
  """Share of positions whose target top token lies in the router's top-k clusters (or in
  `core`, ids scored at every step), over the positions `where` (bool[N], default all)
  marks and its input exists at (`Pairs.usable`): for the all-layer draft, the share of
  its greedy drafts a k-cluster shortlist keeps. Mark positions with `where` rather than
  `select` them: a selected position's h̃_{t−1} may be a row left out."""
  rows = pairs.usable(router.inputs)
  if where is not None:
    rows = rows[np.asarray(where)[rows]]
  _, top = jax.lax.top_k(router(jnp.asarray(pairs.features(rows, router.inputs))), k)
  labels = clusters.assignment[pairs.target[rows]]
  hit = np.array(jnp.any(top == labels[:, None], axis=-1))
  if core is not None:
    hit |= np.isin(pairs.target[rows], np.asarray(core))
  return float(np.mean(hit))


def select(pairs: Pairs, mask: np.ndarray) -> Pairs:
  """The pairs at the positions `mask` marks: whole sequences, for an "embed_prev" router
  reads a row's h̃_{t−1} from the row before it (`recall_at`'s `where` scores a part)."""
  return Pairs(pairs.hidden[mask], pairs.mass[mask], pairs.target[mask], pairs.group[mask],
               None if pairs.embed is None else pairs.embed[mask])


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

  @property
  def inputs(self) -> str:
    """What the router reads (`INPUTS`)."""
    return self.router.inputs

  def plan_field(self, positions: int, k: int | None = None, core=None,
                 decay: bool | None = None) -> RouterPlan:
    """The router for a draft plan; `k` clusters per shortlist (default k_max), shrinking
    over the draft positions with `decay` (default: the bundle's). `core`: token ids the
    draft scores at every step anyway (`DraftPlan.vocab`); they are taken out of the
    clusters, so that no token is scored twice."""
    graphdef, state = nnx.split(self.router)
    decay = self.decay if decay is None else decay
    return RouterPlan(graphdef, state, jnp.asarray(self.clusters.without(core)),
                      k_schedule(self.k_max if k is None else k, positions, decay),
                      inputs=self.inputs)


def save_bundle(directory: str | Path, bundle: RouterBundle, **meta) -> None:
  c = bundle.clusters
  tree = {"router": nnx.to_pure_dict(nnx.state(bundle.router)), "centroids": c.centroids,
          "assignment": c.assignment, "table": c.table}
  checkpoint.save_tree(Path(directory), tree, dict(
      model=bundle.model, version=VERSION, inputs=bundle.inputs, k_max=bundle.k_max,
      hidden=bundle.hidden, decay=bundle.decay,
      clusters=c.num_clusters, capacity=c.capacity, embed_dim=int(c.centroids.shape[1]),
      vocab=int(c.assignment.size), objective=list(c.objective), **meta))


def load_bundle(directory: str | Path, *, model: str) -> RouterBundle:
  directory = Path(directory)
  meta = checkpoint.load_meta(directory)
  if meta.get("model") != model:
    raise RouterMismatchError(f"the router at {directory} was trained for "
                              f"{meta.get('model')}, not {model}: train one with "
                              f"`specjax router train --model {model}`")
  inputs = _inputs_of(meta)
  if inputs is None:
    raise RouterMismatchError(f"the router at {directory} is of an older design (version "
                              f"{meta.get('version', 1)}, this is {VERSION}): train it again "
                              f"with `specjax router train --model {model}`")
  D, M, cap, V = meta["embed_dim"], meta["clusters"], meta["capacity"], meta["vocab"]
  router = Router(D, M, meta["hidden"], inputs=inputs, rngs=nnx.Rngs(0))
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


def _inputs_of(meta: dict) -> str | None:
  """What a saved router reads; None for a design this one cannot read."""
  version = meta.get("version", 1)
  return {2: "hidden", VERSION: meta.get("inputs")}.get(version)


def is_current(directory: str | Path, inputs: str | None = None) -> bool:
  """A saved router exists at `directory`, of a design this one reads, and (given
  `inputs`) reading those inputs."""
  path = Path(directory) / "meta.json"
  if not path.exists():
    return False
  found = _inputs_of(checkpoint.load_meta(Path(directory)))
  return found is not None and (inputs is None or found == inputs)
