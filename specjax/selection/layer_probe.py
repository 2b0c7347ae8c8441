"""Sub-layer probes: one attention or MLP sub-layer applied to a batch of candidate
residual states, against the verified KV cache — the building block of the layer-selection
dynamic programs (CLaSp, KnapSpec).

A probe token at position p attends to the verified cache slots < p and to itself, with
its own K/V computed from the candidate state: what the first draft token of a round
sees. The tokens of a window are therefore independent of each other, and a batch of
candidates is a `vmap` over states with the cache shared (read once, never written).

Sub-layer i of a model with L layers: layer i // 2, attention if i is even, MLP if odd —
the order of the residuals the forward returns and of plan bits (`plan.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache_view import LayerView, Segment
from specjax.decode.verified_window import Window, push_step
from specjax.jit_cache import compiled
from specjax.kv_cache import KVCache
from specjax.model import Block, Transformer
from specjax.plan import DraftPlan


def attention_probe(block: Block, x: jax.Array, positions: jax.Array, cache_k: jax.Array,
                    cache_v: jax.Array) -> jax.Array:
  """x[W, D] -> the model's own attention sub-layer on each of the W tokens, token w
  reading the verified cache slots < positions[w] and itself (cache_k/v: [1, K, S, H],
  one layer of the verified cache): each token a batch of one, vmapped over W."""
  S = cache_k.shape[2]

  def one(x, p):
    valid = jnp.arange(S, dtype=jnp.int32)[None] < p
    layer = LayerView.reading((Segment.slots(cache_k, cache_v, valid),), p[None, None])
    out, _ = block.attn_sublayer(None, x[None, None], p[None, None], layer)
    return out[0, 0]

  return jax.vmap(one)(x, positions)


def mlp_probe(block: Block, x: jax.Array) -> jax.Array:
  """x[W, D] -> the model's own MLP sub-layer."""
  return block.mlp_sublayer(None, x)


def block_sublayers(block: Block, kinds: tuple[int, ...], x: jax.Array,
                    positions: jax.Array, cache_k: jax.Array, cache_v: jax.Array
                    ) -> jax.Array:
  """One layer's listed sub-layers (0 attention, 1 MLP), in order, on x[W, D]."""
  for kind in kinds:
    x = (attention_probe(block, x, positions, cache_k, cache_v) if kind == 0 else
         mlp_probe(block, x))
  return x


def run_sublayers(model: Transformer, sublayers: tuple[int, ...], x: jax.Array,
                  positions: jax.Array, cache: KVCache) -> jax.Array:
  """Apply the listed sub-layers in order to candidate states x[C, W, D]."""

  def one(x):
    for i in sublayers:
      l = i // 2
      x = block_sublayers(model.blocks[l], (i % 2,), x, positions, cache.k[l], cache.v[l])
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


def _residuals_fn(state, cache, tokens, start, *, graphdef):
  """(residuals [2L, T, D], the full model's top-1 next token [T]) of `tokens` at `start`."""
  from specjax.decode.generate import positions_for
  from specjax.model import apply

  view = cache.with_length(start)
  L = len(cache.k)
  out, _ = apply(state, view, tokens[None], positions_for(view, tokens.shape[0], 1),
                 DraftPlan.full(L), graphdef=graphdef, logits="all", return_residuals=True,
                 write_cache=False)
  return out.residuals[:, 0], jnp.argmax(out.logits[0], axis=-1).astype(jnp.int32)


full_residuals = jax.jit(_residuals_fn, static_argnames=("graphdef",))


def prompt_window(session, size: int) -> Window:
  """A window over the last `size` tokens already in the cache (the prompt right after
  prefill), with their full-model residuals from one teacher-forced pass that reads
  the cache and writes nothing. Shorter prompts leave the first rows invalid.

  Each row's next token is the target's own top-1 there, not the prompt text's next
  token: KnapSpec's α̂ is agreement with the target, and against the text even the full
  model agreed about half the time (on Qwen2.5-1.5B every candidate's α̂ came out
  deflated, the all-layer plan's to 0.5)."""
  end = int(session.cache.length)  # context[end] is the first generated token
  ctx = session.context
  n = min(size, end)
  start = end - n
  span = jnp.asarray(ctx[start:end] + [0] * (size - n), jnp.int32)  # padding after: causal
  args = (session.state, session.dense_cache(), span, jnp.int32(start))
  res, top = compiled(full_residuals, *args, graphdef=session.graphdef,
                      clock=session.clock)(*args)
  pad = size - n  # valid rows go last, as push_round expects
  positions = np.concatenate([np.full(pad, start, np.int32),
                              np.arange(start, end, dtype=np.int32)])
  rows = jnp.asarray(positions - start)
  return Window(tokens=jnp.asarray([ctx[p] for p in positions], jnp.int32),
                positions=jnp.asarray(positions),
                next_tokens=top[rows],
                residuals=res[:, rows], valid=jnp.asarray(np.arange(size) >= pad))


def push_round(window: Window, out, session) -> Window:
  """The window after one round: its verified rows (`round.RoundOut` with residuals)
  appended on device by `push_step`, compiled ahead of time per round shape."""
  n_commit = int(out.n_commit)
  start = len(session.context) - 1 - n_commit  # position of the round's first input
  args = (window, out.residuals, jnp.int32(session.context[start]), out.tokens,
          jnp.int32(start), jnp.int32(n_commit))
  return compiled(push_step, *args, clock=session.clock)(*args)


