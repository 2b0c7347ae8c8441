"""Sub-layer probes: one attention or MLP sub-layer applied to a batch of candidate
residual states, against the verified KV cache — the building block of the layer-selection
dynamic programs (CLaSp, KnapSpec).

A probe token at position p attends to the verified cache slots < p and to itself, with
its own K/V computed from the candidate state: what the first draft token of a round
sees. The tokens of a window are therefore independent of each other, and a batch of
candidates is a `vmap` over states with the cache shared (read once, never written).

Sub-layer i of a model with L layers: layer i // 2, attention if i is even, MLP if odd —
the order of the residuals the forward returns ([attn_0, mlp_0, attn_1, ...]).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.jit_cache import compiled
from specjax.kv_cache import KVCache
from specjax.model import Block, Transformer
from specjax.plan import DraftPlan

_NEG_INF = -1e30


@flax.struct.dataclass
class Window:
  """The last W verified tokens with the full model's residuals after every sub-layer."""

  tokens: jax.Array  # int32[W] input token at each position
  positions: jax.Array  # int32[W]
  next_tokens: jax.Array  # int32[W] the token that followed (the target's choice)
  residuals: jax.Array  # [2L, W, D] full-model residual after each sub-layer
  valid: jax.Array  # bool[W]

  @property
  def size(self) -> int:
    return self.tokens.shape[0]


