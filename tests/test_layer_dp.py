"""The layer-selection DP (CLaSp, KnapSpec): sub-layer probes equal the model's own
read-only forward, the batched DP equals a brute-force walk of the same recursion over
every subset, each budget's candidate equals a DP run for that budget alone, and new
states or weights never recompile."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.config import tiny_config
from specjax.decode.generate import prefill_step
from specjax.jit_cache import CompileClock
from specjax.kv_cache import KVCache
from specjax.model import apply, init_model
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams
from specjax.selection.layer_dp import layer_dp, run_dp, sublayer_items
from specjax.selection.layer_probe import (
  Window,
  full_residuals,
  run_sublayers,
)

PROMPT = [5, 9, 2, 7, 7, 1, 30, 12, 8, 3, 44, 6, 19, 2, 25, 11, 4, 40, 13, 21]


@functools.cache
def setup(arch: str = "llama", layers: int = 3, W: int = 3):
  """A tiny model, its cache after prefilling PROMPT, and a window over its last W tokens."""
  config = tiny_config(arch, num_layers=layers, vocab_size=64)
  graphdef, state = nnx.split(init_model(config, seed=7))
  cache = KVCache.create(config, 1, 64)
  tokens = jnp.asarray([PROMPT + [0] * (64 - len(PROMPT))], jnp.int32)
  _, cache = prefill_step(state, cache, tokens, jnp.int32(len(PROMPT)),
                          DraftPlan.full(layers), jax.random.key(0), graphdef=graphdef,
                          sampling=SamplingParams())
  start = len(PROMPT) - W - 1
  span = jnp.asarray(PROMPT[start : start + W], jnp.int32)
  res, _ = full_residuals(state, cache, span, jnp.int32(start), graphdef=graphdef)
  window = Window(tokens=span, positions=jnp.arange(start, start + W, dtype=jnp.int32),
                  next_tokens=jnp.asarray(PROMPT[start + 1 : start + W + 1], jnp.int32),
                  residuals=res, valid=jnp.ones((W,), bool))
  return config, graphdef, state, cache, window


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _one_token(state, cache, token, pos, plan, *, graphdef):
  """Residuals of one token at `pos` under `plan`, reading cache slots < pos: the model's
  own read-only forward (an implementation apart from the probes)."""
  view = cache.with_length(pos)
  out, _ = apply(state, view, token[None, None], pos[None, None], plan, graphdef=graphdef,
                 logits="last", return_residuals=True, write_cache=False)
  return out.residuals[:, 0, 0], out.logits[0, 0]


@functools.cache
def trajectories(arch="llama", layers=3, W=3):
  """{bits: ([2L, W, D] residuals, [W, V] logits)} for every subset of sub-layers."""
  config, graphdef, state, cache, window = setup(arch, layers, W)
  out = {}
  for bits in itertools.product([False, True], repeat=2 * layers):
    plan = DraftPlan.from_bits(np.asarray(bits))
    rows = [_one_token(state, cache, window.tokens[w], window.positions[w], plan,
                       graphdef=graphdef) for w in range(W)]
    out[bits] = (np.stack([np.asarray(r[0]) for r in rows], 1),
                 np.stack([np.asarray(r[1]) for r in rows]))
  return out


def _cos(x, t):
  return float(np.mean(np.sum(x * t, -1) / (np.linalg.norm(x, axis=-1) *
                                           np.linalg.norm(t, axis=-1))))


def brute_force(traj, target, items, run_cost, skip_cost, slots, tau):
  """The recursion walked over explicit prefixes: table[s] = the kept prefix of cost s."""
  n_sub = sum(len(i) for i in items)
  table = {0: ()}
  for j, sub in enumerate(items):
    new = {}
    for s in range(slots):
      opts = {}
      if s - run_cost[j] in table:
        opts[True] = table[s - run_cost[j]] + (True,)
      if s - skip_cost[j] in table:
        opts[False] = table[s - skip_cost[j]] + (False,)
      if not opts:
        continue

      def score(prefix):
        bits = sum(((b,) * len(items[k]) for k, b in enumerate(prefix)), ())
        full = bits + (True,) * (n_sub - len(bits))
        return _cos(traj[full][0][sub[-1]], target[sub[-1]])

      scores = {ran: score(p) for ran, p in opts.items()}
      ran = True in scores and (False not in scores or scores[True] > scores[False])
      if scores[ran] >= tau:
        new[s] = opts[ran]
    table = new
  return {s: np.repeat(np.asarray(p), [len(i) for i in items]) for s, p in table.items()}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_probes_equal_the_read_only_forward(arch):
  """Running every sub-layer of a random subset through the probes gives the residuals
  of the model's own forward under that plan, token by token."""
  config, graphdef, state, cache, window = setup(arch)
  traj = trajectories(arch)
  model = nnx.merge(graphdef, state)
  rng = np.random.default_rng(0)
  for _ in range(4):
    bits = tuple(bool(b) for b in rng.integers(0, 2, 2 * config.num_layers))
    x = model.embed(window.tokens[None])
    for i in np.flatnonzero(bits):
      x = run_sublayers(model, (int(i),), x, window.positions, cache)
    np.testing.assert_allclose(np.asarray(x[0]), traj[bits][0][-1], atol=2e-5)


