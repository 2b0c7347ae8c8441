"""`cpu_kernels.q4_0_int8_matmul`: a draft's Q4_0 matmul with x quantised to 8 bits.

Its numbers are not the float product's, so the tests pin what they are: x's codes and
scales as ggml's Q8_0 gives them (round to nearest even), each block's product an exact
integer, a row's result independent of the rows beside it, and the distance from the
float product within what quantising x can move it."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu_kernels
from specjax.gguf_matrix import KINDS, GGUFMatrix, GGUFMatrixError

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu"
    or cpu_kernels.kernel_status("q4_0_int8_matmul") != "ready",
    reason="the q4_0_int8_matmul kernel runs on a CPU backend with a C++ compiler")

Q4_0 = KINDS["Q4_0"]
# (rows of x, inputs, outputs): an odd number of blocks (3, 5, 7), 1-3 blocks past the
# vector loop's steps of 4, more rows than one pass takes (4), and a step's few rows
SHAPES = [(1, 96, 40), (6, 160, 33), (3, 224, 64), (5, 576, 70), (2, 1024, 17)]


def q8_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """x[M, I] -> (codes int[M, I/32, 32], d float32[M, I/32]), ggml's Q8_0 in float32."""
  xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
  d = np.abs(xb).max(-1) / np.float32(127)
  inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0))
  return np.clip(np.rint(xb * inv[..., None]), -128, 127).astype(np.int64), d


def reference(x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
  """Σ_b d_w · d_x · Σ (n − 8) · c, the integer sums exact and the rest in float64."""
  codes, dx = q8_codes(x)
  raw = blocks.reshape(blocks.shape[0], -1, 18)
  dw = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)  # [O, blocks]
  qs = raw[..., 2:].astype(np.int64)
  n = np.concatenate([qs & 0xF, qs >> 4], axis=-1) - 8  # weights 0-15, then 16-31
  sums = np.einsum("mbj,obj->mob", codes, n)  # exact integers
  return np.einsum("mob,ob,mb->mo", sums.astype(np.float64), dw, dx.astype(np.float64))


def _case(rows: int, inputs: int, outputs: int, seed: int):
  rng = np.random.default_rng(seed)
  w = rng.normal(size=(outputs, inputs)).astype(np.float32)
  blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType(Q4_0))
  x = (rng.normal(size=(rows, inputs)) * rng.uniform(0.1, 10, size=(rows, 1))).astype(np.float32)
  x[0, :32] = 0.0  # an all-zero block: d_x = 0
  return x, blocks


@pytest.mark.parametrize("shape", SHAPES)
def test_products_are_the_integer_sums_of_8_bit_inputs(shape):
  x, blocks = _case(*shape, seed=shape[1])
  got = np.asarray(cpu_kernels.q4_0_int8_matmul(jnp.asarray(x), jnp.asarray(blocks)))
  want = reference(x, blocks)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_does_not_depend_on_its_neighbours(shape):
  x, blocks = _case(*shape, seed=7)
  many = np.asarray(cpu_kernels.q4_0_int8_matmul(jnp.asarray(x), jnp.asarray(blocks)))
  for r in range(x.shape[0]):
    alone = np.asarray(cpu_kernels.q4_0_int8_matmul(jnp.asarray(x[r:r + 1]),
                                                    jnp.asarray(blocks)))
    np.testing.assert_array_equal(alone[0].view(np.uint32), many[r].view(np.uint32))


def test_distance_from_the_float_product_is_what_quantising_x_allows():
  """|x·w − x̂·w| ≤ Σ_b (d_x / 2) · Σ_{i in b} |w_i|: rounding moves each input by at most
  half a step of its block's grid."""
  x, blocks = _case(4, 576, 96, seed=3)
  got = np.asarray(cpu_kernels.q4_0_int8_matmul(jnp.asarray(x), jnp.asarray(blocks)),
                   np.float64)
  w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(Q4_0)).astype(np.float64)
  exact = x.astype(np.float64) @ w.T
  _, dx = q8_codes(x)
  bound = np.einsum("mb,obj->mo", dx.astype(np.float64) / 2,
                    np.abs(w.reshape(w.shape[0], -1, 32)))
  assert np.all(np.abs(got - exact) <= bound * (1 + 1e-4) + 1e-5)
  assert np.abs(got - exact).max() > 0  # not the float product: the test can fail


def test_past_the_few_rows_xla_takes_the_same_product():
  """A vmap's batch and a prompt's rows past FEW_ROWS: XLA's dot, the same 8-bit product
  (through `GGUFMatrix.matmul` too, which must not fall back to the float product)."""
  x, blocks = _case(1, 160, 24, seed=5)
  xs = jnp.asarray(np.random.default_rng(6).normal(size=(cpu_kernels.FEW_ROWS + 3, 160)),
                   jnp.float32)
  want = reference(np.asarray(xs), blocks)
  close = lambda got: np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5,
                                                 atol=1e-5 * np.abs(want).max())
  close(jax.vmap(lambda row: cpu_kernels.q4_0_int8_matmul(row, jnp.asarray(blocks)))(xs))
  close(cpu_kernels.q4_0_int8_matmul(xs, jnp.asarray(blocks)))
  m = GGUFMatrix.from_rows([(blocks, Q4_0)]).replace(int8_inputs=True)
  close(m.matmul(xs))


def test_only_q4_0_matrices_take_8_bit_inputs_and_keep_them():
  w = np.random.default_rng(0).normal(size=(48, 64)).astype(np.float32)
  with pytest.raises(GGUFMatrixError, match="only Q4_0"):
    GGUFMatrix.quantize(w, KINDS["Q8_0"], int8_inputs=True)
  m = GGUFMatrix.quantize(w, Q4_0, int8_inputs=True)
  rows = m.take_outputs(jnp.asarray([3, 0, 7]))
  assert rows.int8_inputs and rows.shape == (64, 3)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 64)), jnp.float32)
  np.testing.assert_array_equal(np.asarray(rows.matmul(x)),
                                np.asarray(m.matmul(x))[:, [3, 0, 7]])
  np.testing.assert_array_equal(
      np.asarray(m.matmul(x)), np.asarray(cpu_kernels.q4_0_int8_matmul(x, m.parts[0])))
