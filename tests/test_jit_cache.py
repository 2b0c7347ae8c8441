"""The executable cache is bounded and gives back the code mappings it drops."""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import pytest

from specjax import jit_cache


def _maps() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def _step(x, scale):
  return jnp.tanh(x @ x.T) * scale + jnp.sum(x)


def test_cache_is_lru_bounded_and_books_every_compile_on_its_clock(monkeypatch):
  monkeypatch.setattr(jit_cache, "MAX_EXECUTABLES", 4)
  jit_cache.clear()
  fn = jax.jit(_step)
  clock, other = jit_cache.CompileClock(), jit_cache.CompileClock()
  exes = [jit_cache.compiled(fn, jnp.ones((8 + i, 4)), jnp.float32(1), clock=clock)
          for i in range(6)]
  assert clock.count == 6 and clock.seconds > 0
  assert len(jit_cache._CACHE) == 4  # the 5th compile evicted the oldest two (to 3/4)
  # The newest shapes are hits (same object, nothing booked); the oldest was evicted and
  # compiles again, booked on the clock of whoever asked this time.
  assert jit_cache.compiled(fn, jnp.ones((13, 4)), jnp.float32(2), clock=clock) is exes[5]
  assert clock.count == 6
  jit_cache.compiled(fn, jnp.ones((8, 4)), jnp.float32(1), clock=other)
  assert clock.count == 6 and other.count == 1
  x = jnp.arange(12.0).reshape(3, 4)
  assert jnp.allclose(jit_cache.compiled(fn, x, jnp.float32(2))(x, jnp.float32(2)),
                      _step(x, 2.0))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_eviction_gives_back_code_mappings(monkeypatch):
  """jax keeps each executable on its cached lowering: the bound holds only because an
  eviction drops jax's caches too (before, 30 compiles kept all 30 executables mapped)."""
  monkeypatch.setattr(jit_cache, "MAX_EXECUTABLES", 4)
  jit_cache.clear()
  gc.collect()
  base = _maps()
  fns = [jax.jit(lambda x, i=i: _step(x, i)) for i in range(30)]
  jit_cache.compiled(fns[0], jnp.ones((5, 3)))
  one = _maps() - base
  for fn in fns[1:]:
    jit_cache.compiled(fn, jnp.ones((5, 3)))
  gc.collect()
  assert one > 3 and _maps() - base < 8 * one  # at most the bound's 4, not 30
  monkeypatch.setattr(jit_cache, "MAX_MAPPINGS", 0)  # over budget: half the cache goes
  jit_cache.compiled(jax.jit(lambda x: _step(x, 99)), jnp.ones((5, 3)))
  assert len(jit_cache._CACHE) == 2  # 4 held; over budget keeps the newer half
  # Mappings it does not own never empty a cache at a quarter of its bound or below.
  monkeypatch.setattr(jit_cache, "MAX_EXECUTABLES", 8)
  jit_cache.clear()
  for i in range(2):
    jit_cache.compiled(jax.jit(lambda x, i=i: _step(x, 100 + i)), jnp.ones((5, 3)))
  assert len(jit_cache._CACHE) == 2


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_clear_gives_back_code_mappings():
  jit_cache.clear()
  gc.collect()
  base = _maps()
  for i in range(30):
    jit_cache.compiled(jax.jit(lambda x, i=i: _step(x, i)), jnp.ones((5, 3)))
  grown = _maps() - base
  jit_cache.clear()
  gc.collect()
  assert grown > 30  # each CPU executable maps its own code
  assert _maps() - base < grown / 4


def test_a_generation_books_the_dense_view_of_a_quantised_cache_as_compilation():
  """The probes' full-precision view of a quantised cache is compiled through the
  generation's clock (it used to be a plain jax.jit, booked as selection time)."""
  from specjax.config import tiny_config
  from specjax.decode.session import Session
  from specjax.quant_kv_cache import QuantKV

  config = tiny_config("llama")
  cache = QuantKV(group=8, residual=16).create(config, 1, 72)
  jit_cache.clear()
  session = Session(None, None, config, cache, [1])
  dense = session.dense_cache()
  assert session.clock.count == 1 and dense.size == cache.size + 32
  session.dense_cache()
  assert session.clock.count == 1  # compiled once per shape
