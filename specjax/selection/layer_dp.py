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
context lengths or latency weights reuse one executable; only the item kind (sub-layers
or coupled layers), the number of slots and the window size are static. The items are
a `lax.scan` over layers, so the program holds one layer's items, not every item of the
model: on SmolLM2 compiling the DP took 24-46 s with the items unrolled and takes 3 s,
and a DP runs as fast as before (measured in one process, alternating the two).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from specjax.jit_cache import CompileClock, compiled
from specjax.kv_cache import KVCache
from specjax.model import Transformer
from specjax.selection.layer_probe import Window, block_sublayers, window_cosine

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


@flax.struct.dataclass
class _Table:
  """The DP's table after some items: every slot's best state and how it scores."""

  x: jax.Array  # [C, W, D] residual state of the window tokens
  alive: jax.Array  # bool[C] a path reaches this slot (unpruned)
  cosine: jax.Array  # float[C] mean cosine to the full model's residual there


def _advance(table: _Table, run: jax.Array, target: jax.Array, window: Window,
             run_cost: jax.Array, skip_cost: jax.Array, tau: jax.Array
             ) -> tuple[_Table, jax.Array]:
  """One item: each slot keeps the better of running it (`run`: the item applied to
  every slot's state) and skipping it, each shifted by its cost. Returns the new table
  and which slots ran the item."""
  run = _shift(run, run_cost, 0.0)
  skip = _shift(table.x, skip_cost, 0.0)
  c_run = jnp.where(_shift(table.alive, run_cost, False),
                    window_cosine(run, target, window.valid), _DEAD)
  c_skip = jnp.where(_shift(table.alive, skip_cost, False),
                     window_cosine(skip, target, window.valid), _DEAD)
  take_run = c_run > c_skip  # ties (both dead included) skip
  cos = jnp.maximum(c_run, c_skip)
  x = jnp.where(take_run[:, None, None], run, skip)
  return _Table(x, alive=cos >= tau, cosine=cos), take_run  # dead paths: cosine -inf


def _segments(model: Transformer) -> list[tuple[int, ...]]:
  """Runs of consecutive layers whose blocks share one graph definition and one state
  structure: all layers of most models, gemma3's runs of local layers and each global
  layer apart (their window and rope base are static attributes), and, for a target in
  its GGUF blocks, runs of layers whose matrices have the same block types (a Q4_K_M file
  gives some layers Q6_K rows where others have Q4_K: static metadata of their leaves)."""
  defs = [(nnx.graphdef(block), jax.tree.structure(nnx.state(block)))
          for block in model.blocks]
  runs = [[0]]
  for l in range(1, len(defs)):
    if defs[l] == defs[l - 1]:
      runs[-1].append(l)
    else:
      runs.append([l])
  return [tuple(r) for r in runs]


def _backtrack(choices: jax.Array, run_cost: jax.Array, skip_cost: jax.Array) -> jax.Array:
  """Which items each slot's path ran, from the choices the table made at every item
  (`choices[j, s]`: slot s ran item j): walked back from the last item. -> bool[I, C]"""

  def back(slot, j):
    ran = choices[j, slot]
    return slot - jnp.where(ran, run_cost[j], skip_cost[j]), ran

  slots = jnp.arange(choices.shape[1])
  _, ran = jax.lax.scan(back, slots, jnp.arange(choices.shape[0])[::-1])
  return ran[::-1]


def _layer_reader(model: Transformer, cache: KVCache, layers: tuple[int, ...]):
  """i -> (block state, cache k, cache v) of layer `layers[i]` for a traced i: a switch
  whose taken branch copies that one layer's arrays into a buffer the loop reuses.
  Stacking every layer's weights instead wrote a fresh copy of them on each call; its
  page faults made a CLaSp DP on SmolLM2 60 % slower than the unrolled items."""
  branches = [lambda s=nnx.state(model.blocks[l]), k=cache.k[l], v=cache.v[l]: (s, k, v)
              for l in layers]
  return lambda i: jax.lax.switch(i, branches)


