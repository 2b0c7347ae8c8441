"""The few-row float32 CPU kernel (`cpu_kernels.f32_matmul`): equal to numpy for any shape
and either weight layout, taken only where it is meant to be (1–16 float32 rows on a CPU),
differentiable, and a verification forward through it equal to XLA's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax import cpu_kernels, ops
from specjax.config import tiny_config
from specjax.kv_cache import KVCache
from specjax.model import apply, init_model
from specjax.plan import DraftPlan

pytestmark = pytest.mark.skipif(cpu_kernels.kernel_status("f32_matmul") != "ready",
                                reason="no C++ compiler: the XLA path is the only one")


@settings(max_examples=60, deadline=None)
@given(rows=st.sampled_from([(1,), (2,), (3,), (5,), (7,), (8,), (1, 9), (3, 3), (10,),
                             (16,)]),
       inner=st.integers(1, 90), outer=st.integers(1, 600), transposed=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kernel_equals_numpy(rows, inner, outer, transposed, seed):
  """Inner sizes off the vector width, outputs off the register tiles and the chunks,
  every tile shape the registers allow (its width and weight rows shrink as rows grow:
  1, 2, 3, 5, 7, 8 and 9 rows, a γ = 8 verification), more rows than one pass takes
  (10, 16 > 9): every tail matches."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=rows + (inner,)).astype(np.float32)
  w = rng.normal(size=(outer, inner) if transposed else (inner, outer)).astype(np.float32)
  want = x @ (w.T if transposed else w)
  got = jax.jit(cpu_kernels.f32_matmul, static_argnums=2)(x, w, transposed)
  assert got.shape == rows + (outer,)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.sqrt(inner))


@pytest.mark.parametrize("rows", [2, 5, 11])
def test_wide_matrices_split_by_columns(rows):
  """[I, O] matrices wider than 32768 columns (an untied LM head) are cut by columns, not
  by rows: the tiles, the tail columns and the tail rows match numpy there too."""
  rng = np.random.default_rng(rows)
  x = rng.normal(size=(rows, 13)).astype(np.float32)
  w = rng.normal(size=(13, 32768 + 40)).astype(np.float32)
  got = jax.jit(cpu_kernels.f32_matmul)(x, w)
  np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_tied_heads_split_by_channels_match_numpy(rows):
  """A tied LM head ([O, I], 9.4 MB: both threads) in chunks of channels that do not divide
  O, read as two streams of channels at one row and several side by side at more."""
  rng = np.random.default_rng(rows)
  x = rng.normal(size=(rows, 576)).astype(np.float32)
  w = rng.normal(size=(4096 + 3, 576)).astype(np.float32)
  got = jax.jit(cpu_kernels.f32_matmul, static_argnums=2)(x, w, True)
  np.testing.assert_allclose(np.asarray(got), x @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("outer", [1024, 2048 + 1024, 1024 + 512])
def test_rows_4_kib_apart_match_numpy(rows, outer):
  """Rows a multiple of 4 KiB apart (SmolLM2's gate_up: 3072 columns), and at one row a
  multiple of 2 KiB (1536 columns), take the tile without its prefetch: equal to numpy
  there, tail rows included (I = 45)."""
  rng = np.random.default_rng(outer + rows)
  x = rng.normal(size=(rows, 45)).astype(np.float32)
  w = rng.normal(size=(45, outer)).astype(np.float32)
  got = jax.jit(cpu_kernels.f32_matmul)(x, w)
  np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("inner", [576, 896, 100, 40])
def test_a_row_has_the_same_bits_whatever_rows_share_its_call(inner, transposed):
  """Row t of a call with M rows equals a call with row t alone, bit for bit, for either
  layout (the tied head included): a verification's logits are the AR step's. Inner sizes
  of SmolLM2 and Qwen2.5 and two with tails past the last whole vector."""
  rng = np.random.default_rng(inner)
  x = rng.normal(size=(9, inner)).astype(np.float32)
  w = rng.normal(size=(1000, inner) if transposed else (inner, 1000)).astype(np.float32)
  call = jax.jit(cpu_kernels.f32_matmul, static_argnums=2)
  alone = np.concatenate([np.asarray(call(x[t:t + 1], w, transposed)) for t in range(9)])
  for rows in range(2, 10):
    np.testing.assert_array_equal(np.asarray(call(x[:rows], w, transposed)), alone[:rows])


def test_results_do_not_depend_on_the_threads():
  """Row chunks' partial sums are added in chunk order: bit-identical results on every
  call, whichever thread ran which chunk."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(5, 1536)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(1536, 576)), jnp.float32)
  f = jax.jit(cpu_kernels.f32_matmul)
  first = np.asarray(f(x, w))
  for _ in range(20):
    np.testing.assert_array_equal(np.asarray(f(x, w)), first)


def test_a_direct_call_builds_the_kernel_or_says_why_not(monkeypatch):
  """`f32_matmul` called before anything asked `few_rows` registers its kernel itself, and
  with the kernel disabled raises with the reason, not an unknown FFI target at run time."""
  from specjax.errors import SpecjaxError

  x, w = jnp.ones((2, 8), jnp.float32), jnp.ones((8, 3), jnp.float32)
  cpu_kernels.kernel_status.cache_clear()
  try:
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_kernels.f32_matmul)(x, w)), 8.0)
    monkeypatch.setenv("SPECJAX_CPU_KERNELS", "int8_matmul")
    cpu_kernels.kernel_status.cache_clear()
    with pytest.raises(SpecjaxError, match="disabled by SPECJAX_CPU_KERNELS"):
      cpu_kernels.f32_matmul(x, w)
  finally:
    cpu_kernels.kernel_status.cache_clear()


@pytest.mark.parametrize("transposed", [False, True])
def test_vmap_over_x_is_one_call_with_more_rows(transposed):
  """The layer probes vmap one-token forwards over tokens and candidates: the batch joins
  the rows of a single kernel call (w read once), not one call per element."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(3, 4, 1, 24)).astype(np.float32)  # [C, W, T, I]
  w = rng.normal(size=(40, 24) if transposed else (24, 40)).astype(np.float32)
  f = jax.jit(jax.vmap(jax.vmap(lambda x: cpu_kernels.f32_matmul(x, w, transposed))))
  np.testing.assert_allclose(np.asarray(f(x)), x @ (w.T if transposed else w), rtol=1e-5,
                             atol=1e-4)
  hlo = f.lower(x).compile().as_text()
  assert hlo.count("custom_call_target=\"specjax_f32_matmul") == 1 and "while" not in hlo


def test_a_vmap_past_few_rows_or_over_weights_takes_xlas_dot():
  """Folded rows stop at FEW_ROWS: a vmap over 40 000 sampled rounds made one call of
  40 000 rows, 3x slower than XLA's dot. A vmap over the weights (which the kernel cannot
  fold) takes XLA's dot too, instead of failing."""
  rng = np.random.default_rng(6)
  x = rng.normal(size=(cpu_kernels.FEW_ROWS + 1, 1, 24)).astype(np.float32)
  w = rng.normal(size=(24, 40)).astype(np.float32)
  f = jax.jit(jax.vmap(lambda x: cpu_kernels.f32_matmul(x, w)))
  np.testing.assert_allclose(np.asarray(f(x)), x @ w, rtol=1e-5, atol=1e-4)
  assert "specjax_f32_matmul" not in f.lower(x).compile().as_text()
  ws = np.stack([w, 2 * w])
  g = jax.jit(jax.vmap(cpu_kernels.f32_matmul))
  np.testing.assert_allclose(np.asarray(g(x[:2], ws)), x[:2] @ ws, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape, dtype, taken", [
    ((1, 1, 8), jnp.float32, True),  # an AR or draft step
    ((1, 5, 8), jnp.float32, True),
    ((2, 8, 8), jnp.float32, True),
    ((1, 17, 8), jnp.float32, False),  # a prefill: XLA's GEMM has its reuse
    ((1, 5, 8), jnp.bfloat16, False),
])
def test_few_rows_takes_only_decode_sized_float32_calls(shape, dtype, taken):
  x = jnp.zeros(shape, dtype)
  assert ops.f32_matmul_takes(x, jnp.zeros((8, 4), dtype)) is taken