@pytest.mark.parametrize("arch,tau", [("llama", -1.0), ("llama", 0.5), ("llama", 0.95),
                                      ("gemma3", 0.5)])
def test_knapsack_dp_equals_brute_force(arch, tau):
  """Every budget's candidate (and which budgets survive pruning) equals the brute-force
  walk of the recursion over all 2^(2L) subsets. The tiny gemma3 alternates local and
  global layers, so its DP scans three runs of one layer where llama's scans one of three."""
  config, graphdef, state, cache, window = setup(arch)
  traj = trajectories(arch)
  target = np.asarray(window.residuals)
  items = sublayer_items(config.num_layers, coupled=False)
  run_cost = np.asarray([1, 3, 2, 1, 1, 2], np.int32)
  skip_cost = np.zeros(6, np.int32)
  slots = int(run_cost.sum()) + 1
  cands = run_dp(state, cache, window, run_cost, skip_cost, tau, graphdef=graphdef,
                 coupled=False, slots=slots, agreement=True)
  want = brute_force(traj, target, items, run_cost, skip_cost, slots, tau)
  assert set(np.flatnonzero(np.asarray(cands.alive))) == set(want)
  for s, bits in want.items():
    np.testing.assert_array_equal(np.asarray(cands.bits[s]), bits)
    full = tuple(bool(b) for b in bits)
    np.testing.assert_allclose(float(cands.cosine[s]), _cos(traj[full][0][-1], target[-1]),
                               atol=1e-5)
    agree = np.mean(np.argmax(traj[full][1], -1) == np.asarray(window.next_tokens))
    assert float(cands.agreement[s]) == pytest.approx(agree)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_clasp_dp_equals_brute_force_and_skips_exactly_m(arch):
  config, graphdef, state, cache, window = setup(arch)
  traj = trajectories(arch)
  L = config.num_layers
  items = sublayer_items(L, coupled=True)
  run_cost, skip_cost = np.zeros(L, np.int32), np.ones(L, np.int32)
  cands = run_dp(state, cache, window, run_cost, skip_cost, -1.0, graphdef=graphdef,
                 coupled=True, slots=L + 1, agreement=False)
  want = brute_force(traj, np.asarray(window.residuals), items, run_cost, skip_cost, L + 1,
                     -1.0)
  for m in range(L + 1):
    bits = np.asarray(cands.bits[m])
    np.testing.assert_array_equal(bits, want[m])
    assert np.sum(~bits[0::2]) == m and np.array_equal(bits[0::2], bits[1::2])


