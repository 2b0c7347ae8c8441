"""Ahead-of-time compiled steps, cached by argument shapes.

Timed loops call a `Compiled` executable directly: compilation happens (once per shape
signature) before the clock starts, and a call can never silently recompile.
"""

from __future__ import annotations

from typing import Any

import jax

_CACHE: dict[tuple, Any] = {}


def _signature(args: tuple) -> tuple:
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple(
      (tuple(x.shape), str(x.dtype), getattr(x, "weak_type", False)) for x in leaves
  )


def compiled(fn, *args, **static) -> Any:
  """`fn.lower(*args, **static).compile()`, memoised; call the result with `*args` only."""
  key = (fn, tuple(sorted(static.items())), _signature(args))
  if key not in _CACHE:
    _CACHE[key] = fn.lower(*args, **static).compile()
  return _CACHE[key]


def compiled_count() -> int:
  """How many executables have been compiled (tests count recompilations with this)."""
  return len(_CACHE)