def test_disabled_kernels_are_never_taken(monkeypatch):
  monkeypatch.setattr(cpu_kernels.build, "kernel_status", lambda *a: "disabled")
  assert not ops.f32_matmul_takes(jnp.zeros((1, 5, 8)), jnp.zeros((8, 4)))


@pytest.mark.parametrize("transposed", [False, True])
def test_gradients_take_xla_dots(transposed):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, 24)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(40, 24) if transposed else (24, 40)), jnp.float32)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  kernel = loss(lambda x, w: cpu_kernels.f32_matmul(x, w, transposed))
  xla = loss(lambda x, w: x @ (w.T if transposed else w))
  for got, want in zip(jax.grad(kernel, (0, 1))(x, w), jax.grad(xla, (0, 1))(x, w)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_verification_forward_equals_xla(arch, monkeypatch):
  """A 5-token forward after a prefill (every kernel call site: q/k/v, o, MLP, the tied or
  untied head) gives XLA's logits to float32 rounding."""
  config = tiny_config(arch)
  graphdef, state = nnx.split(init_model(config, seed=1))
  plan = DraftPlan.full(config.num_layers)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (1, 12)))

  def logits():
    cache = KVCache.create(config, 1, 32)
    _, cache = apply(state, cache, tokens[:, :7], jnp.arange(7)[None], plan,
                     graphdef=graphdef)
    out, _ = apply(state, cache, tokens[:, 7:], jnp.arange(7, 12)[None], plan,
                   graphdef=graphdef)
    return np.asarray(out.logits)

  fast = logits()
  monkeypatch.setattr(ops, "f32_matmul_takes", lambda *a: False)
  np.testing.assert_allclose(fast, logits(), rtol=1e-4, atol=1e-4)


def test_the_environment_can_name_the_kernels_to_use(monkeypatch):
  """`SPECJAX_CPU_KERNELS=int8_matmul` keeps the int8 kernel and sends few-row float32
  dots to XLA: how bench_forward measures the kernel against XLA."""
  monkeypatch.setenv("SPECJAX_CPU_KERNELS", "int8_matmul")
  cpu_kernels.kernel_status.cache_clear()
  try:
    assert cpu_kernels.kernel_status("f32_matmul").startswith("disabled")
    assert cpu_kernels.kernel_status("int8_matmul") == "ready"
  finally:
    cpu_kernels.kernel_status.cache_clear()
