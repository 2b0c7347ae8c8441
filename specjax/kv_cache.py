"""Preallocated full-precision KV cache.

One buffer per layer (not one stacked [L, ...] array): reading a slice of a stacked
buffer inside a conditional materialises a copy of that layer, so per-layer buffers let
each attention read its cache in place. Layout [B, K, S, H]: attention contracts over H
with S free, so XLA reads the cache as stored instead of transposing it every step. Slots are absolute positions; sliding-window
layers mask by distance. Rolling back rejected draft tokens is `with_length`, no copy.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from specjax import sharding
from specjax.cache_view import CacheView, LayerView, Segment, after, keep_rows
from specjax.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.plan import PlanError


class ContextOverflowError(SpecjaxError, ValueError):
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
    # On a mesh (`sharding.running_on`) each layer is split on kv heads where they divide.
    zeros = lambda: tuple(sharding.cache_zeros(shape, dtype, config.num_kv_heads)
                          for _ in range(config.num_layers))
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

  def view(self, positions: jax.Array, *, write: bool, dense: bool, bits: int = 16,
           valid: jax.Array | None = None, window: tuple[int, int] | None = None,
           kept: KeptKV | None = None) -> KVCacheView:
    """The decoder's view of this cache for one forward of tokens at positions[B, T]
    (`cache_view`): read only, or written at `length`. `window` (sinks, recent): read
    only those slots (`plan.kv_window`, a sparse-KV draft's); `kept`: and these selected
    ones (`plan.kv_keep`)."""
    if bits < 16:
      raise PlanError(f"plan.kv_bits={bits} reads a quantised KV cache, but this one is full "
                      f"precision: decode with a QuantKVCache (kv_cache='quant')")
    if (window is not None or kept is not None) and write:
      raise PlanError("plan.kv_window is a draft's sparse read: a forward that writes the "
                      "cache is the target's and reads all of it")
    mode = "read" if not write else "append" if dense else "in_place"
    return KVCacheView(self, positions, mode, window, kept)


@dataclasses.dataclass
class KVCacheView:
  """A `KVCache` as the decoder reads and writes it in one forward.

  `read`: the slots before `length`, plus the tokens; their K/V are dropped.
  `append` (a dense writer): the same reads, then each layer's rows are written at
  `length` once its attention is done: attending over a freshly written cache without
  conditionals made XLA:CPU duplicate the write and copy every layer.
  `in_place` (a writer under a traced plan): the rows are written into the layer inside
  the sub-layer's first conditional and the second reads the layer itself (the causal
  mask hides slots past the tokens).
  `window` (read only): the sink and recent slots alone (`window_segments`); with
  `kept`, the selected slots too (`KeptKV`)."""

  cache: KVCache
  positions: jax.Array  # [B, T]
  mode: str
  window: tuple[int, int] | None = None
  kept: KeptKV | None = None
  rows: list[tuple[jax.Array, jax.Array]] = dataclasses.field(default_factory=list)

  def layer(self, l: int) -> LayerView:
    k, v, length = self.cache.k[l], self.cache.v[l], self.cache.length
    if self.mode == "in_place":
      return LayerView((Segment.slots(k, v),), at=length, in_place=True)
    B, S = k.shape[0], k.shape[2]
    if self.window is not None and sum(self.window) < S:
      segments = window_segments(k, v, length, *self.window)
    else:
      valid = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) < length, (B, S))
      segments = (Segment.slots(k, v, valid, filled=length),)
    if self.kept is not None:  # before the recent window, whose slots it never holds
      segments = (self.kept.segment(l),) + segments
    return LayerView.reading(segments, self.positions)

  def keep(self, l: int, layer: LayerView, run, x: jax.Array) -> None:
    if self.mode == "in_place":
      self.rows.append(layer.target)
    elif self.mode == "append":  # written once this layer's read of the old cache is done
      self.rows.append(tuple(after(x, list(layer.target))))

  def result(self) -> KVCache:
    if self.mode == "read":
      return self.cache
    T, length = self.positions.shape[1], self.cache.length
    ks, vs = (tuple(r) for r in zip(*self.rows))
    if self.mode == "append":
      put = lambda c, rows: jax.lax.dynamic_update_slice_in_dim(c, rows, length, axis=2)
      ks, vs = tuple(map(put, self.cache.k, ks)), tuple(map(put, self.cache.v, vs))
    return KVCache(k=ks, v=vs, length=length + T)


def window_segments(k: jax.Array, v: jax.Array, length: jax.Array, sinks: int, recent: int
                    ) -> tuple[Segment, ...]:
  """A StreamingLLM-style read of one cache layer k/v[B, K, S, H] holding `length` tokens:
  its first `sinks` slots (the attention sinks; none when 0) and the `recent` slots before
  `length`, each a slice of the layer, so attention costs sinks + recent slots, not the
  context. Before the context outgrows them the two overlap; the recent slice then starts
  after the sinks and its unfilled slots are invalid. Needs sinks + recent < S."""
  B, S = k.shape[0], k.shape[2]
  start = jnp.clip(length - recent, sinks, S - recent)
  slots = start + jnp.arange(recent, dtype=jnp.int32)
  cut = lambda a: jax.lax.dynamic_slice_in_dim(a, start, recent, axis=2)
  tail = Segment(cut(k), cut(v), jnp.broadcast_to(slots, (B, recent)),
                 jnp.broadcast_to(slots < length, (B, recent)))
  if sinks == 0:
    return (tail,)
  head = jnp.arange(sinks, dtype=jnp.int32)
  sink = Segment(k[:, :, :sinks], v[:, :, :sinks], jnp.broadcast_to(head, (B, sinks)),
                 jnp.broadcast_to(head < length, (B, sinks)))
  return sink, tail


@flax.struct.dataclass
class KeptKV:
  """Slots of the verified cache a sparse draft reads besides its recent window, chosen
  per layer and kv head (SnapKV's selection, `drafters.snapkv`) and copied out once, so a
  draft step reads C contiguous rows per head instead of gathering them.

  Row c of head k holds the c-th slot that head chose, so rows of one index are different
  positions in different heads, and `Segment`'s one position per row cannot name them.
  Every kept slot precedes the recent window and every query, so the causal mask would
  pass them all; they are read at position 0. A sliding-window layer therefore drops
  them once its queries are a window past the start: a draft's approximation, never the
  target's."""

  k: tuple[jax.Array, ...]  # L x [B, K, C, H]
  v: tuple[jax.Array, ...]  # L x [B, K, C, H]
  valid: jax.Array  # bool[B, C]: a context shorter than the budget fills fewer rows

  @property
  def size(self) -> int:
    """C: rows kept per head."""
    return self.valid.shape[1]

  def segment(self, l: int) -> Segment:
    B, C = self.valid.shape
    return Segment(self.k[l], self.v[l], jnp.zeros((B, C), jnp.int32), self.valid)


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

  def view(self, inner, length: jax.Array) -> DraftBufferView:
    """The decoder's view while drafting: `inner` (a read-only view of the verified
    cache, whose first `length` tokens precede row 0) plus this buffer's rows; the
    tokens' K/V are kept in the buffer."""
    return DraftBufferView(self, inner, length)


@dataclasses.dataclass
class DraftBufferView:
  """A `DraftBuffer` over a read-only cache view, as the drafting decoder sees it."""

  buffer: DraftBuffer
  inner: CacheView  # read-only, of the verified cache
  length: jax.Array
  kept: list[tuple[jax.Array, jax.Array]] = dataclasses.field(default_factory=list)

  def layer(self, l: int) -> LayerView:
    buf = self.buffer
    B, G = buf.k[l].shape[0], buf.size
    rows = jnp.arange(G, dtype=jnp.int32)
    seg = Segment(buf.k[l], buf.v[l], jnp.broadcast_to(self.length + rows, (B, G)),
                  jnp.broadcast_to(rows < buf.count, (B, G)))
    view = self.inner.layer(l)
    return view.replace(segments=view.segments + (seg,))

  def keep(self, l: int, layer: LayerView, run, x: jax.Array) -> None:
    """Rows of a skipped sub-layer keep what the buffer held."""
    k, v = layer.target
    at = self.buffer.count
    self.kept.append((keep_rows(self.buffer.k[l], k, run, at),
                      keep_rows(self.buffer.v[l], v, run, at)))

  def result(self) -> DraftBuffer:
    ks, vs = (tuple(r) for r in zip(*self.kept))
    T = self.inner.positions.shape[1]
    return DraftBuffer(k=ks, v=vs, count=self.buffer.count + T)


def cache_size_for(num_tokens: int, max_context: int, bucket: int = 256) -> int:
  """Round a required size up to a bucket so that nearby lengths share one executable."""
  if num_tokens > max_context:
    raise ContextOverflowError(
        f"{num_tokens} tokens exceed the model's context of {max_context}"
    )
  return min(-(-num_tokens // bucket) * bucket, max_context)
