"""Building the C++ kernels: each source compiled once per machine for its own CPU, cached,
loaded and registered as `jax.ffi` targets; and whether a kernel can run here.

Each source is compiled with the host's C++ compiler (`$CXX`, else g++) for its own CPU
(`-march=native`) and cached under `cache_root()/kernels`, keyed by the source and the
headers beside it (`workers.h`: how the kernels share work with XLA's threads;
`float_vectors.h`: vector types and exp; `half.h`: GGUF blocks' half-float scales), the
jax version and the CPU's flags. Where no compiler is found, or `SPECJAX_CPU_KERNELS=0`,
`kernel_status()` says why and `specjax.ops` takes the XLA path; `SPECJAX_CPU_KERNELS` may
also list the kernels to use (`int8_matmul,f32_matmul`), to measure one against XLA.
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
from filelock import FileLock

from specjax.errors import SpecjaxError

# kernel -> (source, {ffi target: exported handler symbol})
KERNELS = {
    "int8_matmul": ("int8_matmul.cc", {"specjax_int8_matmul": "Int8Matmul"}),
    "int4_matmul": ("int4_matmul.cc", {"specjax_int4_matmul": "Int4Matmul"}),
    "f32_matmul": ("f32_matmul.cc", {"specjax_f32_matmul_io": "F32MatmulIO",
                                     "specjax_f32_matmul_oi": "F32MatmulOI"}),
    "f32_attention": ("f32_attention.cc", {"specjax_f32_attention": "F32Attention"}),
    "f32_argmax": ("f32_argmax.cc", {"specjax_f32_argmax": "F32Argmax"}),
    "quant_attention": ("quant_attention.cc", {"specjax_quant_partials": "QuantPartials"}),
    "gguf_matmul": ("gguf_matmul.cc", {"specjax_gguf_matmul": "GgufMatmul",
                                       "specjax_gguf_dequantize": "GgufDequantize"}),
    "q4_0_int8_matmul": ("q4_0_int8_matmul.cc", {"specjax_q4_0_int8_matmul": "Q4_0Int8Matmul"}),
}
SOURCE = Path(__file__).with_name(KERNELS["int8_matmul"][0])  # the first kernel written
# Let the vectoriser reorder the dot's sums (several times faster), but not -ffast-math:
# with it GCC links crtfastmath.o into the shared object, whose loading switches the
# whole process to flush-to-zero (a test of subnormal floats caught it).
_REASSOCIATE = ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
# How every kernel is compiled (for this CPU), but those `IN_ORDER`; `compile_flags` gives
# a source's, which `experiments/bench_f32_tile.py` builds its harness with too.
COMPILE_FLAGS = ("-O3", "-march=native", *_REASSOCIATE, "-std=c++17")
# Sources compiled without reassociation: their sums run in the order written, so a row
# gets the same bits whatever rows share its call, and a verification's logits equal the
# AR step's. With it GCC reordered `f32_matmul`'s one-row and five-row dot products
# differently (the tied head's logits differed in their last bits), and may split a
# loop's sum by its trip count, which `f32_attention` must not let depend on T.
IN_ORDER = frozenset({"f32_matmul.cc", "f32_attention.cc", "gguf_matmul.cc",
                       "q4_0_int8_matmul.cc"})
# Sources whose float expressions must round as written: GCC contracts a*b + c into an
# FMA (one rounding) by default, even under -std=c++17; `gguf_matmul` must compute
# gguf-py's (d * q) + m, two roundings, to give the file's float32 weights exactly.
_UNFUSED = frozenset({"gguf_matmul.cc"})


def compile_flags(source: str) -> tuple[str, ...]:
  """The compiler flags of the kernel source named `source`."""
  flags = COMPILE_FLAGS
  if source in IN_ORDER:
    flags = tuple(f for f in flags if f != "-fassociative-math")
  if source in _UNFUSED:
    flags = (*flags, "-ffp-contract=off")
  return flags


class KernelBuildError(SpecjaxError, RuntimeError):
  """The C++ compiler failed on a kernel's source."""


def cpu_flags() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("flags"):
        return line
  except OSError:
    pass
  import platform
  return platform.processor() or platform.machine()


def build(source: Path, compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
  """The shared library of `source` for this machine, compiled now unless cached.
  `extra_flags` follow the usual ones (`-mno-avx512f`: a test builds each vector path)."""
  from specjax.storage import cache_root

  flags = (*compile_flags(source.name), *extra_flags)
  headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # e.g. workers.h
  key = hashlib.sha256(b"\0".join(
      [source.read_bytes(), *headers, jax.__version__.encode(), cpu_flags().encode(),
       compiler.encode(), " ".join(flags).encode()])).hexdigest()[:16]
  out = cache_root() / "kernels" / f"{source.stem}-{key}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  # One build per library: processes that start together (test workers) wait for the first
  # one's, rather than each spending 5-10 s of a core on the same compile.
  with FileLock(str(out) + ".lock"):
    if out.exists():
      return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
      built = Path(tmp) / out.name
      cmd = [compiler, *flags, "-shared", "-fPIC", "-w",
             f"-I{jax.ffi.include_dir()}", str(source), "-o", str(built)]
      proc = subprocess.run(cmd, capture_output=True, text=True)
      if proc.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
      os.replace(built, out)  # atomic: a process that skips the lock never reads half a file
  return out


# Each built kernel's library, kept for the functions it exports besides its FFI handlers.
_LIBRARIES: dict[str, ctypes.CDLL] = {}


def library(kernel: str) -> ctypes.CDLL:
  """`kernel`'s loaded library (after `require`), for the functions it exports besides
  its FFI handlers."""
  require(kernel)
  return _LIBRARIES[kernel]



@functools.cache
def kernel_status(kernel: str = "int8_matmul") -> str:
  """'ready', or why `kernel` takes the XLA path on this machine."""
  chosen = os.environ.get("SPECJAX_CPU_KERNELS", "1")
  if chosen == "0" or chosen != "1" and kernel not in chosen.split(","):
    return f"disabled by SPECJAX_CPU_KERNELS={chosen}"
  compiler = os.environ.get("CXX", "g++")
  if shutil.which(compiler) is None:
    return f"no C++ compiler ({compiler!r} not found; install g++ or set $CXX)"
  source, targets = KERNELS[kernel]
  try:
    lib = ctypes.cdll.LoadLibrary(str(build(Path(__file__).with_name(source), compiler)))
  except (KernelBuildError, OSError) as err:
    warnings.warn(f"specjax: the CPU kernel {kernel} did not build, it takes the slower "
                  f"XLA path:\n{err}", stacklevel=2)
    errors = [line for line in str(err).splitlines() if "error" in line] or [repr(err)]
    return f"build failed: {errors[0]}"
  _LIBRARIES[kernel] = lib
  for target, symbol in targets.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                platform="cpu")
  return "ready"


def require(kernel: str) -> None:
  """Build and register `kernel` if need be; `SpecjaxError` saying why when it cannot run."""
  status = kernel_status(kernel)
  if status != "ready":
    raise SpecjaxError(f"the {kernel} CPU kernel is not available: {status}")


def runs_here(kernel: str) -> bool:
  """Whether `kernel` is the path to take now: a CPU backend, and the kernel built."""
  return unavailable(kernel) is None


def unavailable(kernel: str) -> str | None:
  """None where `kernel` runs now, else why not, for an error message: what needs it
  (`--dtype gguf`, the `4bit` draft) has no XLA path to fall back on."""
  status = kernel_status(kernel)
  if jax.default_backend() == "cpu" and status == "ready":
    return None
  return f"backend {jax.default_backend()}, kernel {status}"