def _dp(state, cache, window, run_cost, skip_cost, tau, *, graphdef, coupled, slots,
        agreement):
  """The table advanced item by item: a `lax.scan` over each run of identical layers,
  so compiling costs one layer's items per run, not every item of the model."""
  model = nnx.merge(graphdef, state)
  L = model.config.num_layers
  per_layer = 1 if coupled else 2  # items per layer
  x0 = model.embed(window.tokens[None])[0]  # [W, D]
  table = _Table(x=jnp.broadcast_to(x0, (slots,) + x0.shape),
                 alive=jnp.arange(slots) == 0, cosine=jnp.zeros((slots,), jnp.float32))
  # each item's costs and target (the full model's residual after its last sub-layer)
  run_cost, skip_cost = run_cost.reshape(L, per_layer), skip_cost.reshape(L, per_layer)
  targets = window.residuals.reshape((L, 2) + window.residuals.shape[1:])
  targets = targets[:, 1:] if coupled else targets  # [L, per_layer, W, D]
  item_subs = ((0, 1),) if coupled else ((0,), (1,))  # sub-layers of a layer's items

  def layer_step(block_def, read, table, xs):
    i, run_c, skip_c, target = xs
    block_state, k, v = read(i)
    block = nnx.merge(block_def, block_state)
    ran = []
    for j, subs in enumerate(item_subs):
      run = jax.vmap(lambda x: block_sublayers(block, subs, x, window.positions, k, v)
                     )(table.x)
      table, took = _advance(table, run, target[j], window, run_c[j], skip_c[j], tau)
      ran.append(took)
    return table, jnp.stack(ran)  # [per_layer, C]

  choices = []
  for layers in _segments(model):
    idx = jnp.asarray(layers)
    step = functools.partial(layer_step, nnx.graphdef(model.blocks[layers[0]]),
                             _layer_reader(model, cache, layers))
    xs = (jnp.arange(len(layers)), run_cost[idx], skip_cost[idx], targets[idx])
    table, ran = jax.lax.scan(step, table, xs)
    choices.append(ran.reshape(-1, slots))
  ran = _backtrack(jnp.concatenate(choices), run_cost.reshape(-1), skip_cost.reshape(-1))
  bits = jnp.repeat(ran, 2 // per_layer, axis=0).T  # [C, 2L]: a coupled item is 2 bits
  if agreement:
    logits = model.head(table.x)  # [C, W, V]
    hit = (jnp.argmax(logits, -1) == window.next_tokens[None]) & window.valid[None]
    agree = jnp.sum(hit, -1) / jnp.maximum(jnp.sum(window.valid), 1)
  else:
    agree = jnp.zeros((slots,), jnp.float32)
  return Candidates(bits=bits, alive=table.alive, cosine=table.cosine,
                    agreement=agree.astype(jnp.float32))


layer_dp = jax.jit(_dp, static_argnames=("graphdef", "coupled", "slots", "agreement"))


def sublayer_items(num_layers: int, coupled: bool) -> tuple[tuple[int, ...], ...]:
  """Items in model order: each sub-layer alone, or (attention, MLP) per layer."""
  if coupled:
    return tuple((2 * l, 2 * l + 1) for l in range(num_layers))
  return tuple((i,) for i in range(2 * num_layers))


def run_dp(state: nnx.State, cache: KVCache, window: Window, run_cost, skip_cost,
           tau: float, *, graphdef: nnx.GraphDef, coupled: bool, slots: int,
           agreement: bool, clock: CompileClock | None = None) -> Candidates:
  """`layer_dp` with host-side costs (one per item of `sublayer_items(L, coupled)`)
  converted to device arrays, compiled ahead of time (a compile is booked on `clock`, so
  callers' timers can tell compilation from work)."""
  args = (state, cache, window, jnp.asarray(run_cost, jnp.int32),
          jnp.asarray(skip_cost, jnp.int32), jnp.float32(tau))
  return compiled(layer_dp, *args, graphdef=graphdef, coupled=coupled, slots=slots,
                  agreement=agreement, clock=clock)(*args)
