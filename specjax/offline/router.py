"""DynaSpec's router: which token clusters the next token is likely in.

A small MLP (Flax NNX) on [embedding(x_t), h_{t−1}] — the token being fed and the hidden
state before it, both RMS-normalised — scores the M clusters of `vocab_clusters`. It is
trained with optax (cross-entropy on the cluster of the token that followed) on pairs
from the model's own forward passes over training prompts and its greedy continuations
of them; evaluation prompts are never used.

In a draft, the union of the top-k(t) clusters is the LM-head shortlist, with k shrinking
with the draft position t: k(t) = k_max for t ≤ 1, ⌊k_max / ((t+1)·2)⌋ after (at least
1). `RouterPlan` carries the router into the jitted draft step, where it runs fused with
the draft forward (the DynaSpec paper computes it on a parallel stream).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.models import checkpoint
from specjax.offline.vocab_clusters import VocabClusters


class RouterMismatchError(SpecjaxError, ValueError):
  pass


def _rms(x):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Router(nnx.Module):
  def __init__(self, embed_dim: int, num_clusters: int, hidden: int = 512, *,
               rngs: nnx.Rngs):
    self.l1 = nnx.Linear(2 * embed_dim, hidden, rngs=rngs)
    self.l2 = nnx.Linear(hidden, num_clusters, rngs=rngs)

  def __call__(self, emb: jax.Array, h_prev: jax.Array) -> jax.Array:
    """[..., D], [..., D] -> cluster logits [..., M]."""
    x = jnp.concatenate([_rms(emb), _rms(h_prev)], axis=-1)
    return self.l2(jax.nn.gelu(self.l1(x)))


def k_schedule(k_max: int, positions: int) -> tuple[int, ...]:
  """Clusters per draft position: k_max for t <= 1, then floor(k_max / ((t+1)*2))."""
  return tuple(k_max if t <= 1 else max(k_max // ((t + 1) * 2), 1) for t in range(positions))


@flax.struct.dataclass
class RouterPlan:
  """The router inside a `DraftPlan`: params and the cluster table are traced, the
  module structure and the per-position k are static."""

  graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
  state: nnx.State
  table: jax.Array  # int32[M, capacity], -1 padded
  ks: tuple[int, ...] = flax.struct.field(pytree_node=False)  # k per draft position

  def shortlist(self, emb: jax.Array, h_prev: jax.Array, k: int) -> jax.Array:
    """Vocabulary ids of the top-k clusters, -1 padded: int32[k · capacity]."""
    scores = nnx.merge(self.graphdef, self.state)(emb, h_prev)
    _, top = jax.lax.top_k(scores, k)
    return self.table[top].reshape(-1)


# --- training data -------------------------------------------------------------------------


@dataclasses.dataclass
class Pairs:
  emb: np.ndarray  # float32[N, D]
  h_prev: np.ndarray  # float32[N, D]
  next_token: np.ndarray  # int32[N]
  group: np.ndarray  # int32[N] which sequence (for splits by prompt)


def collect_pairs(model, sequences, verbose: bool = True) -> Pairs:
  """(embedding(s_t), H_{t-1}) -> s_{t+1} for t >= 1 of each sequence, H from one full
  forward pass of the target."""
  from tqdm.auto import tqdm

  from specjax.kv_cache import KVCache
  from specjax.model import apply
  from specjax.plan import DraftPlan

  cfg = model.config
  full = DraftPlan.full(cfg.num_layers)

  # The cache and plan are arguments, not values made inside the jit: as constants XLA
  # spent seconds constant-folding reductions over the zero cache in every compile.
  @jax.jit
  def hidden(state, cache, tokens, plan):
    out, _ = apply(state, cache, tokens, jnp.arange(tokens.shape[1])[None], plan,
                   graphdef=model.graphdef, logits="none")
    emb = nnx.merge(model.graphdef, state).embed(tokens)
    return emb[0], out.hidden[0]

  rows = {k: [] for k in ("emb", "h_prev", "next_token", "group")}
  for g, seq in enumerate(tqdm(sequences, desc="router pairs", unit="seq",
                               disable=not verbose)):
    seq = list(seq)[: cfg.max_context]
    if len(seq) < 3:
      continue
    T = min(max(64, 1 << (len(seq) - 1).bit_length()), cfg.max_context)  # few compiles
    toks = jnp.asarray([seq + [0] * (T - len(seq))], jnp.int32)
    e, h = hidden(model.state, KVCache.create(cfg, 1, T), toks, full)
    n = len(seq) - 2  # t = 1 .. len-2
    rows["emb"].append(np.asarray(e[1 : 1 + n]))
    rows["h_prev"].append(np.asarray(h[:n]))
    rows["next_token"].append(np.asarray(seq[2 : 2 + n], np.int32))
    rows["group"].append(np.full(n, g, np.int32))
  return Pairs(**{k: np.concatenate(v) for k, v in rows.items()})


# --- training ------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
  router: Router
  train_loss: list[float]  # per epoch
  val_loss: list[float]
  val_recall: list[float]  # top-k_max recall of the next token's cluster, per epoch
  best_epoch: int = 0  # the router kept (lowest validation loss; 0 = before training)


def train_router(pairs: Pairs, clusters: VocabClusters, *, k_max: int, hidden: int = 512,
                 epochs: int = 8, batch: int = 256, lr: float = 2e-3, val_share: float = 0.15,
                 seed: int = 0, verbose: bool = True) -> TrainResult:
  """AdamW on cross-entropy over clusters; the validation split is by sequence, and the
  router returned is the epoch of lowest validation loss (it overfits small pair sets)."""
  from tqdm.auto import tqdm

  labels = clusters.assignment[pairs.next_token]
  groups = np.unique(pairs.group)
  rng = np.random.default_rng(seed)
  val_groups = rng.choice(groups, max(1, int(round(val_share * groups.size))), replace=False)
  is_val = np.isin(pairs.group, val_groups)
  tr, va = np.flatnonzero(~is_val), np.flatnonzero(is_val)
  D, M = pairs.emb.shape[1], clusters.num_clusters
  router = Router(D, M, hidden, rngs=nnx.Rngs(seed))
  opt = nnx.Optimizer(router, optax.adamw(optax.cosine_decay_schedule(lr, epochs * max(
      1, tr.size // batch))), wrt=nnx.Param)

  def loss_fn(r, e, h, y):
    logits = r(e, h)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @nnx.jit
  def step(r, o, e, h, y):
    loss, grads = nnx.value_and_grad(loss_fn)(r, e, h, y)
    o.update(r, grads)
    return loss

  @nnx.jit
  def evaluate(r, e, h, y):
    logits = r(e, h)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    _, top = jax.lax.top_k(logits, k_max)
    return loss, jnp.mean(jnp.any(top == y[:, None], axis=-1))

  def val():
    loss, recall = evaluate(router, pairs.emb[va], pairs.h_prev[va], labels[va])
    return float(loss), float(recall)

  result = TrainResult(router, [], [], [])
  v0 = val()
  result.val_loss.append(v0[0])
  result.val_recall.append(v0[1])
  result.train_loss.append(float("nan"))
  best = (v0[0], nnx.clone(router))
  bar = tqdm(range(epochs), desc="router", unit="epoch", disable=not verbose)
  for _ in bar:
    order = rng.permutation(tr)
    losses = []
    for i in range(0, order.size - batch + 1, batch):
      b = order[i : i + batch]
      losses.append(float(step(router, opt, pairs.emb[b], pairs.h_prev[b], labels[b])))
    vl, vr = val()
    result.train_loss.append(float(np.mean(losses)) if losses else float("nan"))
    result.val_loss.append(vl)
    result.val_recall.append(vr)
    bar.set_postfix(train=f"{result.train_loss[-1]:.3f}", val=f"{vl:.3f}", recall=f"{vr:.2f}")
    if vl < best[0]:
      best = (vl, nnx.clone(router))
  result.router = best[1]
  result.best_epoch = int(np.argmin(result.val_loss))
  return result


def recall_at(router: Router, pairs: Pairs, clusters: VocabClusters, k: int) -> float:
  """Share of pairs whose next token lies in the router's top-k clusters."""
  scores = router(jnp.asarray(pairs.emb), jnp.asarray(pairs.h_prev))
  _, top = jax.lax.top_k(scores, k)
  labels = clusters.assignment[pairs.next_token]
  return float(jnp.mean(jnp.any(top == labels[:, None], axis=-1)))


