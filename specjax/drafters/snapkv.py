"""`snapkv`: a sparse-KV self-speculative draft over SnapKV's selection of the prompt.

QuantSpec (Tiwari et al. 2025) measures its draft against self-speculative drafts that
read a sparse KV cache: StreamingLLM's fixed pattern (`streaming_kv`) and a SnapKV-style
selection (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
Generation"), which MagicDec also drafts with. SnapKV's observation: the last few prompt
tokens (the observation window) already attend to the prompt positions that generation
will; so, once per prompt, it scores every earlier position by the attention the window's
queries pay it, smooths the scores along the sequence, and keeps each head's top ones.

Constants are the public code's (github.com/FasterDecoding/SnapKV,
`snapkv/monkeypatch/snapkv_utils.py`): a window of 32 queries, softmax over every key
(causal within the window), the window's weights summed per key, an average pool of 5
positions (zero-padded at the ends), and the top `capacity - window` positions per head.
Two adaptations, each for a reason:

- grouped-query attention: the public code repeats the kv heads and selects per query
  head; a cache holds kv heads, so each kv head keeps the positions its query heads
  attend to most on average (what later GQA ports of SnapKV do);
- the budget is fixed: the draft reads `keep` selected slots plus the `recent` slots
  before the context's end (the window and the newest tokens), 512 in all by default as
  `streaming_kv` reads, so the two rivals cost the same attention at any context. SnapKV
  itself keeps every generated token; a static read keeps one executable.

The selection runs in `init`, after the prefill: one read-only forward of the window's
tokens recomputes their queries at every layer (our prefill keeps no attention weights),
then each layer's chosen K/V rows are copied out (`kv_cache.KeptKV`). Nothing is evicted:
verification reads the whole full-precision cache, so the output stays the target's.
Over a layer drafter it composes (`self_sd+snapkv`); with `quantspec` or `streaming_kv`
it does not (each decides how the draft reads the cache).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.base import Drafter
from specjax.drafters.overlay import OverlayDrafter
from specjax.jit_cache import compiled
from specjax.kv_cache import KeptKV, KVCache
from specjax.model import float32_dots, rotation
from specjax.plan import DraftPlan, PlanError

WINDOW = 32  # SnapKV's observation window
KERNEL = 5  # SnapKV's pooling kernel (average pooling)


@dataclasses.dataclass(frozen=True)
class SnapKVDrafter(OverlayDrafter):
  name = "snapkv"
  # kv_bits too: the draft reads the cache as stored (as `streaming_kv`).
  fields = ("kv_window", "kv_keep", "kv_bits")
  # Alone it is the whole model on part of the context: a fixed γ, as QuantSpec drafts.
  early_stop: ClassVar[float] = 0.0
  base: Drafter | None = None
  keep: int = 448  # selected prompt slots per kv head
  recent: int = 64  # slots before the context's end: the observation window and the newest
  window: int = WINDOW
  kernel: int = KERNEL

  def __post_init__(self):
    if self.keep < 1 or self.window < 1 or self.recent < self.window:
      raise PlanError(f"snapkv needs keep >= 1, window >= 1 and recent >= window (the "
                      f"observation window is read as recent slots), got keep={self.keep}, "
                      f"recent={self.recent}, window={self.window}")
    if self.kernel < 1 or self.kernel % 2 == 0:
      raise PlanError(f"snapkv's pooling kernel must be odd and positive (centred on a "
                      f"slot), got {self.kernel}")

  def overlay_plan(self, session) -> DraftPlan:
    if not isinstance(session.cache, KVCache):
      raise PlanError("snapkv reads a full-precision KVCache; a quantised one is QuantSpec's: "
                      "don't compose it with quantspec")
    L = session.config.num_layers
    length = len(session.context) - 1  # == cache.length: the last token is not in it yet
    tokens = jnp.asarray([session.context[max(length - self.window, 0):length]], jnp.int32)
    args = (session.state, session.cache, tokens)
    kept = compiled(select, *args, graphdef=session.graphdef, keep=self.keep,
                    recent=self.recent, kernel=self.kernel, clock=session.clock)(*args)
    return DraftPlan.full(L).replace(kv_window=(0, int(self.recent)), kv_keep=kept).check(L)


def pooled_scores(q: jax.Array, k: jax.Array, q_pos: jax.Array, end: jax.Array, *,
                  scale: float, kernel: int, window: int | None = None) -> jax.Array:
  """SnapKV's score of every slot of one cache layer k[B, K, S, H] for the observation
  window's queries q[B, W, N, H] at q_pos[B, W]: each query's softmax over the slots it
  may attend to (causal, and the layer's sliding `window`), summed over the queries and
  averaged over the query heads of each kv head, the window's own slots (>= `end`) zeroed,
  then averaged over `kernel` neighbouring slots (zero-padded). Returns float32[B, K, S]."""
  B, W, N, H = q.shape
  K, S = k.shape[1], k.shape[2]
  rows = q.reshape(B, W, K, N // K, H).astype(jnp.float32)
  s = jnp.einsum("bwkgh,bksh->bkgws", rows, k.astype(jnp.float32)) * scale
  slot = jnp.arange(S, dtype=jnp.int32)
  ok = slot[None, None, :] <= q_pos[:, :, None]  # [B, W, S]
  if window is not None:
    ok &= q_pos[:, :, None] - slot[None, None, :] < window
  p = jax.nn.softmax(jnp.where(ok[:, None, None], s, -jnp.inf), axis=-1)
  score = jnp.where(slot < end, p.sum(axis=3).mean(axis=2), 0.0)  # [B, K, S]
  pad = kernel // 2
  padded = jnp.pad(score, ((0, 0), (0, 0), (pad, pad)))
  return sum(padded[..., i:i + S] for i in range(kernel)) / kernel


def top_slots(score: jax.Array, limit: jax.Array, keep: int) -> tuple[jax.Array, jax.Array]:
  """The `keep` best slots < `limit` of score[B, K, S] per head, in slot order, and which
  of the `keep` rows hold one (bool[B, keep]: fewer when limit < keep)."""
  S = score.shape[-1]
  slot = jnp.arange(S, dtype=jnp.int32)
  _, idx = jax.lax.top_k(jnp.where(slot < limit, score, -jnp.inf), keep)
  chosen = jnp.sort(jnp.where(idx < limit, idx, S), axis=-1)  # the unchosen sort last
  valid = jnp.arange(keep) < jnp.minimum(limit, keep)
  return jnp.minimum(chosen, S - 1), jnp.broadcast_to(valid, score.shape[:1] + (keep,))


@functools.partial(jax.jit, static_argnames=("graphdef", "keep", "recent", "kernel"))
def select(state: nnx.State, cache: KVCache, tokens: jax.Array, *, graphdef: nnx.GraphDef,
           keep: int, recent: int, kernel: int) -> KeptKV:
  """SnapKV's selection from a prefilled cache: tokens[B, W] are the context's last W
  (the observation window, at slots length - W .. length - 1). Their queries come from a
  read-only forward over the cache before them, which recomputes what the prefill saw.
  Each layer keeps, per kv head, the `keep` slots of highest `pooled_scores` among those
  before the recent window (< length - recent), which the draft reads anyway."""
  model = nnx.merge(graphdef, state)
  config = model.config
  B, W = tokens.shape
  L, H = config.num_layers, config.head_dim
  length = cache.length
  q_pos = jnp.broadcast_to(length - W + jnp.arange(W, dtype=jnp.int32), (B, W))
  out, _ = model(tokens, q_pos, cache.with_length(length - W), DraftPlan.full(L),
                 logits="none", return_residuals=True, write_cache=False)
  inputs = [model.embed(tokens)] + [out.residuals[2 * l - 1] for l in range(1, L)]
  ks, vs, valid = [], [], None
  with float32_dots(inputs[0].dtype):
    for l, block in enumerate(model.blocks):
      rot = rotation(q_pos, block.attn.rope_base, H, block.attn.rope_scaling)
      q, _, _ = block.attn.project(block.attn_norm(inputs[l]), rot)
      score = pooled_scores(q, cache.k[l], q_pos, length - W, scale=config.scale,
                            kernel=kernel, window=block.attn.window)
      idx, valid = top_slots(score, length - recent, keep)
      take = lambda a: jnp.take_along_axis(a, idx[..., None], axis=2)
      ks.append(take(cache.k[l]))
      vs.append(take(cache.v[l]))
  return KeptKV(k=tuple(ks), v=tuple(vs), valid=valid)
