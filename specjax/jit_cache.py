"""Ahead-of-time compiled steps, cached by argument shapes.

Timed loops call a `Compiled` executable directly: compilation happens (once per shape
signature) before the clock starts, and a call can never silently recompile. What
compiling cost is booked by the code that owns the executables, on its own
`CompileClock` (a generation's, a drafter's DP): no module-level counters, so a compile
is never booked to whoever happens to be timing at that moment.

The cache is bounded (least recently used out): every CPU executable holds its own
memory mappings of JIT-compiled code, and a process that keeps thousands of them (a long
sweep, or the test suite) reaches the kernel's `vm.max_map_count` (65530 by default), at
which point XLA's next compile segfaults instead of raising.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from typing import Any

import jax

MAX_EXECUTABLES = 64  # a real model's step holds ~400 mappings on CPU
_CACHE: OrderedDict[tuple, Any] = OrderedDict()


@dataclasses.dataclass
class CompileClock:
  """Compilation booked to one owner: the compiles made through `compiled(..., clock=)`
  and the seconds they took (a cache hit books nothing)."""

  seconds: float = 0.0
  count: int = 0


def _signature(args: tuple) -> tuple:
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple(
      (tuple(x.shape), str(x.dtype), getattr(x, "weak_type", False)) for x in leaves
  )


def compiled(fn, *args, clock: CompileClock | None = None, **static) -> Any:
  """`fn.lower(*args, **static).compile()`, memoised; call the result with `*args` only.
  A compile (not a hit) is booked on `clock`."""
  key = (fn, tuple(sorted(static.items())), _signature(args))
  if key in _CACHE:
    _CACHE.move_to_end(key)
    return _CACHE[key]
  t = time.perf_counter()
  exe = fn.lower(*args, **static).compile()
  if clock is not None:
    clock.seconds += time.perf_counter() - t
    clock.count += 1
  _CACHE[key] = exe
  while len(_CACHE) > MAX_EXECUTABLES:
    _CACHE.popitem(last=False)
  return exe


def clear() -> None:
  """Drop every cached executable, ours and jax's own (their code mappings go with them)."""
  _CACHE.clear()
  jax.clear_caches()
