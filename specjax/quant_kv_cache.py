"""QuantSpec's hierarchical KV cache: one copy that the target reads at 8 bits and the
draft at 4, plus a full-precision buffer for the most recent tokens.

Layout per layer (B batch, K kv heads, S quantised slots, H head dim, R = `residual`):
  * keys, per channel over groups of G tokens: codes uint8[B, K, S, H/2] (upper and
    lower nibble planes, two codes per byte along H), lo/scale f32[B, K, S/G, H];
  * values, per token over groups of Gv channels: codes uint8[B, K, S, H/2],
    lo/scale f32[B, K, S, H/Gv];
  * buffer: the newest tokens at full precision, [B, K, 2R, H].
Tokens [0, Q) live quantised at slots = positions; tokens [Q, Q + b) in buffer rows
0..b-1. The buffer's oldest tokens are quantised R at a time during decoding too
(QuantSpec's public code only quantises at prefill, so a long generation overflows its
buffer). A prefill is an append of the whole prompt: all but the last R..2R tokens are
quantised.

When to flush is part of the target's definition: a token read at full precision in one
step and at 8 bits in the next changes the target's logits. So a forward first `settle`s
the cache — flushing R tokens if the buffer holds more than 2R − `headroom` — and only
then reads it and appends its (at most `headroom`) tokens. The decision depends on the
committed length alone, never on how many drafts a step appends, so AR and SSD at any γ
read exactly the same cache at every position (greedy SSD == greedy AR, bit for bit in
what the target sees).

Rolling back rejected drafts is `with_length`, as for `KVCache`: the rejected tokens are
the newest, always still in the buffer (γ + 1 ≤ headroom ≤ R, checked by the engine).
The flushed tokens are the oldest ones, all committed.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from specjax import ops, quant, sharding
from specjax.cache_view import LayerView, QuantRead, Segment, after, keep_rows
from specjax.config import ModelConfig
from specjax.kv_cache import ContextOverflowError, KVCache
from specjax.plan import PlanError, conditionals_skip_cheaply
from specjax.quant import Hier, QuantError


@dataclasses.dataclass(frozen=True)
class QuantKV:
  """How to build a `QuantKVCache` (what `generate` / `speculative_generate` take as
  `kv_cache`): G key tokens per group, Gv value channels per group (None: min(G, H)),
  R the flush size (buffer 2R), `headroom` the most tokens one decoding step appends
  (γ + 1 ≤ headroom ≤ R). AR and SSD decode the same target only on equal `QuantKV`s."""

  group: int = 128
  value_group: int | None = None
  residual: int = 128
  headroom: int | None = None  # None: min(16, R)
  kernel: bool = False  # attention reads the codes with the Pallas kernel (GPU; CPU interprets)

  @property
  def max_step(self) -> int:
    """The most tokens one forward may append once decoding (the resolved headroom)."""
    return _headroom(self.headroom, self.residual)

  def create(self, config: ModelConfig, batch: int, size: int) -> QuantKVCache:
    return QuantKVCache.create(config, batch, size, group=self.group,
                               value_group=self.value_group, residual=self.residual,
                               headroom=self.headroom, kernel=self.kernel)


def create_cache(config: ModelConfig, size: int, kv_cache: QuantKV | None = None, dtype=None):
  """A full-precision `KVCache` (kv_cache=None) or a quantised one, for B = 1."""
  if kv_cache is None:
    return KVCache.create(config, 1, size, jnp.float32 if dtype is None else dtype)
  return kv_cache.create(config, 1, size)


def _headroom(headroom: int | None, residual: int) -> int:
  return min(16, residual) if headroom is None else headroom


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@flax.struct.dataclass
class QuantKVCache:
  k_codes: tuple[Hier, ...]  # L x keys (grouped over tokens)
  v_codes: tuple[Hier, ...]  # L x values (grouped over channels)
  buf_k: tuple[jax.Array, ...]  # L x [B, K, 2R, H]
  buf_v: tuple[jax.Array, ...]
  quantized: jax.Array  # int32 Q: tokens held quantised (a multiple of R)
  buffered: jax.Array  # int32 b: tokens in the buffer
  finite: jax.Array  # bool: every K/V appended so far was finite (`check_finite`)
  group: int = flax.struct.field(pytree_node=False, default=128)  # G, key tokens per group
  value_group: int = flax.struct.field(pytree_node=False, default=64)  # Gv, channels
  residual: int = flax.struct.field(pytree_node=False, default=128)  # R
  headroom: int = flax.struct.field(pytree_node=False, default=16)  # most tokens a step adds
  kernel: bool = flax.struct.field(pytree_node=False, default=False)  # Pallas reads
  # A CPU's C++ kernels read the codes (`ops.quant_codes_on_cpu`, decided at creation).
  cpu_reads: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def create(cls, config: ModelConfig, batch: int, size: int, *, group: int = 128,
             value_group: int | None = None, residual: int = 128, headroom: int | None = None,
             kernel: bool = False, dtype=jnp.float32) -> QuantKVCache:
    """A cache for `size` tokens. Gv defaults to min(G, H): a value group never spans
    two heads. R must be a multiple of G (whole key groups are quantised at a time).
    `headroom` (default min(16, R)) bounds the tokens one decoding step appends. On a CPU
    with the `quant_attention` kernel built, attention reads the codes (`cpu_reads`);
    elsewhere it dequantises them, unless `kernel` (Pallas)."""
    H, K = config.head_dim, config.num_kv_heads
    value_group = min(group, H) if value_group is None else value_group
    if size > config.max_context:
      raise ContextOverflowError(
          f"cache of {size} tokens exceeds the model's context of {config.max_context}")
    if group < 1 or residual % group:
      raise QuantError(f"the buffer flushes R={residual} tokens at a time, which must be a "
                       f"whole number of key groups of G={group} tokens")
    headroom = _headroom(headroom, residual)
    if not 1 <= headroom <= residual:
      raise QuantError(f"headroom (tokens a decoding step appends) must be in [1, R={residual}],"
                       f" got {headroom}")
    if value_group < 1 or H % value_group:
      raise QuantError(f"value groups of {value_group} channels do not divide head_dim {H}")
    if kernel and not (value_group == H or (H // 2) % value_group == 0):
      raise QuantError(f"the attention kernel reads one half of the channels per nibble "
                       f"plane: value groups of {value_group} must be {H} or divide {H // 2}")
    S = _round_up(max(size, 1), group)
    # on a mesh: split on kv heads if they divide
    zeros = lambda shape, dtype: sharding.cache_zeros(shape, dtype, K)
    code = lambda: zeros((batch, K, S, H // 2), jnp.uint8)
    f32 = lambda *shape: zeros(shape, jnp.float32)
    keys = tuple(Hier(code(), code(), f32(batch, K, S // group, H), f32(batch, K, S // group, H))
                 for _ in range(config.num_layers))
    values = tuple(Hier(code(), code(), f32(batch, K, S, H // value_group),
                        f32(batch, K, S, H // value_group)) for _ in range(config.num_layers))
    buf = lambda: tuple(zeros((batch, K, 2 * residual, H), dtype)
                        for _ in range(config.num_layers))
    zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the cache is donated
    return cls(keys, values, buf(), buf(), zero(), zero(), jnp.ones((), jnp.bool_), group,
               value_group, residual, headroom, kernel,
               cpu_reads=not kernel and ops.quant_codes_on_cpu())

  @property
  def size(self) -> int:
    """Quantised slots (the cache holds up to this many tokens in all)."""
    return self.k_codes[0].upper.shape[2]

  @property
  def length(self) -> jax.Array:
    return self.quantized + self.buffered

  @property
  def nbytes(self) -> int:
    leaves = jax.tree.leaves((self.k_codes, self.v_codes, self.buf_k, self.buf_v))
    return sum(x.nbytes for x in leaves)

  def with_length(self, length) -> QuantKVCache:
    """Roll back (or forward) within the buffer: the quantised part never moves."""
    return self.replace(buffered=jnp.asarray(length, jnp.int32) - self.quantized)

  # --- reading ------------------------------------------------------------------------------

  def keys(self, layer: int, bits: int) -> jax.Array:
    """Dequantised keys f32[B, K, S, H] of one layer (the jnp path; slots ≥ Q are dead)."""
    return quant.dequantize(self.k_codes[layer], axis=2, group=self.group, bits=bits)

  def values(self, layer: int, bits: int) -> jax.Array:
    return quant.dequantize(self.v_codes[layer], axis=3, group=self.value_group, bits=bits)

  def view(self, positions: jax.Array, *, write: bool, dense: bool = True, bits: int = 8,
           valid: jax.Array | None = None, window: tuple[int, int] | None = None,
           kept=None) -> QuantCacheView:
    """The decoder's view of this cache for one forward of tokens at positions[B, T]:
    read at `bits` (4: the upper nibbles, QuantSpec's draft; 16 reads as stored, 8),
    and, when writing (the target, every layer), settled first and appended after.
    `valid` (a padded prompt's real length) keeps padding out of the codes. A sparse
    `window` (or `kept`) is refused: the sparse-KV drafts are QuantSpec's baselines, not
    a reader of its cache."""
    if window is not None or kept is not None:
      raise PlanError("plan.kv_window (a sparse-KV draft) reads a full-precision KVCache, "
                      "not a quantised one: don't compose it with quantspec")
    cache = self.settle(wait_for=positions) if write else self
    return QuantCacheView(cache, positions, 4 if bits == 4 else 8, write, valid)

  def dense(self, bits: int = 8) -> KVCache:
    """A full-precision `KVCache` holding what a reader at `bits` sees (slots = positions,
    2R spare slots so the buffer always fits): for code written against `KVCache`, such
    as the layer-selection probes. A copy — never on the per-round path. (A generation
    compiles it on its own clock: `session.Session.dense_cache`.)"""
    return dense_view(self, bits)

  def check_finite(self) -> None:
    """Raise (on the host) if NaN/inf K/V ever reached the cache: their codes are garbage
    and every later attention over them would be too."""
    if not bool(self.finite):
      raise QuantError("NaN/inf keys or values reached the quantised KV cache (the model's "
                       "activations overflowed): its codes are meaningless from here on")

  def check_room(self, tokens: int) -> None:
    """Raise unless `tokens` more fit (eager callers; jitted code is sized by the caller)."""
    if isinstance(self.length, jax.core.Tracer):
      return
    if int(self.length) + tokens > self.size:
      raise ContextOverflowError(f"{int(self.length)} cached + {tokens} new tokens exceed the "
                                 f"quantised cache of {self.size} tokens")

  # --- writing ------------------------------------------------------------------------------

  def settle(self, wait_for: jax.Array | None = None) -> QuantKVCache:
    """Flush the buffer's oldest R tokens if it holds more than 2R − headroom, so that the
    next step's tokens fit. A forward calls this before it reads the cache: whether a
    token is read at full precision or at 8 bits then depends on the committed length
    only (see the module docstring).

    A flush falls due once every R tokens. On a CPU the step skips it in a `lax.cond` the
    rest of the time; on a GPU a conditional is a host round trip, so the flush runs every
    step there, and writes nothing when none is due.

    `wait_for` (a forward's positions): the flush waits for it. In a loop of rounds the
    verification's positions follow from the draft's tokens, so the draft's reads of the
    cache come before the flush overwrites it in place (unordered, XLA copied the cache
    in every round)."""
    buffered = self.buffered if wait_for is None else after(wait_for, [self.buffered])[0]
    due = buffered > 2 * self.residual - self.headroom
    if not conditionals_skip_cheaply():
      return self._flush_oldest(due)
    return jax.lax.cond(due, QuantKVCache._flush_oldest, lambda cache: cache, self)

  def _flush_oldest(self, due: jax.Array | None = None) -> QuantKVCache:
    """Quantise the buffer's oldest R tokens into slots [Q, Q + R) and shift the rest of
    the buffer down by R (`due` False: change nothing). Settle's flush: the buffer then
    holds more than 2R − headroom ≥ R tokens, so exactly R leave it.

    Every write lands in place, a slice of static size at a traced offset (those slots
    exist: the tokens are in the cache), so the conditional that skips a flush passes the
    cache through without copying it, and no token rows are scattered."""
    R, G, Gv, Q = self.residual, self.group, self.value_group, self.quantized

    def layer(dst: Hier, buf: jax.Array, keys: bool) -> tuple[Hier, jax.Array]:
      src = quant.quantize(buf[:, :, :R], axis=2 if keys else 3, group=G if keys else Gv)
      at = Q // G if keys else Q  # key scales: one row per group of G tokens
      put = lambda d, s, i: keep_rows(d, s, due, i)
      codes = Hier(put(dst.upper, src.upper, Q), put(dst.lower, src.lower, Q),
                   put(dst.lo, src.lo, at), put(dst.scale, src.scale, at))
      # The rows that stay move down (rows past b - R keep stale values) once the codes
      # are written, since XLA fuses the quantiser into their writes: every read of the
      # oldest rows is then ordered before the buffer's write (unordered, XLA copied the
      # whole buffer to write it).
      written = sum(c.reshape(-1)[0].astype(jnp.float32) for c in jax.tree.leaves(codes))
      (moved,) = after(written, [buf[:, :, R:]])
      return codes, keep_rows(buf, moved, due, 0)

    flushed = jnp.int32(R) if due is None else jnp.where(due, R, 0).astype(jnp.int32)
    hk, bk = zip(*(layer(h, b, True) for h, b in zip(self.k_codes, self.buf_k)))
    hv, bv = zip(*(layer(h, b, False) for h, b in zip(self.v_codes, self.buf_v)))
    return self.replace(k_codes=hk, v_codes=hv, buf_k=bk, buf_v=bv, quantized=Q + flushed,
                        buffered=self.buffered - flushed)

  def append(self, ks: list[jax.Array], vs: list[jax.Array], valid: jax.Array | None = None,
             *, settled: bool = False) -> QuantKVCache:
    """Append T tokens' K/V (per layer [B, K, T, H]) after `length`. A `settled` cache
    (`settle` left the room) takes a step of up to `headroom` tokens into its buffer as
    they are; any other write (a prefill chunk) flushes the buffer's oldest tokens, R at
    a time, so that it never holds more than 2R. Only the first `valid` of the T count (a
    padded prompt): at least R tokens stay buffered after a flush, so padding past them
    is never quantised."""
    T = ks[0].shape[2]
    self.check_room(T)
    count = T if valid is None else valid
    if settled and T <= self.headroom:
      put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(
          buf, new.astype(buf.dtype), self.buffered, axis=2)
      out = self.replace(buf_k=tuple(map(put, self.buf_k, ks)),
                         buf_v=tuple(map(put, self.buf_v, vs)), buffered=self.buffered + count)
    else:
      out = self._write(ks, vs, count, limit=2 * self.residual)
    finite = out.finite
    for k, v in zip(ks, vs):
      finite &= jnp.all(jnp.isfinite(k)) & jnp.all(jnp.isfinite(v))
    return out.replace(finite=finite)

  def _write(self, ks, vs, count, *, limit: int) -> QuantKVCache:
    """Put `count` new tokens (ks/vs None: none) after the buffer, quantising its oldest
    tokens R at a time until at most `limit` stay buffered."""
    R, G = self.residual, self.group
    T = 0 if ks is None else ks[0].shape[2]
    m = self.buffered + count
    f = jnp.maximum(0, -(-(m - limit) // R)) * R  # tokens to quantise (multiple of R)
    M = _round_up(4 * R + T, G)  # stream rows: buffer, new tokens, room to slice 2R after f

    def layer(hk, hv, bk, bv, k, v):
      def stream(buf, new):
        rows = jnp.zeros(buf.shape[:2] + (M,) + buf.shape[3:], buf.dtype)
        rows = rows.at[:, :, : 2 * R].set(buf)
        return rows if new is None else jax.lax.dynamic_update_slice_in_dim(
            rows, new.astype(buf.dtype), self.buffered, axis=2)
      sk, sv = stream(bk, k), stream(bv, v)
      hk = _scatter_rows(hk, quant.quantize(sk, axis=2, group=G), self.quantized, f, G, keys=True)
      hv = _scatter_rows(hv, quant.quantize(sv, axis=3, group=self.value_group),
                         self.quantized, f, G, keys=False)
      return hk, hv, jax.lax.dynamic_slice_in_dim(sk, f, 2 * R, axis=2), \
          jax.lax.dynamic_slice_in_dim(sv, f, 2 * R, axis=2)

    L = len(self.buf_k)
    ks, vs = (ks, vs) if ks is not None else ([None] * L, [None] * L)
    out = [layer(*a) for a in zip(self.k_codes, self.v_codes, self.buf_k, self.buf_v, ks, vs)]
    hk, hv, bk, bv = (tuple(x) for x in zip(*out))
    return self.replace(k_codes=hk, v_codes=hv, buf_k=bk, buf_v=bv,
                        quantized=self.quantized + f, buffered=m - f)


@dataclasses.dataclass
class QuantCacheView:
  """A `QuantKVCache` as the decoder reads (and the target writes) it in one forward:
  the quantised slots — dequantised, or by the Pallas kernel — then the full-precision
  buffer, then the tokens. A writer's rows are appended after the last layer."""

  cache: QuantKVCache
  positions: jax.Array  # [B, T]
  bits: int
  write: bool
  valid: jax.Array | None
  rows: list[tuple[jax.Array, jax.Array]] = dataclasses.field(default_factory=list)

  def layer(self, l: int) -> LayerView:
    c = self.cache
    B, F = self.positions.shape[0], 2 * c.residual
    rows = jnp.arange(F, dtype=jnp.int32)
    fp = Segment(c.buf_k[l], c.buf_v[l], jnp.broadcast_to(c.quantized + rows, (B, F)),
                 jnp.broadcast_to(rows < c.buffered, (B, F)), filled=c.buffered)
    if c.kernel or c.cpu_reads:  # read from the codes (see `QuantRead`)
      read = QuantRead(c.quantized, c.k_codes[l], c.v_codes[l], self.bits, c.group,
                       c.value_group, cpu=c.cpu_reads)
      return LayerView.reading((fp,), self.positions, read)
    S = c.size
    valid = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) < c.quantized, (B, S))
    deq = Segment.slots(c.keys(l, self.bits), c.values(l, self.bits), valid)
    return LayerView.reading((deq, fp), self.positions)

  def keep(self, l: int, layer: LayerView, run, x: jax.Array) -> None:
    if self.write:  # every layer ran: writers use the full plan
      # The rows follow the layer's output, so the layer reads its buffer before the
      # append writes it (in place; unordered, XLA copied every buffer and code plane).
      self.rows.append(tuple(after(x, list(layer.target))))

  def result(self) -> QuantKVCache:
    if not self.write:
      return self.cache
    ks, vs = (list(r) for r in zip(*self.rows))
    return self.cache.append(ks, vs, self.valid, settled=True)


def _scatter_rows(dst: Hier, src: Hier, start, count, group: int, *, keys: bool) -> Hier:
  """Write the first `count` token rows of `src` (codes of a stream) at slot `start` of
  `dst`; rows past `count` are dropped, not clamped into place. Key scales are per group
  of tokens (start and count are multiples of the group), value scales per token."""
  M = src.upper.shape[2]
  rows = jnp.arange(M)
  idx = jnp.where(rows < count, start + rows, dst.upper.shape[2])  # out of range: dropped
  put = lambda d, s, i: d.at[:, :, i].set(s, mode="drop")
  upper, lower = put(dst.upper, src.upper, idx), put(dst.lower, src.lower, idx)
  if keys:
    g = jnp.arange(M // group)
    gidx = jnp.where(g * group < count, start // group + g, dst.lo.shape[2])
    return Hier(upper, lower, put(dst.lo, src.lo, gidx), put(dst.scale, src.scale, gidx))
  return Hier(upper, lower, put(dst.lo, src.lo, idx), put(dst.scale, src.scale, idx))


@jax.jit(static_argnames=("bits",))
def dense_view(cache: QuantKVCache, bits: int) -> KVCache:
  """`QuantKVCache.dense`, as a jitted function for `jit_cache.compiled`."""
  pad = 2 * cache.residual

  def layer(deq, buf):
    full = jnp.pad(deq, ((0, 0), (0, 0), (0, pad), (0, 0))).astype(buf.dtype)
    keep = jnp.arange(full.shape[2])[None, None, :, None] < cache.quantized
    full = jnp.where(keep, full, 0)
    return jax.lax.dynamic_update_slice_in_dim(full, buf, cache.quantized, axis=2)

  L = len(cache.buf_k)
  k = tuple(layer(cache.keys(l, bits), cache.buf_k[l]) for l in range(L))
  v = tuple(layer(cache.values(l, bits), cache.buf_v[l]) for l in range(L))
  return KVCache(k=k, v=v, length=cache.length)
