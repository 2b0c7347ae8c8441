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


def test_cache_is_lru_bounded_and_counts_every_compile(monkeypatch):
  monkeypatch.setattr(jit_cache, "MAX_EXECUTABLES", 4)
  jit_cache.clear()
  fn = jax.jit(_step)
  before = jit_cache.compiled_count()
  exes = [jit_cache.compiled(fn, jnp.ones((8 + i, 4)), jnp.float32(1)) for i in range(6)]
  assert jit_cache.compiled_count() == before + 6
  assert len(jit_cache._CACHE) == 4
  # The newest shapes are hits (same object); the oldest was evicted and compiles again.
  assert jit_cache.compiled(fn, jnp.ones((13, 4)), jnp.float32(2)) is exes[5]
  assert jit_cache.compiled_count() == before + 6
  jit_cache.compiled(fn, jnp.ones((8, 4)), jnp.float32(1))
  assert jit_cache.compiled_count() == before + 7
  x = jnp.arange(12.0).reshape(3, 4)
  assert jnp.allclose(jit_cache.compiled(fn, x, jnp.float32(2))(x, jnp.float32(2)),
                      _step(x, 2.0))


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
