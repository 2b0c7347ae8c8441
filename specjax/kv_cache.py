"""Preallocated full-precision KV cache.

One buffer per layer (not one stacked [L, ...] array): reading a slice of a stacked
buffer inside a conditional materialises a copy of that layer, so per-layer buffers let
each attention read its cache in place. Layout [B, K, S, H]: attention contracts over H
with S free, so XLA reads the cache as stored instead of transposing it every step. Slots are absolute positions; sliding-window
layers mask by distance. Rolling back rejected draft tokens is `with_length`, no copy.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.config import ModelConfig


class ContextOverflowError(ValueError):
  """More tokens than the cache (or the model) can hold."""


@flax.struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # L x [B, K, S, H]
  v: tuple[jax.Array, ...]  # L x [B, K, S, H]
  length: jax.Array  # int32 scalar: slots [0, length) hold valid entries

  @classmethod
  def create(
      cls, config: ModelConfig, batch: int, size: int, dtype: jnp.dtype = jnp.float32
  ) -> KVCache:
    if size > config.max_context:
      raise ContextOverflowError(
          f"cache of {size} tokens exceeds the model's context of {config.max_context}"
      )
    shape = (batch, config.num_kv_heads, size, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(k=zeros(), v=zeros(), length=jnp.zeros((), jnp.int32))

  @property
  def size(self) -> int:
    """S: number of slots."""
    return self.k[0].shape[2]

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in self.k + self.v)

  def with_length(self, length: jax.Array | int) -> KVCache:
    """Roll back (or forward) by length only; entries past it are dead."""
    return self.replace(length=jnp.asarray(length, jnp.int32))


@flax.struct.dataclass
class DraftBuffer:
  """K/V of the tokens drafted in the current round, kept apart from the verified cache.

  Drafting only reads the cache and writes here, so the draft executable never touches
  the cache (XLA copied it whenever one executable both read it in a conditional and
  updated it afterwards). Row j holds position cache.length + j.
  """

  k: tuple[jax.Array, ...]  # L x [B, K, G, H]
  v: tuple[jax.Array, ...]  # L x [B, K, G, H]
  count: jax.Array  # int32: rows [0, count) are valid

  @classmethod
  def like(cls, cache, size: int) -> DraftBuffer:
    """An empty buffer of `size` rows matching the cache's layers, heads and dtype (a
    `KVCache`, or a `QuantKVCache` whose full-precision buffer sets the dtype)."""
    k, v = (cache.buf_k, cache.buf_v) if hasattr(cache, "buf_k") else (cache.k, cache.v)
    zeros = lambda arrays: tuple(
        jnp.zeros(a.shape[:2] + (size, a.shape[3]), a.dtype) for a in arrays)
    return cls(k=zeros(k), v=zeros(v), count=jnp.zeros((), jnp.int32))

  @property
  def size(self) -> int:
    return self.k[0].shape[2]


def cache_size_for(num_tokens: int, max_context: int, bucket: int = 256) -> int:
  """Round a required size up to a bucket so that nearby lengths share one executable."""
  if num_tokens > max_context:
    raise ContextOverflowError(
        f"{num_tokens} tokens exceed the model's context of {max_context}"
    )
  return min(-(-num_tokens // bucket) * bucket, max_context)
