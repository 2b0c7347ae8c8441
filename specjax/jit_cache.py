"""Ahead-of-time compiled steps, cached by argument shapes.

Timed loops call a `Compiled` executable directly: compilation happens (once per shape
signature) before the clock starts, and a call can never silently recompile.

The cache is bounded (least recently used out): every CPU executable holds its own
memory mappings of JIT-compiled code, and a process that keeps thousands of them (a long
sweep, or the test suite) reaches the kernel's `vm.max_map_count` (65530 by default), at
which point XLA's next compile segfaults instead of raising.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import jax

MAX_EXECUTABLES = 64  # a real model's step holds ~400 mappings on CPU
_CACHE: OrderedDict[tuple, Any] = OrderedDict()
_COMPILES = [0]  # executables compiled so far (evicted ones included)
_SECONDS = [0.0]  # total time spent compiling through `compiled`


def _signature(args: tuple) -> tuple:
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple(
      (tuple(x.shape), str(x.dtype), getattr(x, "weak_type", False)) for x in leaves
  )


def compiled(fn, *args, **static) -> Any:
  """`fn.lower(*args, **static).compile()`, memoised; call the result with `*args` only."""
  key = (fn, tuple(sorted(static.items())), _signature(args))
  if key in _CACHE:
    _CACHE.move_to_end(key)
    return _CACHE[key]
  t = time.perf_counter()
  exe = fn.lower(*args, **static).compile()
  _SECONDS[0] += time.perf_counter() - t
  _COMPILES[0] += 1
  _CACHE[key] = exe
  while len(_CACHE) > MAX_EXECUTABLES:
    _CACHE.popitem(last=False)
  return exe


def clear() -> None:
  """Drop every cached executable, ours and jax's own (their code mappings go with them)."""
  _CACHE.clear()
  jax.clear_caches()


def compile_seconds() -> float:
  """Seconds spent compiling so far: timed loops subtract what a call spent compiling
  (a drafter's first DP, say) so that it is reported as compilation, not decoding."""
  return _SECONDS[0]


def compiled_count() -> int:
  """How many executables have been compiled (tests count recompilations with this)."""
  return _COMPILES[0]
