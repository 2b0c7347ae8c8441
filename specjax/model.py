"""One decoder for llama / qwen2 / qwen3 / gemma3, driven by a `DraftPlan`.

Every sub-layer of a draft plan sits in `lax.cond`s on a scalar predicate from the plan,
so a skipped sub-layer is really not computed and a different plan value reuses the same
executable. Skip branches are `false_fun` and pass their operands through. A dense plan
(`DraftPlan.full`: the AR step, prefill, verification) traces no conditional at all: on a
GPU each one is a host round trip, and on any backend they fence fusion between layers.

There is one attention sub-layer and one residual rule, for every cache and for the
layer-selection probes: the cache gives each layer a view (`cache_view`) of the segments
it reads and of where the tokens' K/V go, so the decoder never asks what kind of cache it
holds. Every cache write is in place (checked on the compiled HLO by the tests).

Shapes: B batch, T tokens processed now, S cache slots, N query heads, K kv heads,
G = N / K query heads per kv head, H head dim, D model dim, F MLP width, V vocab.
"""

from __future__ import annotations

import contextlib
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import ops
from specjax.cache_view import LayerView, QuantRead, Segment, after
from specjax.config import ModelConfig, RopeScaling
from specjax.gguf_matrix import GGUFMatrix
from specjax.kv_cache import DraftBuffer, KVCache
from specjax.plan import DraftPlan, PlanError
from specjax.quant import DraftWeights, Int8Matrix, LayerWeights

_NEG_INF = -1e30  # a masked score: finite, so a fully masked row gives 0, not NaN


def _cond(run: jax.Array | bool | None, compute, skip, *operands):
  """`lax.cond(run, compute, skip, ...)`; plain `compute(...)` when `run` is None (the
  sub-layer always runs) and `skip(...)` when it is False (never): no conditional."""
  if run is None:
    return compute(*operands)
  if run is False:
    return skip(*operands)
  return jax.lax.cond(run, compute, skip, *operands)


def tree_sum(x: jax.Array) -> jax.Array:
  """Σ over the last axis (kept, of size 1) in a fixed order of elementwise adds: halves
  added while the width is even, then the few left in turn (a width past 16 left is first
  zero-padded to a power of two). The same bits for a row whatever rows come with it:
  XLA:CPU's reduce sums a row in an order that depends on the array's shape, and
  Qwen2.5's RMS norms (896 wide) gave a token other bits alone than among five, 6 times
  in 30."""
  n = x.shape[-1]
  odd = n // (n & -n) if n else 1
  if odd > 16:
    width = 1 << (n - 1).bit_length()
    x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (width - n,), x.dtype)], axis=-1)
  while x.shape[-1] > 1 and x.shape[-1] % 2 == 0:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  total = x[..., :1]
  for i in range(1, x.shape[-1]):
    total = total + x[..., i:i + 1]
  return total


