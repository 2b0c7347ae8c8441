"""The row-parallel matmul kernels (int8, int4, GGUF, Q4_0 with 8-bit x) on matrices large
enough to start helper threads (`workers.h`: 256 KiB of weights or more): every call's
product equals one thread's, output channel for output channel.

One thread's product is the same kernel called on slices of the output channels small
enough that the caller works alone; a channel's sums do not depend on which chunk holds
it, so the two agree bit for bit. Each call gets inputs of its own: a caller that returned
before a helper finished its chunk would leave that chunk's outputs holding whatever the
buffer held before (a previous call's product, or nothing), and no two calls here share a
correct answer. The kernels' other tests stay below the threshold, so only these see the
helpers at work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu_kernels, quant

THREADED = 256 << 10  # bytes of weights from which `ThreadsFor` starts helpers
CALLS = 12  # calls per shape: a helper that starts late runs a chunk in most of them
ROWS = (1, 5)  # an AR or draft step, a verification of γ + 1 = 5


def _one_thread(matmul, x: np.ndarray, weights: tuple, nbytes: int) -> np.ndarray:
  """`matmul(x, *weights)` over slices of the output channels below the threshold (each
  weight array's leading axis is the output channel)."""
  outputs = weights[0].shape[0]
  step = max(1, outputs * (THREADED // 4) // nbytes)
  parts = [matmul(x, *(w[o:o + step] for w in weights)) for o in range(0, outputs, step)]
  return np.concatenate([np.asarray(p) for p in parts], axis=-1)


def _check(kernel: str, matmul, weights: tuple, inputs: int, nbytes: int) -> None:
  if not cpu_kernels.runs_here(kernel):
    pytest.skip(f"the {kernel} kernel does not run here")
  assert nbytes >= 2 * THREADED, "too small to start the helpers"
  call = jax.jit(matmul)
  rng = np.random.default_rng(inputs)
  for rows in ROWS:
    for _ in range(CALLS):
      x = rng.normal(size=(rows, inputs)).astype(np.float32)
      np.testing.assert_array_equal(np.asarray(call(x, *weights)),
                                    _one_thread(call, x, weights, nbytes))


def test_int8_matmul_over_threads_equals_one_thread():
  m = quant.Int8Matrix.quantize(
      jnp.asarray(np.random.default_rng(0).normal(size=(1024, 1536)), jnp.float32))
  _check("int8_matmul", cpu_kernels.int8_matmul, (m.codes, m.scale), 1024, m.codes.nbytes)


def test_int4_matmul_over_threads_equals_one_thread():
  m = quant.Int4Matrix.quantize(
      jnp.asarray(np.random.default_rng(1).normal(size=(1024, 2048)), jnp.float32), 128)
  _check("int4_matmul", cpu_kernels.int4_matmul, (m.codes, m.lo, m.scale), 1024,
         m.codes.nbytes)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_gguf_matmul_over_threads_equals_one_thread(name):
  """A super-block type and a plain one: the two loops the kernel's rows take."""
  from test_gguf_matrix import _random_blocks

  from specjax.gguf_matrix import KINDS

  blocks = jnp.asarray(_random_blocks(KINDS[name], rows=1024, inputs=1024, seed=2))
  matmul = functools.partial(_gguf, KINDS[name])
  _check("gguf_matmul", matmul, (blocks,), 1024, blocks.nbytes)


def _gguf(kind, x, blocks):
  return cpu_kernels.gguf_matmul(x, blocks, kind)


def test_q4_0_int8_matmul_over_threads_equals_one_thread():
  import gguf

  w = np.random.default_rng(3).normal(size=(2048, 1024)).astype(np.float32)
  blocks = jnp.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0))
  _check("q4_0_int8_matmul", cpu_kernels.q4_0_int8_matmul, (blocks,), 1024, blocks.nbytes)
