"""Each C++ matmul kernel's vector paths, built here one instruction set at a time: the
project's CPUs take different ones (AVX-512 on the Xeon and one AMD EPYC, AVX2 on the
other, plain C++ elsewhere), and the suite otherwise only ever runs the path of the
machine it is on. Every path must compute the product its Python wrapper promises."""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cpu_kernels, quant

# path -> (flags that turn the wider instruction sets off, the CPU flag the path needs)
PATHS = {
    "avx512": ((), "avx512f"),
    "avx2": (("-mno-avx512f",), "avx2"),
    "plain": (("-mno-avx",), None),  # no AVX: GCC drops AVX2, FMA and AVX-512 with it
}
# kernel -> its exported handlers, as `cpu_kernels.build.KERNELS` names them
KERNELS = {"f32_matmul": ("F32MatmulIO", "F32MatmulOI"), "int8_matmul": ("Int8Matmul",),
           "int4_matmul": ("Int4Matmul",), "gguf_matmul": ("GgufMatmul", "GgufDequantize"),
           "q4_0_int8_matmul": ("Q4_0Int8Matmul",)}
SHAPES = [(1, 576, 300), (5, 200, 70), (9, 128, 17), (3, 64, 5)]  # rows, inputs, outputs


def _targets(kernel: str, path: str) -> dict[str, str]:
  """{handler: FFI target} of `kernel` built for `path`, registered under names of its own."""
  flags, needs = PATHS[path]
  if cpu_kernels.kernel_status(kernel) != "ready" or platform.machine() != "x86_64" or (
      needs and needs not in cpu_kernels.build.cpu_flags().split()):
    pytest.skip(f"this machine cannot build or run the {path} path of {kernel}")
  source = Path(cpu_kernels.__file__).with_name(cpu_kernels.build.KERNELS[kernel][0])
  compiler = os.environ.get("CXX", "g++")  # as `kernel_status` builds
  lib = ctypes.cdll.LoadLibrary(str(cpu_kernels.build.build(source, compiler, flags)))
  targets = {}
  for handler in KERNELS[kernel]:
    targets[handler] = f"specjax_test_{handler}_{path}"
    jax.ffi.register_ffi_target(targets[handler], jax.ffi.pycapsule(getattr(lib, handler)),
                                platform="cpu")
  return targets


def _call(target: str, out_shape, *args) -> np.ndarray:
  out = jax.ShapeDtypeStruct(out_shape, jnp.float32)
  return np.asarray(jax.ffi.ffi_call(target, out)(*args))


def _close(got, want, inner: int) -> None:
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(inner))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_f32_matmul_paths(path):
  targets = _targets("f32_matmul", path)
  rng = np.random.default_rng(0)
  for rows, inner, outer in SHAPES:
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    w = rng.normal(size=(inner, outer)).astype(np.float32)
    want = x.astype(np.float64) @ w
    _close(_call(targets["F32MatmulIO"], (rows, outer), x, w), want, inner)
    _close(_call(targets["F32MatmulOI"], (rows, outer), x, np.ascontiguousarray(w.T)), want,
           inner)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_int8_matmul_paths(path):
  targets = _targets("int8_matmul", path)
  rng = np.random.default_rng(1)
  for rows, inner, outer in SHAPES:
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    m = quant.Int8Matrix.quantize(jnp.asarray(rng.normal(size=(inner, outer)), jnp.float32))
    want = x.astype(np.float64) @ np.asarray(m.dequantize(), np.float64)
    _close(_call(targets["Int8Matmul"], (rows, outer), x, m.codes, m.scale), want, inner)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_int4_matmul_paths(path):
  """Groups of 64 and of 128 inputs: the AVX2 loop takes 16 code bytes a step."""
  targets = _targets("int4_matmul", path)
  rng = np.random.default_rng(2)
  for (rows, inner, outer), group in zip(SHAPES, (64, 128, 64, 32)):
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    m = quant.Int4Matrix.quantize(jnp.asarray(rng.normal(size=(inner, outer)), jnp.float32),
                                  group)
    padded = np.pad(x, ((0, 0), (0, 2 * m.codes.shape[1] - inner)))
    grid = np.asarray(quant.activation_grid(jnp.asarray(padded), group), np.float64)
    want = grid[:, :inner] @ np.asarray(m.dequantize(), np.float64)
    _close(_call(targets["Int4Matmul"], (rows, outer), padded, m.codes, m.lo, m.scale), want,
           inner)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_gguf_matmul_paths(path):
  """Every block type: the dequantised rows gguf-py's bit for bit (the plain path converts
  float16 scales without F16C), the products close to float64's, and a row's product the
  same alone as among 11 rows."""
  import gguf
  from test_gguf_matrix import _random_blocks

  from specjax.gguf_matrix import KINDS

  targets = _targets("gguf_matmul", path)
  x = np.random.default_rng(3).normal(size=(11, 256)).astype(np.float32)
  for kind in KINDS.values():
    blocks = _random_blocks(kind, rows=24, inputs=256, seed=kind)
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(kind)).astype(np.float32)
    call = lambda target, shape, *args: np.asarray(jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct(shape, jnp.float32))(*args, kind=np.int64(kind)))
    got = call(targets["GgufDequantize"], w.shape, blocks)
    np.testing.assert_array_equal(got.view(np.uint32), w.view(np.uint32))
    many = call(targets["GgufMatmul"], (11, 24), x, blocks)
    _close(many, x.astype(np.float64) @ w.T.astype(np.float64), 256)
    np.testing.assert_array_equal(call(targets["GgufMatmul"], (1, 24), x[4:5], blocks)[0],
                                  many[4])


@pytest.mark.parametrize("path", sorted(PATHS))
def test_q4_0_int8_matmul_paths(path):
  """The VNNI loop (AVX-512 machines that have it) and the scalar one (the rest) give the
  same integer sums of x's 8-bit codes, the same product up to float32 rounding."""
  import gguf
  from test_q4_0_int8_matmul import SHAPES, reference

  targets = _targets("q4_0_int8_matmul", path)
  rng = np.random.default_rng(4)
  for rows, inner, outer in SHAPES:
    x = rng.normal(size=(rows, inner)).astype(np.float32)
    w = rng.normal(size=(outer, inner)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    want = reference(x, blocks)
    got = _call(targets["Q4_0Int8Matmul"], (rows, outer), x, blocks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
