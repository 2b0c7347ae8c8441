"""Ahead-of-time compiled steps, cached by argument shapes.

Timed loops call a `Compiled` executable directly: compilation happens (once per shape
signature) before the clock starts, and a call can never silently recompile. What
compiling cost is booked by the code that owns the executables, on its own
`CompileClock` (a generation's, a drafter's DP): no module-level counters, so a compile
is never booked to whoever happens to be timing at that moment.

The cache is bounded (least recently used out): every CPU executable holds its own
memory mappings of JIT-compiled code, and a process that keeps thousands of them (a long
sweep, the test suite, the 1.5B's long-context run) reaches the kernel's
`vm.max_map_count` (65530 by default), at which point XLA's next compile fails
("LLVM ERROR: Unable to allocate section memory") or segfaults instead of raising. A
1.5B-model step holds far more mappings than a small one, so the bound is on the
process's mappings as well as on the count. Evicting is not enough by itself: jax keeps
every executable it compiled on its own cached lowering, so an evicted one keeps its
memory until `jax.clear_caches()` (measured: not one mapping came back). An eviction
therefore drops a batch of the oldest (down to three quarters of the bound, or half the
cache when the mappings are over budget) and then jax's caches; what this cache still
holds stays valid, and plain `jax.jit` calls compile again on their next use.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from typing import Any

import jax

MAX_EXECUTABLES = 64  # a small real model's step holds ~400 mappings on CPU
_CACHE: OrderedDict[tuple, Any] = OrderedDict()


def _max_map_count() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530  # the Linux default; other systems have no such limit to hit


MAX_MAPPINGS = _max_map_count() // 2  # the rest is headroom for the next compiles


def _mappings() -> int:
  """This process's memory mappings (0 where /proc is absent)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


@dataclasses.dataclass
class CompileClock:
  """Compilation booked to one owner: the compiles made through `compiled(..., clock=)`
  and the seconds they took (a cache hit books nothing)."""

  seconds: float = 0.0
  count: int = 0


def _signature(args: tuple) -> tuple:
  """What an executable is specific to: the arguments' structure, shapes, dtypes and where
  they live (a model split over a mesh compiles for its shardings; `sharding`), and the
  mesh set for the computation."""
  leaves, treedef = jax.tree.flatten(args)
  return treedef, jax.sharding.get_abstract_mesh(), tuple(
      (tuple(x.shape), str(x.dtype), getattr(x, "weak_type", False),
       getattr(x, "sharding", None)) for x in leaves
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
  # Mappings this cache does not own (the weights, other libraries) must not make every
  # compile empty it: the mappings only count while it holds more than a quarter of its
  # bound.
  crowded = len(_CACHE) > MAX_EXECUTABLES // 4 and _mappings() > MAX_MAPPINGS
  if len(_CACHE) > MAX_EXECUTABLES or crowded:
    _evict(crowded)
  return exe


def _evict(crowded: bool) -> None:
  """Drop a batch of the least recently used executables (half the cache when the
  process's mappings are `crowded`), then jax's caches, which would otherwise keep them
  alive; the newest entry always stays."""
  keep = (MAX_EXECUTABLES * 3) // 4
  if crowded:
    keep = min(keep, len(_CACHE) // 2)
  while len(_CACHE) > max(keep, 1):
    _CACHE.popitem(last=False)
  jax.clear_caches()


def clear() -> None:
  """Drop every cached executable, ours and jax's own (their code mappings go with them)."""
  _CACHE.clear()
  jax.clear_caches()
