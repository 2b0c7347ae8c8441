"""8-bit drafts: the int8 CPU kernel against XLA's expression, per-channel quantisation
bounds, the `8bit` overlay lossless alone and over layer drafters (greedy == AR, host and
device loops, sampling keeps the target distribution), QuantSpec at 8 bits, and clear
errors for weights of another model or in the wrong place."""

from __future__ import annotations

import dataclasses
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from targets import (
  PROMPT,
  assert_exercised,
  assert_quantised_draft_keeps_the_target_distribution,
  assert_weights_overlay_is_lossless,
  model_of,
)

from specjax import cpu_kernels, quant
from specjax.config import tiny_config
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate, positions_for
from specjax.drafters import (
  FRSpecDrafter,
  Int8WeightsDrafter,
  QuantSpecDrafter,
  SelfSDDrafter,
  StaticDrafter,
)
from specjax.kv_cache import KVCache
from specjax.model import apply, init_model
from specjax.plan import DraftPlan, PlanError
from specjax.quant import Int8Matrix
from specjax.quant_kv_cache import QuantKV

# Drafts weak enough that every tiny target rejects some of their tokens on jax 0.10 and
# 0.12 alike (the trained weights differ between them): skipping attention [1, 2] and MLP
# [2] only, or exiting after three layers, drafted qwen2's or gemma3's every token on one.
SKIP = DraftPlan.from_skips(4, [1, 2], [1, 2])


# --- the kernel and the quantisation ---------------------------------------------------------


def test_the_kernel_builds_wherever_a_compiler_is_found():
  """CI and this machine have g++: the fast path must really be the one taken there."""
  if shutil.which("g++") is None:
    assert cpu_kernels.kernel_status().startswith("no C++ compiler")
  else:
    assert cpu_kernels.kernel_status() == "ready"


def test_without_the_kernel_the_xla_path_gives_the_same_numbers(monkeypatch):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, 3, 40)), jnp.float32)
  m = Int8Matrix.quantize(jnp.asarray(rng.normal(size=(40, 70)), jnp.float32))
  fast = np.asarray(m.matmul(x))
  monkeypatch.setattr(cpu_kernels.build, "kernel_status", lambda *a: "disabled by SPECJAX_CPU_KERNELS=0")
  slow = np.asarray(m.matmul(x))
  np.testing.assert_allclose(slow, fast, rtol=1e-5, atol=1e-5)