def attention_probe(block: Block, x: jax.Array, positions: jax.Array, cache_k: jax.Array,
                    cache_v: jax.Array) -> jax.Array:
  """x[W, D] -> x + attention(x): token w attends to cache slots < positions[w] and to
  itself (cache_k/v: [1, K, S, H], the verified cache of this layer)."""
  attn = block.attn
  cfg = attn.config
  W = x.shape[0]
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q, k, v = attn.project(block.attn_norm(x[None]), positions[None])
  qg = q[0].reshape(W, K, N // K, H)
  ck, cv = cache_k[0].astype(x.dtype), cache_v[0].astype(x.dtype)  # [K, S, H]
  s_ctx = jnp.einsum("wkgh,ksh->wkgs", qg, ck) * cfg.scale
  s_self = jnp.einsum("wkgh,wkh->wkg", qg, k[0]) * cfg.scale
  slot = jnp.arange(ck.shape[1], dtype=jnp.int32)
  ok = slot[None, :] < positions[:, None]  # [W, S]
  if attn.window is not None:
    ok &= positions[:, None] - slot[None, :] < attn.window
  s_ctx = jnp.where(ok[:, None, None], s_ctx.astype(jnp.float32), _NEG_INF)
  p = jax.nn.softmax(jnp.concatenate([s_ctx, s_self[..., None].astype(jnp.float32)], -1), -1)
  p = p.astype(x.dtype)
  out = jnp.einsum("wkgs,ksh->wkgh", p[..., :-1], cv) + p[..., -1:] * v[0][:, :, None, :]
  out = jnp.einsum("wnh,nhd->wd", out.reshape(W, N, H), attn.o[...])
  return x + (block.post_attn_norm(out) if block.post_norms else out)


def mlp_probe(block: Block, x: jax.Array) -> jax.Array:
  """x[W, D] -> x + mlp(x)."""
  out = block.mlp(block.mlp_norm(x))
  return x + (block.post_mlp_norm(out) if block.post_norms else out)


def run_sublayers(model: Transformer, sublayers: tuple[int, ...], x: jax.Array,
                  positions: jax.Array, cache: KVCache) -> jax.Array:
  """Apply the listed sub-layers in order to candidate states x[C, W, D]."""

  def one(x):
    for i in sublayers:
      block = model.blocks[i // 2]
      if i % 2 == 0:
        x = attention_probe(block, x, positions, cache.k[i // 2], cache.v[i // 2])
      else:
        x = mlp_probe(block, x)
    return x

  return jax.vmap(one)(x)


def window_cosine(x: jax.Array, target: jax.Array, valid: jax.Array) -> jax.Array:
  """Mean over valid tokens of cos(x[c, w], target[w]); x[C, W, D] -> [C]."""
  x32, t32 = x.astype(jnp.float32), target.astype(jnp.float32)
  dot = jnp.einsum("cwd,wd->cw", x32, t32)
  norms = jnp.linalg.norm(x32, axis=-1) * jnp.linalg.norm(t32, axis=-1)[None]
  cos = dot / jnp.maximum(norms, 1e-12)
  w = valid.astype(jnp.float32)
  return jnp.sum(cos * w, axis=-1) / jnp.maximum(jnp.sum(w), 1.0)


def bits_to_plan(bits: np.ndarray) -> DraftPlan:
  """bool[2L] in sub-layer order (attn_0, mlp_0, attn_1, ...) -> DraftPlan."""
  bits = np.asarray(bits, bool)
  return DraftPlan.from_masks(bits[0::2], bits[1::2])


def plan_to_bits(plan: DraftPlan) -> np.ndarray:
  bits = np.empty(2 * plan.num_layers, bool)
  bits[0::2], bits[1::2] = np.asarray(plan.attn), np.asarray(plan.mlp)
  return bits


def _residuals_fn(state, cache, tokens, start, *, graphdef):
  from specjax.decode.generate import positions_for
  from specjax.model import apply

  view = cache.with_length(start)
  L = len(cache.k)
  out, _ = apply(state, view, tokens[None], positions_for(view, tokens.shape[0], 1),
                 DraftPlan.full(L), graphdef=graphdef, logits="none", return_residuals=True,
                 write_cache=False)
  return out.residuals[:, 0]


full_residuals = jax.jit(_residuals_fn, static_argnames=("graphdef",))


def prompt_window(session, size: int) -> Window:
  """A window over the last `size` tokens already in the cache (the prompt right after
  prefill), with their full-model residuals from one teacher-forced pass that reads
  the cache and writes nothing. Shorter prompts leave the first rows invalid."""
  end = int(session.cache.length)  # context[end] is the first generated token
  ctx = session.context
  n = min(size, end)
  start = end - n
  span = jnp.asarray(ctx[start:end] + [0] * (size - n), jnp.int32)  # padding after: causal
  args = (session.state, session.dense_cache(), span, jnp.int32(start))
  res = compiled(full_residuals, *args, graphdef=session.graphdef)(*args)
  pad = size - n  # valid rows go last, as push_round expects
  positions = np.concatenate([np.full(pad, start, np.int32),
                              np.arange(start, end, dtype=np.int32)])
  rows = jnp.asarray(positions - start)
  return Window(tokens=jnp.asarray([ctx[p] for p in positions], jnp.int32),
                positions=jnp.asarray(positions),
                next_tokens=jnp.asarray([ctx[p + 1] for p in positions], jnp.int32),
                residuals=res[:, rows], valid=jnp.asarray(np.arange(size) >= pad))


def push_round(window: Window, out, session) -> Window:
  """The window after one round: its verified rows (`engine.RoundOut` with residuals)
  appended on device by `push_step`, compiled ahead of time per round shape."""
  n_commit = int(out.n_commit)
  start = len(session.context) - 1 - n_commit  # position of the round's first input
  args = (window, out.residuals, jnp.int32(session.context[start]), out.tokens,
          jnp.int32(start), jnp.int32(n_commit))
  return compiled(push_step, *args)(*args)


@jax.jit
def push_step(window: Window, residuals: jax.Array, last: jax.Array, committed: jax.Array,
               start: jax.Array, n_commit: jax.Array) -> Window:
  """Append one round's verified rows (the first n_commit of [last, accepted drafts]) and
  keep the newest W. residuals[2L, T, D] come from the verify pass, committed[T] are the
  round's committed tokens, `start` the position of `last`."""
  W, T = window.size, committed.shape[0]
  inputs = jnp.concatenate([last[None], committed[:-1]])

  def newest(old, new, axis=0):
    both = jnp.concatenate([old, new.astype(old.dtype)], axis=axis)
    return jax.lax.dynamic_slice_in_dim(both, n_commit, W, axis=axis)

  return Window(tokens=newest(window.tokens, inputs),
                positions=newest(window.positions, start + jnp.arange(T, dtype=jnp.int32)),
                next_tokens=newest(window.next_tokens, committed),
                residuals=newest(window.residuals, residuals, axis=1),
                valid=newest(window.valid, jnp.arange(T) < n_commit))
