"""One dynamic program over sub-layers, for CLaSp and KnapSpec.

Items are groups of sub-layers taken in model order (one sub-layer each for KnapSpec,
a whole layer each for CLaSp or KnapSpec's coupled ablation). Table entry s after item j
is the best residual state of the window tokens among paths whose accumulated cost is s:
running item j costs `run_cost[j]`, skipping it `skip_cost[j]`. KnapSpec counts latency
weights of what runs (skip cost 0); CLaSp counts skipped layers (run cost 0). "Best" is
the higher mean cosine to the full model's residual after item j, as in both papers;
states below `tau` are pruned.

Every slot (every budget) is advanced at once: the run branch is one `vmap`ped call of
the item's sub-layers over all slot states (the cache is read, never written), then
shifted by the traced cost. Costs, states and windows are traced, so new hidden states,
context lengths or latency weights reuse one executable; only the items, the number of
slots and the window size are static.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from specjax.jit_cache import CompileClock, compiled
from specjax.kv_cache import KVCache
from specjax.selection.layer_probe import Window, run_sublayers, window_cosine

_DEAD = -jnp.inf


@flax.struct.dataclass
class Candidates:
  """One candidate plan per slot (budget)."""

  bits: jax.Array  # bool[C, 2L] sub-layers that run (attn_0, mlp_0, attn_1, ...)
  alive: jax.Array  # bool[C] a path reaches this slot (unpruned)
  cosine: jax.Array  # float[C] mean cosine of the final state to the full model's
  agreement: jax.Array  # float[C] top-1 agreement with the target over the window (α̂)


def _shift(x: jax.Array, by: jax.Array, fill) -> jax.Array:
  """y[s] = x[s - by] for s >= by, else `fill` (shift along axis 0 by a traced amount)."""
  idx = jnp.arange(x.shape[0]) - by
  y = jnp.take(x, jnp.clip(idx, 0, x.shape[0] - 1), axis=0)
  keep = (idx >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.where(keep, y, fill)


def _dp(state, cache, window, run_cost, skip_cost, tau, *, graphdef, items, slots,
        agreement):
  model = nnx.merge(graphdef, state)
  num_sublayers = 2 * model.config.num_layers
  x0 = model.embed(window.tokens[None])[0]  # [W, D]
  x = jnp.broadcast_to(x0, (slots,) + x0.shape)
  alive = jnp.arange(slots) == 0
  cos = jnp.zeros((slots,), jnp.float32)
  choices = []
  for j, sub in enumerate(items):
    target = window.residuals[sub[-1]]
    run = _shift(run_sublayers(model, sub, x, window.positions, cache), run_cost[j], 0.0)
    skip = _shift(x, skip_cost[j], 0.0)
    c_run = jnp.where(_shift(alive, run_cost[j], False),
                      window_cosine(run, target, window.valid), _DEAD)
    c_skip = jnp.where(_shift(alive, skip_cost[j], False),
                       window_cosine(skip, target, window.valid), _DEAD)
    take_run = c_run > c_skip  # ties (both dead included) skip
    x = jnp.where(take_run[:, None, None], run, skip)
    cos = jnp.maximum(c_run, c_skip)
    alive = cos >= tau  # dead paths have cosine -inf
    choices.append(take_run)
  choices = jnp.stack(choices)  # [I, C]

  def back(slot, j):
    ran = choices[j, slot]
    return slot - jnp.where(ran, run_cost[j], skip_cost[j]), ran

  _, ran = jax.lax.scan(back, jnp.arange(slots), jnp.arange(len(items))[::-1])
  ran = ran[::-1]  # [I, C]
  bits = jnp.zeros((slots, num_sublayers), jnp.bool_)
  for j, sub in enumerate(items):
    for i in sub:
      bits = bits.at[:, i].set(ran[j])
  if agreement:
    logits = model.head(x)  # [C, W, V]
    hit = (jnp.argmax(logits, -1) == window.next_tokens[None]) & window.valid[None]
    agree = jnp.sum(hit, -1) / jnp.maximum(jnp.sum(window.valid), 1)
  else:
    agree = jnp.zeros((slots,), jnp.float32)
  return Candidates(bits=bits, alive=alive, cosine=cos, agreement=agree.astype(jnp.float32))


layer_dp = jax.jit(_dp, static_argnames=("graphdef", "items", "slots", "agreement"))


def sublayer_items(num_layers: int, coupled: bool) -> tuple[tuple[int, ...], ...]:
  """Items in model order: each sub-layer alone, or (attention, MLP) per layer."""
  if coupled:
    return tuple((2 * l, 2 * l + 1) for l in range(num_layers))
  return tuple((i,) for i in range(2 * num_layers))


def run_dp(state: nnx.State, cache: KVCache, window: Window, run_cost, skip_cost,
           tau: float, *, graphdef: nnx.GraphDef, items, slots: int,
           agreement: bool, clock: CompileClock | None = None) -> Candidates:
  """`layer_dp` with host-side costs converted to device arrays, compiled ahead of time
  (a compile is booked on `clock`, so callers' timers can tell compilation from work)."""
  args = (state, cache, window, jnp.asarray(run_cost, jnp.int32),
          jnp.asarray(skip_cost, jnp.int32), jnp.float32(tau))
  return compiled(layer_dp, *args, graphdef=graphdef, items=items, slots=slots,
                  agreement=agreement, clock=clock)(*args)