# --- storage -------------------------------------------------------------------------------


@dataclasses.dataclass
class RouterBundle:
  """Everything DynaSpec needs, saved together: router, clusters, and what it was for."""

  model: str
  router: Router
  clusters: VocabClusters
  k_max: int
  hidden: int

  def plan_field(self, positions: int) -> RouterPlan:
    graphdef, state = nnx.split(self.router)
    return RouterPlan(graphdef, state, jnp.asarray(self.clusters.table),
                      k_schedule(self.k_max, positions))


def save_bundle(directory: str | Path, bundle: RouterBundle, **meta) -> None:
  c = bundle.clusters
  tree = {"router": nnx.to_pure_dict(nnx.state(bundle.router)), "centroids": c.centroids,
          "assignment": c.assignment, "table": c.table}
  checkpoint.save_tree(Path(directory), tree, dict(
      model=bundle.model, k_max=bundle.k_max, hidden=bundle.hidden,
      clusters=c.num_clusters, capacity=c.capacity, embed_dim=int(c.centroids.shape[1]),
      vocab=int(c.assignment.size), objective=list(c.objective), **meta))


def load_bundle(directory: str | Path, *, model: str) -> RouterBundle:
  directory = Path(directory)
  meta = checkpoint.load_meta(directory)
  if meta.get("model") != model:
    raise RouterMismatchError(f"the router at {directory} was trained for "
                              f"{meta.get('model')}, not {model}: train one with "
                              f"`specjax router train --model {model}`")
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
  return RouterBundle(model, router, clusters, meta["k_max"], meta["hidden"])
