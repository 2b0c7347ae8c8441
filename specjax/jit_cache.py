"""Ahead-of-time compiled steps, cached by argument shapes.

Timed loops call a `Compiled` executable directly: compilation happens (once per shape
signature) before the clock starts, and a call can never silently recompile.
"""

from __future__ import annotations

import time
from typing import Any

import jax

_CACHE: dict[tuple, Any] = {}
_SECONDS = [0.0]  # total time spent compiling through `compiled`


def _signature(args: tuple) -> tuple:
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple(
      (tuple(x.shape), str(x.dtype), getattr(x, "weak_type", False)) for x in leaves
  )


def compiled(fn, *args, **static) -> Any:
  """`fn.lower(*args, **static).compile()`, memoised; call the result with `*args` only."""
  key = (fn, tuple(sorted(static.items())), _signature(args))
  if key not in _CACHE:
    t = time.perf_counter()
    _CACHE[key] = fn.lower(*args, **static).compile()
    _SECONDS[0] += time.perf_counter() - t
  return _CACHE[key]


def compile_seconds() -> float:
  """Seconds spent compiling so far: timed loops subtract what a call spent compiling
  (a drafter's first DP, say) so that it is reported as compilation, not decoding."""
  return _SECONDS[0]


def compiled_count() -> int:
  """How many executables have been compiled (tests count recompilations with this)."""
  return len(_CACHE)