def test_batched_budgets_equal_each_budget_alone():
  """The table over all budgets at once gives, at each budget b, what a DP whose table
  stops at b gives."""
  config, graphdef, state, cache, window = setup()
  cost = np.asarray([2, 1, 3, 1, 2, 2], np.int32)
  zero = np.zeros_like(cost)
  all_at_once = run_dp(state, cache, window, cost, zero, 0.3, graphdef=graphdef, coupled=False,
                       slots=int(cost.sum()) + 1, agreement=True)
  for b in range(int(cost.sum()) + 1):
    alone = run_dp(state, cache, window, cost, zero, 0.3, graphdef=graphdef, coupled=False,
                   slots=b + 1, agreement=True)
    assert bool(alone.alive[b]) == bool(all_at_once.alive[b])
    if alone.alive[b]:
      np.testing.assert_array_equal(np.asarray(alone.bits[b]), np.asarray(all_at_once.bits[b]))
      np.testing.assert_allclose(float(alone.cosine[b]), float(all_at_once.cosine[b]),
                                 atol=1e-6)


def test_new_states_weights_and_windows_do_not_recompile():
  config, graphdef, state, cache, window = setup()
  clocks = [CompileClock() for _ in range(4)]
  rng = np.random.default_rng(1)
  for k, clock in enumerate(clocks):
    cost = rng.integers(1, 4, 6).astype(np.int32)
    win = window.replace(residuals=window.residuals * (1 + k),
                         positions=window.positions - k)
    run_dp(state, cache.with_length(len(PROMPT) - k), win, cost, np.zeros_like(cost), 0.5,
           graphdef=graphdef, coupled=False, slots=16, agreement=True, clock=clock)
  assert [c.count for c in clocks[1:]] == [0, 0, 0]


def test_plan_bits_round_trip():
  plan = DraftPlan.from_skips(4, [1, 3], [0])
  assert DraftPlan.from_bits(plan.to_bits()).to_json() == plan.to_json()


def test_compiled_dp_does_not_grow_with_depth():
  """The items are a scan over layers: the DP's loop body is the same program for a
  2-layer and a 5-layer model (unrolled items made its compile grow with depth)."""
  def scan_bodies(layers):
    config, graphdef, state, cache, window = setup("llama", layers)
    cost = jnp.ones(2 * layers, jnp.int32)
    jaxpr = jax.make_jaxpr(functools.partial(
        layer_dp, graphdef=graphdef, coupled=False, slots=4, agreement=True))(
            state, cache, window, cost, cost * 0, jnp.float32(0.5))
    (call,) = jaxpr.eqns  # the jitted DP
    body = call.params["jaxpr"].jaxpr
    return [len(e.params["jaxpr"].eqns) for e in body.eqns if e.primitive.name == "scan"]

  assert scan_bodies(2) == scan_bodies(5)
  assert len(scan_bodies(2)) == 2  # the items' scan and the back-tracking one


def test_bench_layer_dp_script_times_both_drafters_shapes():
  """experiments/bench_layer_dp.py end to end on a tiny registered model: both DP shapes
  compiled and timed, KnapSpec's table to K/2 and to K, each also in AR steps; the last
  line JSON."""
  import json
  import subprocess
  import sys
  from pathlib import Path

  out = subprocess.run([sys.executable, "-m", "experiments.bench_layer_dp", "--model",
                        "tiny-llama", "--repeats", "1", "--context", "48"],
                       cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  figures = json.loads(out.stdout.strip().splitlines()[-1])
  assert figures["model"] == "tiny-llama"
  L = figures["layers"]
  assert (figures["clasp"]["items"], figures["knapspec"]["items"]) == (L, 2 * L)
  shapes = ("clasp", "knapspec", "knapspec, every budget")
  assert all(figures[d]["compile_s"] > 0 and figures[d]["select_ms"] > 0 for d in shapes)
  assert all(figures[d]["ar_steps"] == pytest.approx(figures[d]["select_ms"]
                                                     / figures["ar_step_ms"]) for d in shapes)
  half, every = figures["knapspec"]["slots"], figures["knapspec, every budget"]["slots"]
  assert figures["knapspec"]["window"] == 5 and half <= every
  assert figures["context"] == 48
