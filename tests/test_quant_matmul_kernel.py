"""The Pallas weight-only quantised matmuls (`pallas_kernels/quant_matmul.py`): equal to
their jnp references over drawn shapes (interpret mode), lowered to Triton for a GPU,
taken by `ops` only where a quantised matrix asks for them and their blocks tile it, and
lossless inside the 8-bit and QuantSpec drafts."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from targets import PROMPT, ar_tokens, assert_exercised, target

from pallas_kernels import quant_matmul
from pallas_kernels.quant_matmul import int4_matmul, int4_reference, int8_matmul, int8_reference
from specjax import quant
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.drafters import Int8WeightsDrafter, QuantSpecDrafter, StaticDrafter
from specjax.errors import ConfigError
from specjax.plan import DraftPlan
from specjax.quant_kv_cache import QuantKV

# Few rows (a draft step's 1, verification's up to 16), blocks of 16 and more.
ROWS = st.integers(1, 16)
DIMS = st.sampled_from([16, 48, 64, 96, 128, 192, 320, 576, 1024])


def _data(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


@settings(max_examples=14, deadline=None)
@given(rows=ROWS, inputs=DIMS, outputs=DIMS, bf16=st.booleans(), seed=st.integers(0, 99))
def test_int8_kernel_equals_its_reference(rows, inputs, outputs, bf16, seed):
  m = quant.Int8Matrix.quantize(_data(seed, (inputs, outputs)))
  x = _data(seed + 1, (rows, inputs), jnp.bfloat16 if bf16 else jnp.float32)
  assert quant_matmul.takes(rows, inputs, outputs)
  got = int8_matmul(x, m.codes, m.scale, interpret=True)
  want = int8_reference(x, m.codes, m.scale)
  assert got.shape == (rows, outputs) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@settings(max_examples=14, deadline=None)
@given(rows=ROWS, groups=st.integers(1, 5), group=st.sampled_from([32, 64, 128]),
       outputs=DIMS, seed=st.integers(0, 99))
def test_int4_kernel_equals_its_reference(rows, groups, group, outputs, seed):
  """x on the format's activation grid, as `Int4Matrix.matmul` hands it over."""
  inputs = groups * group
  m = quant.Int4Matrix.quantize(_data(seed, (inputs, outputs)), group)
  x = quant.activation_grid(_data(seed + 1, (rows, inputs)), group)
  assert quant_matmul.takes(rows, inputs, outputs, group)
  got = int4_matmul(x, m.codes, m.lo, m.scale, interpret=True)
  want = int4_reference(x, m.codes, m.lo, m.scale)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  # and the reference is the format's own product
  np.testing.assert_allclose(want, m.matmul(x), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_leading_axes_are_kept():
  m = quant.Int8Matrix.quantize(_data(0, (64, 32)))
  x = _data(1, (1, 5, 64))
  got = int8_matmul(x, m.codes, m.scale, interpret=True)
  assert got.shape == (1, 5, 32)
  np.testing.assert_allclose(got, int8_reference(x, m.codes, m.scale), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("inputs, outputs", [(4096, 6144), (14336, 4096), (1536, 17920),
                                             (8960, 1536)])
def test_kernels_lower_to_triton_for_cuda(inputs, outputs):
  """The Triton lowering is Python: lowering for CUDA on a CPU host builds the kernels'
  Triton IR at the Llama-3-8B (qkv, down) and Qwen2.5-1.5B (gate_up, down) shapes, in
  bf16, and fails on what Triton cannot express."""
  x = jnp.zeros((5, inputs), jnp.bfloat16)
  codes8 = jax.ShapeDtypeStruct((outputs, inputs), jnp.int8)
  scale8 = jax.ShapeDtypeStruct((outputs,), jnp.float32)
  codes4 = jax.ShapeDtypeStruct((outputs, inputs // 2), jnp.uint8)
  per_group = jax.ShapeDtypeStruct((outputs, inputs // 128), jnp.float32)
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=h100)):
    text8 = jax.jit(int8_matmul).trace(x, codes8, scale8).lower(
        lowering_platforms=("cuda",)).as_text()
    text4 = jax.jit(int4_matmul).trace(x, codes4, per_group, per_group).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text8 and "weight_only_int8_matmul" in text8
  assert "xla.gpu.triton" in text4 and "weight_only_int4_matmul" in text4


def test_ops_take_the_kernel_only_where_asked_and_where_it_tiles():
  w = _data(0, (64, 96))
  x = _data(1, (3, 64))
  calls = lambda m, x: str(jax.make_jaxpr(m.matmul)(x)).count("pallas_call")
  plain, pallas = quant.Int8Matrix.quantize(w), quant.Int8Matrix.quantize(w).replace(
      kernel="pallas")
  assert calls(plain, x) == 0 and calls(pallas, x) == 1
  assert calls(pallas, _data(2, (17, 64))) == 0  # more rows than a step: XLA's dot
  untiled = quant.Int8Matrix.quantize(_data(0, (64, 97))).replace(kernel="pallas")
  assert calls(untiled, x) == 0  # 97 outputs: no block of 16 divides them
  np.testing.assert_allclose(pallas.matmul(x), plain.matmul(x), rtol=1e-5, atol=1e-5)
  m4 = quant.Int4Matrix.quantize(w, 32)
  assert calls(m4.replace(kernel="pallas"), x) == 1 and calls(m4.replace(kernel="xla"), x) == 0
  np.testing.assert_allclose(m4.replace(kernel="pallas").matmul(x), m4.matmul(x), rtol=1e-5,
                             atol=1e-5)


def test_with_kernel_sets_every_matrix_and_refuses_what_has_no_such_kernel():
  config, graphdef, state = target("llama")
  w = quant.with_kernel(quant.quantize_weights_int8(state, config.num_layers), "pallas")
  kernels = {m.kernel for m in jax.tree.leaves(
      w, is_leaf=lambda m: isinstance(m, quant.Int8Matrix)) if isinstance(m, quant.Int8Matrix)}
  assert kernels == {"pallas"}
  with pytest.raises(ConfigError, match="one of None, pallas, xla, got 'triton'"):
    quant.with_kernel(w, "triton")


@pytest.fixture
def kernel_calls(monkeypatch):
  """The number of times each Pallas matmul was traced (the drafts' programs are new:
  a matrix's kernel is part of its type)."""
  count = {"int8": 0, "int4": 0}
  for name in count:
    real = getattr(quant_matmul, f"{name}_matmul")

    def counted(*a, _real=real, _name=name, **kw):
      count[_name] += 1
      return _real(*a, **kw)

    monkeypatch.setattr(quant_matmul, f"{name}_matmul", counted)
  return count


def test_the_8bit_draft_is_lossless_with_the_kernel(kernel_calls):
  config, graphdef, state = target("qwen3")
  model = types.SimpleNamespace(graphdef=graphdef, state=state, config=config)
  skip = StaticDrafter(DraftPlan.from_skips(config.num_layers, [1, 2], [1, 2]))
  d = Int8WeightsDrafter.for_model(model, base=skip, kernel="pallas")
  out = speculative_generate(graphdef, state, config, PROMPT, d, max_new_tokens=40, gamma=4,
                             threshold=0.0, eos_ids=())
  assert out.tokens == ar_tokens("qwen3")[:40]
  assert_exercised(out)
  assert kernel_calls["int8"] > 0


@pytest.mark.parametrize("bits", [4, 8])
def test_quantspec_is_lossless_with_the_kernels(kernel_calls, bits):
  """The paper's 4-bit MLP draft (and our 8-bit variant) over a cache whose codes the
  Pallas attention reads: greedy SSD equals greedy AR on the same cache."""
  config, graphdef, state = target("llama")
  model = types.SimpleNamespace(graphdef=graphdef, state=state, config=config)
  kv = QuantKV(group=8, residual=16)
  d = QuantSpecDrafter.for_model(model, weight_bits=bits, weight_group=32, kv_cache=kv,
                                 kernel="pallas",
                                 base=StaticDrafter(DraftPlan.from_skips(4, [1], [1])))
  assert d.kv_cache.kernel  # the attention over the codes is the Pallas kernel too
  ar = generate(graphdef, state, config, PROMPT, max_new_tokens=40, eos_ids=(), kv_cache=kv)
  out = speculative_generate(graphdef, state, config, PROMPT, d, max_new_tokens=40, gamma=4,
                             eos_ids=())
  assert out.tokens == ar.tokens
  assert_exercised(out)
  assert kernel_calls[{4: "int4", 8: "int8"}[bits]] > 0
