"""A draft whose plan is host data: one executable per sub-layer, called for the sub-layers
the plan runs, as an eager PyTorch drafter calls its chosen layers.

The traced path (`round.draft_fn`) puts every sub-layer in a `lax.cond`: one executable
serves every plan, and on a CPU a skipped sub-layer really costs nothing. XLA:GPU copies
each predicate to the host and waits, 2L times a draft step (docs/GPU.md). Here the host
reads the plan's masks once per round and dispatches, per draft step: the embedding, then
an attention executable and an MLP executable for each sub-layer the plan runs, then the
head and the choice of the token. Nothing waits on the device except the draft's early
stop (one read per step, and only when a threshold is set). Every layer of one shape
shares its executables, so a new plan value, or a new number of sub-layers run, compiles
nothing; the price is a dispatch per sub-layer and no fusion across sub-layers.

Each executable runs the decoder's own sub-layer (`Block.attn_sublayer`, `mlp_sublayer`)
over a one-layer slice of the verified cache and of the draft buffer, so the arithmetic
is the traced path's, without its conditionals: the two draft the same tokens (the tests
check every adaptive drafter). Which path a backend takes is `ops.plan_path`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.decode.round import Draft, _choose, check_router_input
from specjax.jit_cache import CompileClock, compiled
from specjax.kv_cache import DraftBuffer
from specjax.model import float32_dots
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams


def one_layer(cache, l: int):
  """`cache` (a `KVCache`, `QuantKVCache` or `DraftBuffer`: per-layer tuples beside shared
  fields) cut to layer l: each tuple becomes the 1-tuple of its l-th entry."""
  per_layer = {f.name: (getattr(cache, f.name)[l],) for f in dataclasses.fields(cache)
               if isinstance(getattr(cache, f.name), tuple)}
  return cache.replace(**per_layer)


def _attention(block_state, cache, buffer, x, weights, kept, *, graphdef, bits, window):
  """One attention sub-layer of a draft step over one layer's cache and buffer (and its
  kept slots, `plan.kv_keep` cut to the layer); the token's position is the buffer's row
  past the verified cache. Returns x and the buffer's layer with the token's K/V in its
  row."""
  block = nnx.merge(graphdef, block_state)
  positions = jnp.reshape(cache.length + buffer.count, (1, 1))
  view = buffer.view(cache.view(positions, write=False, dense=False, bits=bits,
                                window=window, kept=kept), cache.length)
  with float32_dots(x.dtype):
    x, layer = block.attn_sublayer(None, x, positions, view.layer(0), weights)
  view.keep(0, layer, None, x)
  out = view.result()
  return x, out.k[0], out.v[0]


def _mlp(block_state, x, weights, *, graphdef):
  block = nnx.merge(graphdef, block_state)
  with float32_dots(x.dtype):
    return block.mlp_sublayer(None, x, weights)


def _embed(state, token, *, graphdef):
  return nnx.merge(graphdef, state).embed(token[None, None])


def _choose_token(state, x, plan, key, i, drafts, conf, q_rows, token, prev, *, graphdef,
                  vocab, sampling, threshold):
  """The head and the choice of draft step i (which fed `token`), written into the round's
  arrays, with the traced path's key split. Returns the token, the arrays, the next key,
  whether the draft goes on (its top-1 probability is at least the threshold) and the
  step's final hidden state, the next step's h̃_{t−1} (`prev` is this one's)."""
  model = nnx.merge(graphdef, state)
  key, sub = jax.random.split(key)
  h = x[0, -1].astype(jnp.float32)
  if plan.router is not None:  # DynaSpec: a shortlist chosen per step by the router
    features = plan.router.features(h, model.embed(token[None, None])[0, 0], prev)
    ids, logits = model.routed_head(h, features, i, plan)
  else:
    with float32_dots(x.dtype):
      last = x[:, -1:]
      logits = (model.head(last, plan.weights) if plan.vocab is None else
                model.head_shortlist(last, plan.vocab, plan.weights, plan.head_rows))[0, 0]
    ids = plan.vocab
  nxt, confidence, q = _choose(logits, ids, sub, vocab, sampling)
  if q is not None:
    q_rows = q_rows.at[i].set(q)
  drafts = drafts.at[i].set(nxt)
  conf = conf.at[i].set(confidence.astype(jnp.float32))
  return nxt, drafts, conf, q_rows, key, confidence >= (
      threshold if plan.stop is None else plan.stop), None if plan.router is None else h


_STEPS = {fn: jax.jit(fn, static_argnames=names) for fn, names in (
    (_attention, ("graphdef", "bits", "window")), (_mlp, ("graphdef",)), (_embed, ("graphdef",)),
    (_choose_token, ("graphdef", "vocab", "sampling", "threshold")))}


@dataclasses.dataclass
class DispatchedDraft:
  """`round.draft_step`'s counterpart for a plan held on the host: called with the same
  arguments, it returns the same `Draft`. Its executables compile on first use, booked
  on `clock`, and are kept per layer shape (gemma3's sliding and global layers: two)."""

  graphdef: nnx.GraphDef
  state: nnx.State
  vocab: int
  gamma: int
  threshold: float
  sampling: SamplingParams
  clock: CompileClock | None = None
  blocks: list = dataclasses.field(default_factory=list)  # per layer (graphdef, state)
  programs: dict = dataclasses.field(default_factory=dict)
  embed_dim: int = dataclasses.field(init=False, default=0)

  def __post_init__(self):
    model = nnx.merge(self.graphdef, self.state)
    self.embed_dim = model.config.embed_dim
    shapes: list[nnx.GraphDef] = []  # one graphdef object per distinct layer shape
    for block in model.blocks:
      gd, st = nnx.split(block)
      same = next((s for s in shapes if s == gd), None)
      if same is None:
        shapes.append(gd)
        same = gd
      self.blocks.append((same, st))

  def _program(self, fn, *args, **static):
    key = (fn, tuple(id(v) if isinstance(v, nnx.GraphDef) else v for v in static.values()))
    if key not in self.programs:
      self.programs[key] = compiled(_STEPS[fn], *args, clock=self.clock, **static)
    return self.programs[key]

  def __call__(self, state, cache, last, plan: DraftPlan, key, limit=None,
               hidden=None) -> Draft:
    """Up to min(γ, limit) draft steps under `plan`, reading `cache` only; `hidden` as
    `round.draft_fn` takes it."""
    plan.check(len(self.blocks))
    prev = check_router_input(plan, hidden, self.embed_dim)
    attn, mlp = np.asarray(plan.attn), np.asarray(plan.mlp)  # the round's one plan read
    layer_weights = ([None] * len(self.blocks) if plan.weights is None
                     else list(plan.weights.layers))
    steps = self.gamma if limit is None else min(self.gamma, int(limit))
    buffer = DraftBuffer.like(cache, self.gamma)
    bk, bv = list(buffer.k), list(buffer.v)
    caches = [one_layer(cache, l) for l in range(len(self.blocks))]
    kept = [None if plan.kv_keep is None else one_layer(plan.kv_keep, l)
            for l in range(len(self.blocks))]
    drafts = jnp.zeros((self.gamma,), jnp.int32)
    conf = jnp.zeros((self.gamma,), jnp.float32)
    q_rows = None if self.sampling.greedy else jnp.zeros((self.gamma + 1, self.vocab),
                                                          jnp.float32)
    token, n = last, 0
    for i in range(steps):
      row = np.int32(i)
      x = self._program(_embed, state, token, graphdef=self.graphdef)(state, token)
      for l, (gd, block_state) in enumerate(self.blocks):
        w = layer_weights[l]
        if attn[l]:
          layer_buffer = DraftBuffer(k=(bk[l],), v=(bv[l],), count=row)
          args = (block_state, caches[l], layer_buffer, x, w, kept[l])
          x, bk[l], bv[l] = self._program(_attention, *args, graphdef=gd,
                                          bits=plan.kv_bits,
                                          window=plan.kv_window)(*args)
        if mlp[l]:
          args = (block_state, x, w)
          x = self._program(_mlp, *args, graphdef=gd)(*args)
      args = (state, x, plan, key, row, drafts, conf, q_rows, token, prev)
      token, drafts, conf, q_rows, key, go, prev = self._program(
          _choose_token, *args, graphdef=self.graphdef, vocab=self.vocab,
          sampling=self.sampling, threshold=self.threshold)(*args)
      n = i + 1
      early_stop = self.threshold > 0.0 or plan.stop is not None
      if early_stop and not bool(go):  # the one read a step waits for
        break
    return Draft(jnp.int32(n), drafts, conf, q_rows)

