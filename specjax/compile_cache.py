"""Compiled programs kept on disk, so the next process loads them instead of compiling.

A decode compiles a few large programs per model, prompt bucket and drafter: seconds each
on a CPU, and tens of seconds for a first prompt on a GPU (docs/GPU.md). Within
a process `jit_cache` keeps them; this keeps them across processes, for a `specjax bench
--resume` after a crash, the next cell of a sweep, or `profile` before `bench`. It is
jax's own persistent compilation cache, pointed at the specjax cache folder and bounded
in size (least recently used out); jax keys each entry on the program, its compile
options, the jax version and the device, so a stale entry is never loaded.

The command line turns it on; a script or notebook calls `enable()` before it compiles
anything (jax decides once per process, at the first compile, whether to use the cache).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from specjax.storage import cache_root

ENV = "SPECJAX_COMPILE_CACHE"  # "0" leaves jax's cache setting as it is
JAX_ENV = "JAX_COMPILATION_CACHE_DIR"  # jax's own: a folder, or empty to turn the cache off
MAX_BYTES = 4 << 30


def enable(folder: str | Path | None = None) -> Path | None:
  """Keep compiled programs in `folder` (default: `<specjax cache>/xla`) and return it.

  The user's choice wins: a folder already set (`JAX_COMPILATION_CACHE_DIR`, or
  `jax_compilation_cache_dir` in jax's config) is kept and returned, and None is returned
  with nothing changed when `JAX_COMPILATION_CACHE_DIR` is empty or
  `SPECJAX_COMPILE_CACHE=0`."""
  if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
    return None
  current = jax.config.jax_compilation_cache_dir
  if current or JAX_ENV in os.environ:
    return Path(current) if current else None
  folder = Path(folder) if folder is not None else cache_root() / "xla"
  folder.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(folder))
  if jax.config.jax_compilation_cache_max_size < 0:  # jax's default: unbounded
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return folder
