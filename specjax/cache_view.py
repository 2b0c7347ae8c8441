"""The per-layer cache view: what one attention sub-layer reads, and where its new K/V go.

The decoder has one attention sub-layer and never asks what kind of cache it holds.
Each cache (`KVCache`, `QuantKVCache`, and a `DraftBuffer` over either) answers it
through this protocol, built once per forward:

    view = cache.view(positions, write=..., dense=..., bits=..., valid=...)
    view = buffer.view(view, ...)          # drafting: the tokens' K/V go to the buffer
    layer = view.layer(l)                  # LayerView: the segments layer l reads
    target = layer.write(layer.target, k, v)   # in the sub-layer: the tokens' own K/V
    ... attention over layer.with_target(target).read (and layer.kernel) ...
    view.keep(l, layer, run, x)            # after the sub-layer: keep or drop its rows
    cache = view.result()

A `LayerView` is a pytree, so it passes through the sub-layer's `lax.cond`s. Where the
tokens' K/V go is the cache's business: a full-precision cache written under a traced
plan writes them into the layer *before* reading it (`in_place`, one slice update in the
conditional: reading in one conditional and writing after it made XLA:CPU copy the
layer); every other view reads the cache as it was plus the tokens as a segment of their
own, and its `keep` writes, buffers, collects or drops the rows afterwards.

Shapes: B batch, T tokens now, S slots, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Segment:
  """Keys/values an attention reads, with their absolute positions and validity."""

  k: jax.Array  # [B, K, S, H]
  v: jax.Array  # [B, K, S, H]
  positions: jax.Array  # int32[B, S]
  valid: jax.Array  # bool[B, S]
  # A segment whose slots [0, filled) are the valid ones (a cache read from slot 0, or a
  # quantised cache's buffer): attention may then read only a prefix that holds them.
  filled: jax.Array | None = None
  # The tokens' own K/V (`LayerView.reading`): after a `filled` segment, the slots that
  # follow it, which the `f32_attention` kernel reads with it in one pass.
  own: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def slots(cls, k: jax.Array, v: jax.Array, valid: jax.Array | None = None,
            filled: jax.Array | None = None) -> Segment:
    """A cache layer read from slot 0, slot = position; `valid` None: every slot (the
    causal mask alone then decides)."""
    B, _, S, _ = k.shape
    slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    return cls(k, v, slots, jnp.ones((B, S), jnp.bool_) if valid is None else valid, filled)


@flax.struct.dataclass
class QuantRead:
  """One layer of a quantised cache, read at `bits` from its codes (slots < Q): by the
  Pallas kernel, or on a CPU (`cpu`) by the C++ kernels (`ops.quant_attention`)."""

  quantized: jax.Array  # int32 Q: tokens held quantised
  k_codes: Any  # quant.Hier of keys
  v_codes: Any  # quant.Hier of values
  bits: int = flax.struct.field(pytree_node=False)
  group: int = flax.struct.field(pytree_node=False)
  value_group: int = flax.struct.field(pytree_node=False)
  cpu: bool = flax.struct.field(pytree_node=False, default=False)


@flax.struct.dataclass
class LayerView:
  """What one attention sub-layer reads: `segments` (and a kernel-read quantised layer),
  plus the tokens' own K/V once `store`d — in the first segment itself (`in_place`, at
  slot `at`) or as `new`, a segment of their own (zeros until stored)."""

  segments: tuple[Segment, ...]
  kernel: QuantRead | None = None
  new: Segment | None = None
  at: jax.Array | None = None
  in_place: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def reading(cls, segments, positions: jax.Array, kernel: QuantRead | None = None
              ) -> LayerView:
    """A view that reads `segments` plus the tokens at `positions`[B, T] themselves."""
    B, T = positions.shape
    like = segments[0].k
    zeros = jnp.zeros(like.shape[:2] + (T, like.shape[3]), like.dtype)
    new = Segment(zeros, zeros, positions, jnp.ones((B, T), jnp.bool_), own=True)
    return cls(tuple(segments), kernel, new)

  @property
  def target(self) -> tuple[jax.Array, jax.Array]:
    """The arrays the tokens' K/V are written into: the cache layer itself (`in_place`)
    or the tokens' own segment. Only these cross the projecting conditional: passing a
    layer the step only reads through a conditional's outputs invites a copy of it."""
    seg = self.segments[0] if self.in_place else self.new
    return seg.k, seg.v

  def write(self, target: tuple[jax.Array, jax.Array], k: jax.Array, v: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """`target` with the tokens' K/V (k/v[B, T, K, H] as projected) written in."""
    rows = lambda a, like: a.transpose(0, 2, 1, 3).astype(like.dtype)  # [B, K, T, H]
    tk, tv = target
    if not self.in_place:
      return rows(k, tk), rows(v, tv)
    put = lambda c, a: jax.lax.dynamic_update_slice_in_dim(c, rows(a, c), self.at, axis=2)
    return put(tk, k), put(tv, v)

  def with_target(self, target: tuple[jax.Array, jax.Array]) -> LayerView:
    k, v = target
    if self.in_place:
      return self.replace(segments=(self.segments[0].replace(k=k, v=v),) + self.segments[1:])
    return self.replace(new=self.new.replace(k=k, v=v))

  @property
  def read(self) -> list[Segment]:
    """Every segment the queries attend over."""
    return list(self.segments) + ([] if self.new is None else [self.new])


class CacheView(Protocol):
  """What the decoder asks of a cache, layer by layer (see the module docstring)."""

  def layer(self, l: int) -> LayerView: ...

  def keep(self, l: int, layer: LayerView, run: jax.Array | bool | None, x: jax.Array
           ) -> None:
    """Record layer l's outcome (its view after the sub-layer; `x` its output, which
    the rows of a write must follow)."""

  def result(self) -> Any:
    """The cache (or draft buffer) after the forward."""



def after(dep: jax.Array, arrays: list[jax.Array]) -> list[jax.Array]:
  """`arrays`, data-dependent on `dep` (their values unchanged when dep is finite).

  XLA writes a donated cache in place only when every read of the old value is ordered
  before the write by a data dependency; otherwise it copies the layer (an
  `optimization_barrier` is expanded before copy insertion and does not order them).
  Each layer's rows depend on that layer's attention output, so its read comes first
  and its write follows at once: hanging every layer's write on the last layer's
  output instead cost verification 17 % on SmolLM2 (T = 5, measured).

  The zero comes from dep's last element (a verification's tokens: the last draft, not
  the token before the drafts), in float32: XLA folds an integer `0 * x` to 0, which
  would drop the dependency on token ids."""
  zero = 0 * dep.reshape(-1)[-1].astype(jnp.float32)
  return [a + zero.astype(a.dtype) for a in arrays]


def keep_rows(store: jax.Array, rows: jax.Array, run: jax.Array | bool | None, at: jax.Array
              ) -> jax.Array:
  """Write rows[B, K, T, H] at row `at` if the sub-layer ran; else keep the stored rows."""
  if run is None:
    return jax.lax.dynamic_update_slice_in_dim(store, rows, at, axis=2)
  if run is False:
    return store
  held = jax.lax.dynamic_slice_in_dim(store, at, rows.shape[2], axis=2)
  return jax.lax.dynamic_update_slice_in_dim(store, jnp.where(run, rows, held), at, axis=2)