def test_a_failing_compiler_is_a_clear_build_error(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  with pytest.raises(cpu_kernels.KernelBuildError, match="false"):
    cpu_kernels.build.build(cpu_kernels.build.SOURCE, "false")
  assert not any(p.suffix == ".so" for p in tmp_path.rglob("*"))  # nothing half-written kept


def test_processes_building_one_kernel_together_compile_it_once(tmp_path, monkeypatch):
  """Test workers start together and ask for the same kernels: the first builds each one,
  the others wait for it and load its library."""
  from concurrent.futures import ThreadPoolExecutor

  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  runs = tmp_path / "runs"
  compiler = tmp_path / "cxx"  # notes its call, then writes the library it is asked for
  compiler.write_text(f'#!/bin/sh\necho x >> {runs}\nsleep 1\n'
                      'while [ "$1" != -o ]; do shift; done\necho lib > "$2"\n')
  compiler.chmod(0o755)
  with ThreadPoolExecutor(3) as pool:
    built = list(pool.map(lambda _: cpu_kernels.build.build(cpu_kernels.build.SOURCE, str(compiler)),
                          range(3)))
  assert len(set(built)) == 1 and built[0].read_text() == "lib\n"
  assert runs.read_text().count("x") == 1


def test_loading_the_kernel_keeps_subnormal_floats():
  """Built with -ffast-math, the shared object switched the process to flush-to-zero."""
  cpu_kernels.kernel_status()
  tiny = np.float32(1e-40)  # subnormal
  assert tiny * np.float32(1.0) > 0 and tiny / np.float32(2.0) > 0


@settings(max_examples=25, deadline=None)
@given(rows=st.sampled_from([(1,), (5,), (2, 3)]), inner=st.integers(1, 70),
       outer=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_kernel_equals_the_xla_expression(rows, inner, outer, seed):
  """Any leading shape, inner sizes off the 16-lane width, channel counts off the 64-channel
  chunk: the kernel's tails and chunking match the dequantised matmul."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=rows + (inner,)), jnp.float32)
  m = Int8Matrix.quantize(jnp.asarray(rng.normal(size=(inner, outer)), jnp.float32))
  want = np.asarray(x) @ np.asarray(m.dequantize())
  got = jax.jit(m.matmul)(x)
  assert got.shape == rows + (outer,)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.sqrt(inner))


def test_per_channel_error_bound_and_exact_zero_channels():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(48, 10)) * np.logspace(-3, 3, 10)  # channels of very different scale
  w[:, 4] = 0.0
  m = Int8Matrix.quantize(jnp.asarray(w, jnp.float32))
  err = np.abs(np.asarray(m.dequantize()) - w)
  bound = np.abs(w).max(axis=0) / 254 * (1 + 1e-5)  # scale / 2, scale = max|w| / 127
  assert np.all(err <= bound[None, :] + 1e-12)
  assert np.all(np.asarray(m.dequantize())[:, 4] == 0.0)
  tied = Int8Matrix.quantize(jnp.asarray(w.T, jnp.float32), output_major=True)
  assert tied.shape == m.shape == (48, 10)
  np.testing.assert_array_equal(np.asarray(tied.codes), np.asarray(m.codes))


def test_draft_weights_cover_every_matmul_and_the_head():
  model = model_of("gemma3")  # tied embedding: the head is the embedding's transpose
  w = quant.quantize_weights_int8(model.state, model.config.num_layers)
  assert w.bits == 8 and len(w.layers) == model.config.num_layers
  assert all(m is not None for lw in w.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down))
  assert w.head.shape == (model.config.embed_dim, model.config.vocab_size)
  fp32 = sum(x.size * 4 for x in jax.tree.leaves(model.state))
  assert w.nbytes < 0.3 * fp32  # a byte per weight plus a scale per channel


# --- lossless --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("base", ["none", "static", "early_exit"])
def test_8bit_drafts_are_lossless_on_both_loops(arch, base):
  assert_weights_overlay_is_lossless(Int8WeightsDrafter, arch, base)


def test_quantspec_with_8bit_weights_is_lossless_on_its_cache():
  model = model_of("qwen2")
  kv = QuantKV(group=8, residual=16)
  ar = generate(model.graphdef, model.state, model.config, PROMPT, max_new_tokens=48,
                eos_ids=(), kv_cache=kv)
  drafter = QuantSpecDrafter.for_model(model, base=StaticDrafter(SKIP), weight_bits=8,
                                       kv_cache=kv)
  out = speculative_generate(model.graphdef, model.state, model.config, PROMPT, drafter,
                             max_new_tokens=48, gamma=4, eos_ids=(), record_rounds=True)
  assert out.tokens == ar.tokens
  assert out.plans[0].weight_bits == 8 and out.plans[0].kv_bits == 4
  assert_exercised(out)


@pytest.mark.parametrize("outer", ["8bit", "frspec"])
def test_overlays_over_quantspec_keep_its_cache_and_stay_lossless(outer):
  """An overlay passes its base's KV cache through: FR-Spec over QuantSpec used to build
  a full-precision cache and fail at trace time on the 4-bit read."""
  model = model_of("qwen2")
  kv = QuantKV(group=8, residual=16)
  quantspec = QuantSpecDrafter.for_model(model, base=StaticDrafter(SKIP), weight_bits=4,
                                         weight_group=32, kv_cache=kv)
  drafter = (Int8WeightsDrafter.for_model(model, base=quantspec) if outer == "8bit" else
             FRSpecDrafter(np.arange(0, 97, 2), quantspec))
  assert drafter.kv_cache == kv
  ar = generate(model.graphdef, model.state, model.config, PROMPT, max_new_tokens=48,
                eos_ids=(), kv_cache=kv)
  out = speculative_generate(model.graphdef, model.state, model.config, PROMPT, drafter,
                             max_new_tokens=48, gamma=4, eos_ids=(), record_rounds=True)
  assert out.tokens == ar.tokens
  plan = out.plans[0]
  assert plan.kv_bits == 4 and plan.weight_bits == (8 if outer == "8bit" else 4)
  assert outer == "8bit" or plan.vocab is not None


def test_8bit_sampling_round_keeps_the_target_distribution():
  assert_quantised_draft_keeps_the_target_distribution(quant.quantize_weights_int8)


# --- bad input -------------------------------------------------------------------------------


def untrained(arch: str, **overrides):
  config = dataclasses.replace(tiny_config(arch), **overrides)
  graphdef, state = nnx.split(init_model(config))
  return types.SimpleNamespace(graphdef=graphdef, state=state, config=config)


def test_weights_of_another_model_are_refused():
  small = model_of("llama")
  other = untrained("llama", num_layers=4, vocab_size=61)  # same depth, another vocabulary
  drafter = Int8WeightsDrafter.for_model(other)
  with pytest.raises(PlanError, match="quantised from another model"):
    speculative_generate(small.graphdef, small.state, small.config, PROMPT, drafter,
                         max_new_tokens=8, eos_ids=())
  deeper = Int8WeightsDrafter.for_model(untrained("qwen2", num_layers=6))
  with pytest.raises(PlanError, match="cover 6 layers, the model has 4"):
    speculative_generate(small.graphdef, small.state, small.config, PROMPT, deeper,
                         max_new_tokens=8, eos_ids=())


def test_weights_only_in_a_draft_and_only_8_bit_ones_in_the_overlay():
  model = model_of("llama")
  w8 = quant.quantize_weights_int8(model.state, model.config.num_layers)
  cache = KVCache.create(model.config, 1, 64)
  tokens = jnp.asarray([[3, 4, 5]], jnp.int32)
  with pytest.raises(PlanError, match="a forward that writes the cache is the target's"):
    apply(model.state, cache, tokens, positions_for(cache, 3, 1),
          DraftPlan.full(4).replace(weights=w8), graphdef=model.graphdef)
  with pytest.raises(TypeError, match="'weights'"):  # a required constructor argument
    Int8WeightsDrafter()
  with pytest.raises(PlanError, match="Int8WeightsDrafter.for_model"):
    Int8WeightsDrafter(None)
  w4 = quant.quantize_mlp_weights(model.state, model.config.num_layers, 32)
  with pytest.raises(PlanError, match="needs 8-bit weights"):
    Int8WeightsDrafter(weights=w4)
  with pytest.raises(PlanError, match="4, 8 or 16 bits, got 5"):
    QuantSpecDrafter.for_model(model, weight_bits=5)


def test_draft_cost_counts_the_bytes_an_8bit_draft_reads():
  """`cost.draft_cost` prices a plan by the bytes of weights it reads: an 8-bit draft reads
  about a quarter of an fp32 target's (half of a bf16 one's), and skipping sub-layers
  saves the same share at either precision."""
  from specjax.selection.cost import draft_cost

  model = model_of("qwen2")
  cfg, L = model.config, model.config.num_layers
  w8 = quant.quantize_weights_int8(model.state, L)
  full = DraftPlan.from_skips(L)
  assert draft_cost(cfg, full) == pytest.approx(1.0)
  c8 = draft_cost(cfg, full.replace(weights=w8))
  assert 0.25 <= c8 < 0.35  # int8 codes plus one fp32 scale per output channel
  assert draft_cost(cfg, full.replace(weights=w8), target_bits=16) == pytest.approx(2 * c8)
  skip = DraftPlan.from_skips(L, [1, 2], [2, 3])
  saved = 1 - draft_cost(cfg, skip)
  saved8 = c8 - draft_cost(cfg, skip.replace(weights=w8))
  assert saved8 == pytest.approx(saved * c8, rel=0.15)


def test_self_sd_search_for_an_8bit_draft_scores_and_costs_it_at_8_bits():
  from specjax.offline import self_sd_search

  model = model_of("qwen2")
  w8 = quant.quantize_weights_int8(model.state, model.config.num_layers)
  args = (model.graphdef, model.state, model.config, [PROMPT])
  kw = dict(iterations=4, init_points=4, new_tokens=8, verbose=False, drafter_of=SelfSDDrafter)
  plain = self_sd_search.search(*args, **kw)
  int8 = self_sd_search.search(*args, weights=w8, **kw)
  for a, b in zip(plain.history, int8.history):  # the same candidates (one seed)
    assert a["skipped"] == b["skipped"] and b["cost"] < 0.35 * a["cost"] + 0.01
  assert int8.plan.weights is None  # the skip set alone: the overlay adds the weights


@pytest.mark.parametrize("matrix", ["int8", "int4"])
def test_vmapped_quantised_matmuls_fold_a_few_rows_into_one_kernel_call(matrix):
  """The int8 and int4 kernels under vmap: a batch of at most FEW_ROWS rows joins one
  call's rows (the weights read once, where jax's `sequential` looped a call per element);
  a larger one, or batched weights, takes XLA's expression. Equal to the dequantised
  matrix's product either way."""
  if not cpu_kernels.runs_here(f"{matrix}_matmul"):
    pytest.skip(f"the {matrix}_matmul kernel is not built here")
  rng = np.random.default_rng(7)
  w = jnp.asarray(rng.normal(size=(200, 48)), jnp.float32)
  m = quant.Int8Matrix.quantize(w) if matrix == "int8" else quant.Int4Matrix.quantize(w, 64)
  dense = np.asarray(m.dequantize())

  def grid(x):  # the 4-bit product reads x on its activation grid, padded to 256 inputs
    if matrix == "int8":
      return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 56)])
    return np.asarray(quant.activation_grid(jnp.asarray(padded), 64))[..., :200]

  target = f"specjax_{matrix}_matmul"
  for n, folded in ((cpu_kernels.FEW_ROWS // 2, True), (cpu_kernels.FEW_ROWS + 1, False)):
    x = rng.normal(size=(n, 1, 200)).astype(np.float32)
    f = jax.jit(jax.vmap(m.matmul))
    np.testing.assert_allclose(np.asarray(f(x)), grid(x) @ dense, rtol=1e-4, atol=1e-3)
    hlo = f.lower(x).compile().as_text()
    assert (hlo.count(target) == 1 and "while" not in hlo) if folded else target not in hlo
  twice = lambda leaf: 2 * leaf if leaf.dtype == jnp.float32 else leaf  # lo and scale
  both = jax.tree.map(lambda leaf: jnp.stack([leaf, twice(leaf)]), m)
  got = jax.jit(jax.vmap(lambda m, x: m.matmul(x)))(both, x[:2])
  np.testing.assert_allclose(np.asarray(got), grid(x[:2]) @ np.stack([dense, 2 * dense]),
                             rtol=1e-4, atol=2e-3)
