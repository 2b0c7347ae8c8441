"""C++ kernels that XLA:CPU lacks, compiled on first use and called through `jax.ffi`.

One kernel today: `int8_matmul`, a matmul against int8 weights with one scale per output
channel, for 8-bit drafts. XLA:CPU widens an int8 matrix to float32 in memory before its
dot (31 ms for SmolLM2's LM head at T = 1, against 2.3 ms in float32), so without the
kernel an 8-bit draft costs more than the full model; with it, 0.7 ms.

The source is compiled once per machine with the host's C++ compiler (`$CXX`, else
g++) for its own CPU (`-march=native`) and cached under `cache_root()/kernels`, keyed by
the source, the jax version and the CPU's flags. Where no compiler is found, or
`SPECJAX_CPU_KERNELS=0`, `int8_matmul` falls back to the XLA path (same numbers, slower)
and `kernel_status()` says why. On a GPU the XLA path is the right one: XLA:GPU fuses
the convert into its GEMM.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError

_SOURCE = Path(__file__).with_name("int8_matmul.cc")
_TARGET = "specjax_int8_matmul"
# Let the vectoriser reorder the dot's sums (2.5x faster than without), but not -ffast-math:
# with it GCC links crtfastmath.o into the shared object, whose loading switches the
# whole process to flush-to-zero (a test of subnormal floats caught it).
_REASSOCIATE = ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")


class KernelBuildError(SpecjaxError, RuntimeError):
  """The C++ compiler failed on a kernel's source."""


def _cpu_flags() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("flags"):
        return line
  except OSError:
    pass
  import platform
  return platform.processor() or platform.machine()


def _build(source: Path, compiler: str) -> Path:
  """The shared library of `source` for this machine, compiled now unless cached."""
  from specjax.models.registry import cache_root

  key = hashlib.sha256(b"\0".join(
      [source.read_bytes(), jax.__version__.encode(), _cpu_flags().encode(),
       compiler.encode()])).hexdigest()[:16]
  out = cache_root() / "kernels" / f"{source.stem}-{key}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    built = Path(tmp) / out.name
    cmd = [compiler, "-O3", "-march=native", *_REASSOCIATE, "-std=c++17", "-shared", "-fPIC",
           "-w", f"-I{jax.ffi.include_dir()}", str(source), "-o", str(built)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      raise KernelBuildError(f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
    os.replace(built, out)  # atomic: parallel test workers never load a half-written file
  return out


@functools.cache
def kernel_status() -> str:
  """'ready', or why `int8_matmul` takes the XLA path on this machine."""
  if os.environ.get("SPECJAX_CPU_KERNELS", "1") == "0":
    return "disabled by SPECJAX_CPU_KERNELS=0"
  compiler = os.environ.get("CXX", "g++")
  if shutil.which(compiler) is None:
    return f"no C++ compiler ({compiler!r} not found; install g++ or set $CXX)"
  try:
    lib = ctypes.cdll.LoadLibrary(str(_build(_SOURCE, compiler)))
  except (KernelBuildError, OSError) as err:
    warnings.warn(f"specjax: the int8 CPU kernel did not build, 8-bit drafts take the slow "
                  f"XLA path:\n{err}", stacklevel=2)
    errors = [line for line in str(err).splitlines() if "error" in line] or [repr(err)]
    return f"build failed: {errors[0]}"
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.Int8Matmul), platform="cpu")
  return "ready"


def int8_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array) -> jax.Array:
  """x[..., I] times the int8 matrix codes[O, I] scaled per output: [..., O] in float32.

  The kernel runs on a CPU backend once built; anywhere else, the XLA expression."""
  if jax.default_backend() == "cpu" and kernel_status() == "ready":
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (codes.shape[0],), jnp.float32)
    call = jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")
    return call(x.astype(jnp.float32), codes, scale.astype(jnp.float32))
  y = jnp.einsum("...i,oi->...o", x, codes.astype(x.dtype), preferred_element_type=jnp.float32)
  return y * scale


__all__ = ["KernelBuildError", "int8_matmul", "kernel_status"]