class RMSNorm(nnx.Module):
  """RMS norm computed in float32. `scale` is the effective multiplier (gemma's 1 + w). The
  mean of squares is a `tree_sum`, so a token's norm does not depend on the tokens beside it
  (a verification's rows are the AR steps')."""

  def __init__(self, dim: int, eps: float, dtype: jnp.dtype = jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(tree_sum(x32 * x32) / x32.shape[-1] + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


@flax.struct.dataclass
class Rotation:
  """cos and sin of the tokens' rotary angles, [B, T, H/2] each, for one rope base.

  Computed once per forward and base, and read by every layer. Computed inside each
  layer's rotation, the cos and sin were fused into it and evaluated once per rotated
  element, each angle for every head and every layer (`python -m
  experiments.trace_step_ops` shows the op)."""

  cos: jax.Array
  sin: jax.Array


def rotation(positions: jax.Array, base: float, H: int,
             scaling: RopeScaling | None = None) -> Rotation:
  """The rotary angles of positions[B, T] for head dim H, materialised once; `scaling`
  stretches the frequencies as the checkpoint was trained to read them.

  The table goes through a sum (with zeros) because XLA fuses elementwise producers into
  every consumer, an expensive cos included, and an optimisation barrier is gone before
  fusion on XLA:CPU; a reduction is the producer it does not fuse. Adding zeros changes no
  value (`test_model.py` checks the compiled step holds one cos per rope base)."""
  inv_freq = 1.0 / (base ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))  # [H/2]
  if scaling is not None:  # computed in float64 on the host, a constant of the program
    unscaled = 1.0 / (base ** (np.arange(0, H, 2, dtype=np.float64) / H))
    inv_freq = jnp.asarray(scaling.apply(unscaled), jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  table = jnp.stack([jnp.cos(angles), jnp.sin(angles)])  # [2, B, T, H/2]
  table = jnp.stack([table, jnp.zeros_like(table)]).sum(0)
  return Rotation(table[0], table[1])


def rotate(x: jax.Array, rot: Rotation, interleaved: bool) -> jax.Array:
  """Rotary embedding of x[B, T, N, H] by the angles `rot` holds.

  `interleaved` rotates pairs (0,1), (2,3), ... (Meta / llama.cpp llama layout); otherwise
  halves (0, H/2), ... (NeoX / HF layout). The two give the same q.k on permuted weights.
  """
  H = x.shape[-1]
  cos, sin = rot.cos[:, :, None, :], rot.sin[:, :, None, :]
  x32 = x.astype(jnp.float32)
  if interleaved:
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
  else:
    x1, x2 = x32[..., : H // 2], x32[..., H // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, base: float, interleaved: bool,
               scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary embedding of x[B, T, N, H] at positions[B, T] (`rotate` by fresh angles)."""
  return rotate(x, rotation(positions, base, x.shape[-1], scaling), interleaved)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype) -> nnx.Param:
  return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * fan_in**-0.5)


class Attention(nnx.Module):
  def __init__(self, config: ModelConfig, layer: int, rngs: nnx.Rngs, dtype=jnp.float32):
    D, N, K, H = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
    # q, k and v heads in one matrix: one matmul instead of three (~17 % faster decode
    # on CPU, measured); split after the projection. Stored output-major and flat
    # ([(N + 2K)·H, D]), as gate_up is: the few-row CPU kernel streams whole rows, and a
    # prefill's dot reads it in place (a three-axis einsum over [N + 2K, H, D] had XLA:CPU
    # copy it to [D, N + 2K, H] first). Drawn [D, N + 2K, H] and transposed, so a tiny
    # model's random init is the one it had before.
    self.qkv = nnx.Param(_param(rngs, (D, (N + 2 * K) * H), D, dtype)[...].T)
    self.o = _param(rngs, (N, H, D), N * H, dtype)
    if config.qkv_bias:
      self.qkv_bias = _param(rngs, (N + 2 * K, H), 1, dtype)
    if config.qk_norm:
      self.q_norm = RMSNorm(H, config.norm_eps, dtype)
      self.k_norm = RMSNorm(H, config.norm_eps, dtype)
    self.config = config
    # How qkv's rows are laid out: `shards` blocks, each [q | k | v] of 1/shards of the
    # heads; 1 (q, then k, then v) unless placed on a mesh (`sharding.place`).
    self.shards = 1
    self.window = config.sliding_window if config.is_sliding(layer) else None
    self.rope_base = config.layer_rope_base(layer)
    self.rope_scaling = config.layer_rope_scaling(layer)

  def project(self, x: jax.Array, rot: Rotation, weights: LayerWeights | None = None
              ) -> tuple[jax.Array, ...]:
    """x[B, T, D] -> q[B, T, N, H], k[B, T, K, H], v[B, T, K, H] (normed and rotated by
    `rot`, the tokens' angles at this layer's base), with the layer's own projection or a
    draft's quantised one (`weights.qkv`)."""
    N, K, H = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
    if weights is not None and weights.qkv is not None:
      flat = weights.qkv.matmul(x)
    else:
      flat = _dense(x, self.qkv.get_value(), output_major=True)
    B, T = x.shape[:2]
    qkv = flat.reshape(B, T, N + 2 * K, H)
    if self.config.qkv_bias:
      qkv = qkv + self.qkv_bias[...]
    s = self.shards  # blocks of [q | k | v], each with n query and m kv heads
    qkv = qkv.reshape(B, T, s, (N + 2 * K) // s, H)
    n, m = N // s, K // s
    q = qkv[:, :, :, :n].reshape(B, T, N, H)
    k = qkv[:, :, :, n : n + m].reshape(B, T, K, H)
    v = qkv[:, :, :, n + m :].reshape(B, T, K, H)
    if self.config.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    interleaved = self.config.rope_interleaved
    return rotate(q, rot, interleaved), rotate(k, rot, interleaved), v

  def attend(self, q: jax.Array, positions: jax.Array, segments: list[Segment],
             kernel: QuantRead | None = None, weights: LayerWeights | None = None
             ) -> jax.Array:
    """Softmax of q[B, T, N, H] over the keys of every segment, each masked by validity,
    causality (key position <= query position) and the sliding window; returns [B, T, D].
    With `kernel`, also over a layer of a quantised cache, read by the Pallas kernel;
    `weights.o`, when set, replaces the output projection. A step's few float32 tokens on
    a CPU take the `f32_attention` kernel (`ops.f32_attention_takes`), a segment at a
    time, but a filled cache and the tokens' own K/V after it in one call: then a token's
    row has the same bits in an AR step and in a verification. A quantised cache's codes
    read by the C++ kernels (`kernel.cpu`) join those segments' partials."""
    B, T, N, H = q.shape
    on_cpu_kernels = all(ops.f32_attention_takes(q, seg.k) for seg in segments)
    if kernel is not None and not (kernel.cpu and on_cpu_kernels):
      return self._attend_kernel(q, positions, segments, kernel, weights)
    if on_cpu_kernels:
      # The tokens' own K/V (always last) go with the filled cache segment before them.
      own = (segments[-1] if len(segments) > 1 and segments[-1].own
             and segments[-2].filled is not None else None)
      read = segments[:-1] if own is not None else segments
      parts = [self._kernel_partial(q, positions, seg, own if seg is read[-1] else None)
               for seg in read]
      if kernel is not None:
        parts.append(self._codes_partial(q, positions, kernel))
      out = _merge(parts)
      return self._project_out(out.astype(q.dtype).reshape(B, T, N * H), weights)
    rows, row_pos = _to_rows(q, positions, segments[0].k.shape[1])  # [B, K, R, H], [B, R]
    out = _merge([self._prefix(rows, row_pos, seg) if _prefix_readable(seg) else
                  self._partial(rows, row_pos, seg.k, seg.v, seg.positions, seg.valid)
                  for seg in segments])
    return self._project_out(_from_rows(out.astype(q.dtype), T), weights)

  def _kernel_partial(self, q, positions, seg: Segment, own: Segment | None = None):
    """`_partial` of q[B, T, N, H] over `seg` (and `own`, the tokens' K/V, read as the slots
    after its filled part) by the `f32_attention` kernel, in the tokens' layout ([B, T, N]
    and [B, T, N, H]): it reads q and the cache as they are stored, and a segment with a
    `filled` bound only up to it."""
    bound = seg.k.shape[2] if seg.filled is None else seg.filled
    return ops.f32_attention(
        q, positions, seg.k, seg.v, seg.positions, seg.valid, bound, scale=self.config.scale,
        window=self.window, xla=self._partial_tokens,
        own=None if own is None else (own.k, own.v, own.positions, own.valid))

  def _codes_partial(self, q, positions, read: QuantRead):
    """`_partial` of q[B, T, N, H] over a quantised layer's slots [0, Q), from its codes by
    the C++ kernel (`ops.quant_partials_cpu`), in the tokens' layout, to merge with
    `_kernel_partial`s. Through XLA's dots the full-precision buffer beside the codes was
    first concatenated with the tokens' K/V, a copy every step."""
    T = q.shape[1]
    rows, row_pos = _to_rows(q, positions, read.k_codes.upper.shape[1])
    o, m, l = ops.quant_partials_cpu(rows, row_pos, read.quantized, read.k_codes,
                                     read.v_codes, bits=read.bits, scale=self.config.scale,
                                     window=self.window)
    return tuple(_rows_to_tokens(a, T) for a in (m, l, o))

  def _partial_tokens(self, q, q_pos, k, v, key_pos, valid):
    """`_partial` in the kernel's layout (its XLA form: under vmap and for tangents)."""
    T = q.shape[1]
    rows, row_pos = _to_rows(q, q_pos, k.shape[1])
    return tuple(_rows_to_tokens(a, T) for a in self._partial(rows, row_pos, k, v, key_pos,
                                                              valid))

  def _partial(self, rows, row_pos, k, v, key_pos, valid):
    """Unnormalised attention of rows[B, K, R, H] over keys k/v[B, K, S, H] at key_pos[B, S]:
    (row max m [B, K, R], sum of exp l [B, K, R], exp-weighted values [B, K, R, H]), all in
    float32, for merging with the other segments' partials (log-sum-exp)."""
    s = jnp.einsum("bkrh,bksh->bkrs", rows, k.astype(rows.dtype)) * self.config.scale
    ok = valid[:, None, :] & (key_pos[:, None, :] <= row_pos[:, :, None])  # [B, R, S]
    if self.window is not None:
      ok &= row_pos[:, :, None] - key_pos[:, None, :] < self.window
    s = jnp.where(ok[:, None], s.astype(jnp.float32), _NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.where(ok[:, None], jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum("bkrs,bksh->bkrh", p.astype(rows.dtype), v.astype(rows.dtype))
    return m, jnp.sum(p, axis=-1), acc.astype(jnp.float32)

  def _prefix(self, rows, row_pos, seg: Segment):
    """`_partial` over the filled prefix of a cache segment only, so a step costs the
    context, not the allocation: a `lax.switch` over static prefixes of S/8, S/4, S/2
    and S slots picks the shortest that holds `filled` (CPU only: on a GPU the switch is
    a host round trip)."""
    S = seg.k.shape[2]
    spans = [S >> i for i in range(SPAN_LEVELS - 1, -1, -1) if (S >> i) >= MIN_SPAN]
    # XLA:CPU copies the prefix a branch slices (never the whole layer: the tests check
    # the HLO), and still beats reading all S slots at every context measured. A
    # fori_loop over blocks up to `filled` copied every block and lost to the full read
    # past half the cache.

    def over(span):
      def run(rows, row_pos, k, v, pos, valid):
        return self._partial(rows, row_pos, k[:, :, :span], v[:, :, :span], pos[:, :span],
                             valid[:, :span])
      return run

    which = sum((seg.filled > span).astype(jnp.int32) for span in spans[:-1])
    return jax.lax.switch(which, [over(span) for span in spans], rows, row_pos, seg.k, seg.v,
                          seg.positions, seg.valid)

  def _project_out(self, out: jax.Array, weights: LayerWeights | None = None) -> jax.Array:
    """[B, T, N·H] -> [B, T, D]: one matmul against o viewed as [N·H, D] (a bitcast)."""
    if weights is not None and weights.o is not None:
      return weights.o.matmul(out)
    o = self.o.get_value()
    if isinstance(o, GGUFMatrix):  # the file's [D, N·H] rows of blocks
      return _dense(out, o)
    N, H, D = o.shape
    return _dense(out, o.reshape(N * H, D))

  def _attend_kernel(self, q, positions, segments, read: QuantRead,
                     weights: LayerWeights | None = None) -> jax.Array:
    """`attend` with the quantised slots read from their codes by
    `ops.quant_attention` (the Pallas kernel, or the C++ kernel on a CPU): the G = N/K
    query heads of a kv head and the T tokens are its Rq = G·T rows."""
    B, T, N, H = q.shape
    rows, row_pos = _to_rows(q, positions, segments[0].k.shape[1])
    fp_k = jnp.concatenate([s.k for s in segments], axis=2)
    fp_v = jnp.concatenate([s.v for s in segments], axis=2)
    fp_pos = jnp.concatenate([s.positions for s in segments], axis=1)
    fp_valid = jnp.concatenate([s.valid for s in segments], axis=1)
    out = ops.quant_attention(
        rows, row_pos, read.quantized, read.k_codes, read.v_codes, fp_k, fp_v, fp_pos,
        fp_valid, bits=read.bits, group=read.group, value_group=read.value_group,
        scale=self.config.scale, window=self.window, cpu=read.cpu)
    return self._project_out(_from_rows(out.astype(q.dtype), T), weights)


def _to_rows(q: jax.Array, positions: jax.Array, K: int) -> tuple[jax.Array, jax.Array]:
  """q[B, T, N, H] -> rows[B, K, R, H] with R = G·T (row g·T + t: head g of the kv group,
  token t) and their positions [B, R]. Each kv head then meets its R query rows in one
  matmul, the cache in its stored [B, K, S, H] layout: the per-token [B, T, K, G, H]
  einsum made XLA:CPU transpose every cache layer and the o weights on every step
  (5x slower attention, measured on SmolLM2)."""
  B, T, N, H = q.shape
  G = N // K
  rows = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
  row_pos = jnp.broadcast_to(positions[:, None, :], (B, G, T)).reshape(B, G * T)
  return rows, row_pos


def _rows_to_tokens(a: jax.Array, T: int) -> jax.Array:
  """[B, K, G·T, ...] (`_to_rows`' order) -> [B, T, N, ...], heads in q's order."""
  B, K, R, *rest = a.shape
  G = R // T
  return (a.reshape(B, K, G, T, *rest).transpose(0, 3, 1, 2, *range(4, a.ndim + 1))
          .reshape(B, T, K * G, *rest))


def _from_rows(out: jax.Array, T: int) -> jax.Array:
  """rows[B, K, G·T, H] -> [B, T, N·H], heads in the order of the o projection."""
  return _rows_to_tokens(out, T).reshape(out.shape[0], T, -1)


def _merge(parts: list[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
  """Softmax-weighted values over every segment from their partials (m, l, acc), in any
  layout with acc's last axis H: each part's sums rescaled to the overall max."""
  m = functools.reduce(jnp.maximum, [p[0] for p in parts])
  w = [jnp.exp(p[0] - m) for p in parts]
  total = sum(wi * p[1] for wi, p in zip(w, parts))
  return sum(wi[..., None] * p[2] for wi, p in zip(w, parts)) / total[..., None]


def _dense(x: jax.Array, w: jax.Array | GGUFMatrix, output_major: bool = False) -> jax.Array:
  """x @ w[I, O] (w[O, I] when `output_major`) by `ops.matmul`, which picks the kernel:
  on a CPU a decode step's few tokens stream the weights through the few-row kernel; a
  `GGUFMatrix` (`--dtype gguf`) reads its own blocks."""
  if isinstance(w, GGUFMatrix):
    return w.matmul(x).astype(x.dtype)
  return ops.matmul(x, w, output_major)


def _matmul(x: jax.Array, own: nnx.Param, quantised=None, output_major: bool = False
            ) -> jax.Array:
  """x @ a layer's matrix: its own parameter (stored [O, I] when `output_major`), or a
  draft's quantised copy of it."""
  return _dense(x, own.get_value(), output_major) if quantised is None else quantised.matmul(x)


class MLP(nnx.Module):
  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
    D, F = config.embed_dim, config.hidden_dim
    # [gate | up]: one matmul, stored output-major ([2F, D]): the few-row CPU kernel reads
    # it as two far-apart streams of whole rows, where [D, 2F] costs eight short row
    # segments at a time (faster at one row and at five: docs/decisions/cpu.md, C6).
    # Drawn [D, 2F] and transposed, so a tiny model's random init is the one it had before.
    self.gate_up = nnx.Param(_param(rngs, (D, 2 * F), D, dtype)[...].T)
    self.down = _param(rngs, (F, D), F, dtype)
    self.activation = config.activation
    self.shards = 1  # gate_up's rows: `shards` blocks of [gate | up] (`sharding.place`)

  def __call__(self, x: jax.Array, weights: LayerWeights | None = None) -> jax.Array:
    """The MLP with its own matrices, or a draft's quantised ones where `weights` has them."""
    w = weights or LayerWeights()
    both = _matmul(x, self.gate_up, w.gate_up, output_major=True)
    both = both.reshape(both.shape[:-1] + (self.shards, -1))
    gate, up = (half.reshape(both.shape[:-2] + (-1,)) for half in jnp.split(both, 2, axis=-1))
    if self.activation == "gelu_tanh":
      gate = jax.nn.gelu(gate, approximate=True)
    else:
      gate = jax.nn.silu(gate)
    return _matmul(gate * up, self.down, w.down)


class Block(nnx.Module):
  """Layer l: an attention sub-layer and an MLP sub-layer, each skippable on its own."""

  def __init__(self, config: ModelConfig, layer: int, rngs: nnx.Rngs, dtype=jnp.float32):
    D, eps = config.embed_dim, config.norm_eps
    self.attn_norm = RMSNorm(D, eps, dtype)
    self.attn = Attention(config, layer, rngs, dtype)
    self.mlp_norm = RMSNorm(D, eps, dtype)
    self.mlp = MLP(config, rngs, dtype)
    if config.post_norms:
      self.post_attn_norm = RMSNorm(D, eps, dtype)
      self.post_mlp_norm = RMSNorm(D, eps, dtype)
    self.post_norms = config.post_norms

  def _residual(self, x: jax.Array, out: jax.Array, post_norm: str) -> jax.Array:
    """The residual rule: x + out, with gemma3's post-norm on the sub-layer's output."""
    return x + (getattr(self, post_norm)(out) if self.post_norms else out)

  def attn_sublayer(self, run: jax.Array | bool | None, x: jax.Array, positions: jax.Array,
                    layer: LayerView, weights: LayerWeights | None = None,
                    rot: Rotation | None = None) -> tuple[jax.Array, LayerView]:
    """The attention sub-layer over one layer's cache view: project the tokens and write
    their K/V where the view keeps them, then attend over everything the view reads.
    `rot`: the tokens' rotary angles at this layer's base, if the caller holds them.

    A skipped sub-layer passes its operands through (`false_fun`; `run` None: no
    conditional). Where the tokens' K/V go into the cache itself (`layer.in_place`), each
    half is its own `lax.cond`: only the arrays the K/V go into cross the first, and the
    cache layers a step only reads enter the second as operands. Elsewhere (a draft's
    buffer, a forward that scores without writing) one conditional holds both halves, the
    cache entering it as an operand: one conditional where there were two, and no query to
    pass between them. A draft's quantised `weights` replace the projections."""
    B, T, _ = x.shape
    N, H = self.attn.config.num_heads, self.attn.config.head_dim
    if rot is None:
      rot = rotation(positions, self.attn.rope_base, H, self.attn.rope_scaling)

    def project(x, target):
      q, k, v = self.attn.project(self.attn_norm(x), rot, weights)
      return q, layer.write(target, k, v)

    def attend(x, q, layer):
      out = self.attn.attend(q, positions, layer.read, layer.kernel, weights)
      return self._residual(x, out, "post_attn_norm")

    if not layer.in_place:
      def sublayer(x, target):
        q, target = project(x, target)
        return attend(x, q, layer.with_target(target)), target

      x, target = _cond(run, sublayer, lambda x, target: (x, target), x, layer.target)
      return x, layer.with_target(target)

    def keep(x, target):
      return jnp.zeros((B, T, N, H), x.dtype), target

    q, target = _cond(run, project, keep, x, layer.target)
    layer = layer.with_target(target)
    return _cond(run, attend, lambda x, q, layer: x, x, q, layer), layer

  def mlp_sublayer(self, run: jax.Array | bool | None, x: jax.Array,
                   weights: LayerWeights | None = None) -> jax.Array:
    """The MLP sub-layer, with the layer's own weights or a draft's quantised ones."""
    def compute(x):
      return self._residual(x, self.mlp(self.mlp_norm(x), weights), "post_mlp_norm")

    return _cond(run, compute, lambda x: x, x)


MIN_SPAN = 256  # the shortest cache prefix attention reads
SPAN_LEVELS = 4  # prefixes of S/8, S/4, S/2 and S slots


def _prefix_readable(seg: Segment) -> bool:
  """Read only a filled prefix of `seg`: a cache segment of at least two minimal spans,
  on a CPU (where a `lax.switch` costs nothing extra)."""
  S = seg.k.shape[2]
  return (seg.filled is not None and S >= 2 * MIN_SPAN and S % (1 << SPAN_LEVELS) == 0
          and jax.default_backend() == "cpu")


@flax.struct.dataclass
class ForwardOut:
  logits: jax.Array | None  # [B, T, V] or [B, 1, V] (last position) or None
  hidden: jax.Array  # [B, T, D] residual stream after the last layer, before the final norm
  residuals: jax.Array | None  # [2L, B, T, D] residual after every sub-layer, on request


class Transformer(nnx.Module):
  """The target model; a draft is the same module run under a sparser `DraftPlan`."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
    V, D = config.vocab_size, config.embed_dim
    self.config = config
    self.embedding = _param(rngs, (V, D), D, dtype)  # unit-norm rows: layers matter
    self.blocks = nnx.List([Block(config, l, rngs, dtype) for l in range(config.num_layers)])
    self.final_norm = RMSNorm(D, config.norm_eps, dtype)
    if not config.tie_embeddings:
      self.lm_head = _param(rngs, (D, V), D, dtype)

  def embed(self, tokens: jax.Array) -> jax.Array:
    table = self.embedding.get_value()
    if isinstance(table, GGUFMatrix):  # only the tokens' rows are dequantised
      x = table.take_rows(tokens)
    else:
      x = jnp.take(table, tokens, axis=0)
    if self.config.activation_dtype is not None:
      x = x.astype(self.config.activation_dtype)
    if self.config.embed_scale:
      x = x * jnp.asarray(self.config.embed_dim**0.5, x.dtype)
    return x

  def head(self, hidden: jax.Array, weights: DraftWeights | None = None) -> jax.Array:
    """Final norm + LM head over the full vocabulary, in float32 (a draft's quantised
    head when `weights` has one)."""
    h = self.final_norm(hidden)
    if weights is not None and weights.head is not None:
      return weights.head.matmul(h.astype(jnp.float32))
    w = (self.embedding if self.config.tie_embeddings else self.lm_head).get_value()
    if isinstance(w, GGUFMatrix):  # stored output-major [V, D], tied or not
      return w.matmul(h.astype(jnp.float32))
    return ops.matmul(h, w, self.config.tie_embeddings, preferred=jnp.float32)

  def shortlist_rows(self, ids: jax.Array, weights: DraftWeights | None = None,
                     head_rows: jax.Array | None = None) -> jax.Array | Int8Matrix:
    """The LM head's rows for shortlist ids[K] (padding, -1, reads row 0): float[K, D], or
    the 8-bit head's K output channels when the draft reads quantised weights. An untied
    head [D, V] gives columns, slow to gather; `head_rows`, its [V, D] transpose
    (`untied_head_rows`), gives them as rows."""
    safe = jnp.maximum(ids, 0)
    if weights is not None and weights.head is not None:
      return weights.head.take_outputs(safe)
    own = (self.embedding if self.config.tie_embeddings else self.lm_head).get_value()
    if isinstance(own, GGUFMatrix):  # kept in blocks: the draft reads the file's bytes
      return own.take_outputs(safe)
    if self.config.tie_embeddings:
      return jnp.take(own, safe, axis=0)
    if head_rows is not None:
      return jnp.take(head_rows, safe, axis=0)
    return jnp.take(self.lm_head[...], safe, axis=1).T

  def untied_head_rows(self) -> jax.Array | None:
    """An untied LM head as rows [V, D] (a copy), for drafts that gather a new shortlist
    every step (DynaSpec); None for a tied head, whose rows are the embedding's."""
    if self.config.tie_embeddings:
      return None
    head = self.lm_head.get_value()
    return None if isinstance(head, GGUFMatrix) else head.T  # blocks are rows already

  def head_shortlist(self, hidden: jax.Array, ids: jax.Array,
                     weights: DraftWeights | None = None,
                     rows: jax.Array | Int8Matrix | None = None,
                     head_rows: jax.Array | None = None) -> jax.Array:
    """Logits over the shortlist ids[K] only: the matmul with its head rows (`rows`, as
    `shortlist_rows` gave them; gathered here when None, from `head_rows` when given).
    Padding ids (-1) get -inf. [B, T, D] -> [B, T, K]."""
    h = self.final_norm(hidden)
    rows = self.shortlist_rows(ids, weights, head_rows) if rows is None else rows
    if isinstance(rows, (Int8Matrix, GGUFMatrix)):
      logits = rows.matmul(h.astype(jnp.float32))
    else:
      logits = jnp.einsum("btd,kd->btk", h, rows, preferred_element_type=jnp.float32)
    return jnp.where(ids >= 0, logits, -jnp.inf)

  def routed_head(self, hidden: jax.Array, features: jax.Array, position: jax.Array,
                  plan: DraftPlan) -> tuple[jax.Array, jax.Array]:
    """DynaSpec's head at draft position `position`: the plan's router picks k(position)
    clusters from its input `features` (`RouterPlan.features`), and the head scores their
    tokens only from the final hidden state hidden[D], after the plan's static core
    (`plan.vocab`, its rows held in the plan) when it has one. Returns (ids, logits), both
    [K]: K is the core's size plus the widest position's shortlist, a narrower one padded
    with id -1 and logit -inf, which no choice takes. One `lax.switch` branch per distinct
    k, so each position gathers and scores only its own shortlist's head rows."""
    router = plan.router
    sizes = sorted(set(router.ks), reverse=True)
    branch_of = jnp.asarray([sizes.index(k) for k in router.ks], jnp.int32)
    widest = sizes[0] * router.table.shape[1]

    def branch(k):
      def run(hidden, features):
        ids = router.shortlist(features, k)
        logits = self.head_shortlist(hidden[None, None], ids, plan.weights,
                                     head_rows=router.head_rows)[0, 0]
        pad = widest - ids.shape[0]
        return (jnp.pad(ids, (0, pad), constant_values=-1),
                jnp.pad(logits, (0, pad), constant_values=-jnp.inf))
      return run

    b = branch_of[jnp.minimum(position, len(router.ks) - 1)]
    ids, logits = jax.lax.switch(b, [branch(k) for k in sizes], hidden, features)
    if plan.vocab is not None:  # the router's table leaves the core's ids out: no duplicates
      core = self.head_shortlist(hidden[None, None], plan.vocab, plan.weights,
                                 plan.head_rows)[0, 0]
      ids, logits = jnp.concatenate([plan.vocab, ids]), jnp.concatenate([core, logits])
    return ids, logits

  def _draft_weights(self, weights: DraftWeights | None) -> list[LayerWeights | None]:
    """Per layer, the draft's quantised matrices (None: its own), after checking that
    they were quantised from this model (shapes are static: checked at trace time)."""
    if weights is None:
      return [None] * len(self.blocks)
    for l, (block, lw) in enumerate(zip(self.blocks, weights.layers)):
      for name, own in (("qkv", block.attn.qkv), ("o", block.attn.o),
                        ("gate_up", block.mlp.gate_up), ("down", block.mlp.down)):
        mat = getattr(lw, name)
        if mat is not None and tuple(mat.shape) != _shape_of(own, name):
          raise PlanError(f"plan.weights layer {l} {name} is {list(mat.shape)}, this model's is "
                          f"{list(_shape_of(own, name))}: they were quantised from another model")
    V, D = self.config.vocab_size, self.config.embed_dim
    if weights.head is not None and tuple(weights.head.shape) != (D, V):
      raise PlanError(f"plan.weights head is {list(weights.head.shape)}, this model's is "
                      f"{[D, V]}: it was quantised from another model")
    return list(weights.layers)

  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      cache: KVCache,
      plan: DraftPlan,
      *,
      logits: str = "all",
      return_residuals: bool = False,
      write_cache: bool = True,
      buffer: DraftBuffer | None = None,
      valid: jax.Array | None = None,
  ) -> tuple[ForwardOut, KVCache | DraftBuffer]:
    """Process tokens[B, T] at positions[B, T], writing K/V at slots [length, length+T).

    `logits` is "all", "last" or "none" (static); with a shortlist in the plan they are
    over its K ids (`plan.vocab`), not the vocabulary. The returned cache has length + T.
    With `write_cache=False` the cache is only read and returned unchanged: candidate
    plans are scored against the verified cache without a copy of it. With a draft
    `buffer`, the cache is only read, the tokens' K/V go to the buffer (rows of skipped
    layers are kept), and the buffer is returned instead of the cache. `valid` (a padded
    prompt's real length) keeps a quantised cache from flushing padding into its codes.
    """
    plan.check(self.config.num_layers)  # shapes are static: this runs once, at trace time
    if plan.weights is not None and write_cache and buffer is None:
      raise PlanError("quantised weights are a draft's: a forward that writes the cache is "
                      "the target's and reads its own")
    layer_weights = self._draft_weights(plan.weights)
    writes = write_cache and buffer is None
    if writes:  # the cache is written only once the tokens are known (`QuantKVCache.settle`)
      (positions,) = after(tokens, [positions])
    view = cache.view(positions, write=writes, dense=plan.dense, bits=plan.kv_bits,
                      valid=valid, window=plan.kv_window, kept=plan.kv_keep)
    if buffer is not None:
      view = buffer.view(view, cache.length)
    x = self.embed(tokens)
    H = self.config.head_dim
    ropes = {(b.attn.rope_base, b.attn.rope_scaling) for b in self.blocks}
    rots = {(base, scaling): rotation(positions, base, H, scaling)  # one a rope (gemma3: 2)
            for base, scaling in sorted(ropes, key=str)}
    with float32_dots(x.dtype):
      residuals = []
      for l, block in enumerate(self.blocks):
        run = plan.runs("attn", l)
        x, layer = block.attn_sublayer(run, x, positions, view.layer(l), layer_weights[l],
                                       rots[(block.attn.rope_base, block.attn.rope_scaling)])
        view.keep(l, layer, run, x)
        if return_residuals:
          residuals.append(x)
        x = block.mlp_sublayer(plan.runs("mlp", l), x, layer_weights[l])
        if return_residuals:
          residuals.append(x)
      head = (functools.partial(self.head, weights=plan.weights) if plan.vocab is None else
              lambda h: self.head_shortlist(h, plan.vocab, plan.weights, plan.head_rows))
      if logits == "all":
        out_logits = head(x)
      elif logits == "last":
        out_logits = head(x[:, -1:])
      elif logits == "none":
        out_logits = None
      else:
        raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
      out = ForwardOut(
          logits=out_logits,
          hidden=x,
          residuals=jnp.stack(residuals) if return_residuals else None,
      )
      return out, view.result()


def float32_dots(dtype) -> contextlib.AbstractContextManager:
  """Full float32 arithmetic in the dots traced inside, where activations are float32.

  JAX's default lets an NVIDIA GPU compute a float32 dot in TF32 (inputs rounded to a
  10-bit mantissa): a verification forward's rows would then differ from the AR step's by
  far more than float32 rounding, and `--dtype mixed` would lose the token-exactness it
  is for (docs/GPU.md). A CPU computes float32 dots in float32 either way; bfloat16
  activations keep the default. It overrides a global `jax_default_matmul_precision`.
  """
  if jnp.dtype(dtype) != jnp.float32:
    return contextlib.nullcontext()
  return jax.default_matmul_precision("highest")


def _shape_of(own: nnx.Param, name: str) -> tuple[int, int]:
  """A parameter's shape as the [In, Out] matrix a draft's quantised copy holds."""
  if isinstance(own.get_value(), GGUFMatrix):
    return own.get_value().shape
  shape = own.shape
  if name in ("qkv", "gate_up"):  # stored output-major: [(N + 2K)·H, D], [2F, D]
    return shape[1], shape[0]
  return math.prod(shape[:-1]), shape[-1]


def init_model(config: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Transformer:
  """A random-init model (fast tests); norms are randomised too so they are exercised."""
  model = Transformer(config, nnx.Rngs(params=seed), dtype)
  key = jax.random.key(seed + 1)
  for path, var in nnx.iter_graph(model):
    if isinstance(var, RMSNorm):
      key, sub = jax.random.split(key)
      var.scale[...] = 1.0 + 0.1 * jax.random.normal(sub, var.scale.shape, dtype)
  return model


def apply(
    state: nnx.State,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    plan: DraftPlan,
    *,
    graphdef: nnx.GraphDef,
    logits: str = "all",
    return_residuals: bool = False,
    write_cache: bool = True,
    buffer: DraftBuffer | None = None,
    valid: jax.Array | None = None,
) -> tuple[ForwardOut, KVCache | DraftBuffer]:
  """The pure form of `Transformer.__call__`, for `jax.jit` on the hot path.

  `graphdef` (and `logits`, `return_residuals`) are static; params, cache, tokens,
  positions and plan are traced, so a new plan value reuses the executable.
  """
  model = nnx.merge(graphdef, state)
  return model(tokens, positions, cache, plan, logits=logits,
               return_residuals=return_residuals, write_cache=write_cache, buffer=buffer,
               valid=valid)
