"""Flash-decoding attention over QuantSpec's packed hierarchical KV cache (Pallas).

One kernel, parameterised by precision (4: upper nibbles only, the draft; 8: upper and
lower, the target), reads the packed codes and group scales of one layer and never
materialises a dequantised cache. The sequence is split across the grid (B, K, splits);
each program loops over blocks of its split and returns flash partials — running max m,
normaliser l and unnormalised output o — which `quant_attention` merges by log-sum-exp
with the full-precision part (the 2R buffer, the draft buffer, the new tokens). Only that
part needs a causal mask: every quantised token precedes every query.

GQA: the N/K query heads of a kv head and the T query tokens form the Rq = (N/K)·T rows
of one program, so each K/V block is dequantised once for all of them. Packing stores
channel j and j + H/2 in one byte (`specjax.quant.pack`), so the two nibble planes are
the two halves of the head dim: the kernel computes q·k as two half-width products and
needs no interleaving shuffles. Written for Pallas' Triton lowering, chosen explicitly
by its compiler params (jax now defaults GPU kernels to Mosaic GPU, which wants
warpgroup-sized copies this kernel's scalar and 16-row blocks are not): static
power-of-two tensors (the query rows are padded to one), 2-D dots, halves split at
ref-load time, masks instead of dynamic shapes. The tests lower it for CUDA on a CPU host,
which builds the Triton IR; on CPU it runs with interpret=True.

Shapes: B batch, K kv heads, S quantised slots, H head dim, G key group (tokens),
Gv value group (channels), Rq query rows per kv head, F full-precision keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(masked - m) == 0, no NaN


def _plane(codes, half: int):
  """One 4-bit plane of packed codes [rows, H/2]: 0 = channels [0, H/2), 1 = the rest."""
  return (codes & 0xF) if half == 0 else (codes >> 4)


def _dequant(upper, lower, lo, scale, half: int, bits: int):
  """Half `half` of the dequantised values [rows, H/2] from packed codes and the
  matching lo/scale [rows, H/2]."""
  x = lo + _plane(upper, half).astype(jnp.float32) * scale
  if bits == 8:
    x = x + (_plane(lower, half).astype(jnp.float32) - 7.0) * (scale / 15.0)
  return x


def _per_token(ref, rows, group: int, half: int, width: int):
  """Key lo/scale of groups of `group` tokens, [rows/group, H] in `ref`, for token rows
  `rows` and channel half `half`: [len(rows), H/2]."""
  n = rows.size // group
  cols = pl.ds(half * width, width)
  per_group = ref[pl.ds(rows.start // group, n), cols]
  return jnp.broadcast_to(per_group[:, None, :], (n, group, width)).reshape(n * group, width)


def _per_channel(ref, rows, group: int, half: int, width: int):
  """Value lo/scale of groups of `group` channels, [S, H/group] in `ref`, for token rows
  `rows` and channel half `half`: [len(rows), H/2]."""
  n = max(1, width // group)  # groups in one half (a group may span both halves)
  first = half * n if group <= width else 0
  per_group = ref[rows, pl.ds(first, n)]
  each = min(group, width)
  return jnp.broadcast_to(per_group[:, :, None], (rows.size, n, each)).reshape(
      rows.size, width)


def _kernel(length_ref, qpos_ref, q_ref, ku_ref, kl_ref, klo_ref, ksc_ref, vu_ref, vl_ref,
            vlo_ref, vsc_ref, o_ref, m_ref, l_ref, *, bits, block, group, value_group,
            scale, window):
  """One (batch, kv head, split) program. Values are split at ref-load time into the two
  channel halves the nibble planes hold (Triton lowers no value slicing)."""
  split = ku_ref.shape[0]
  rows, H = q_ref.shape
  half = H // 2
  s_idx = pl.program_id(2)
  length = length_ref[()]
  qs = [q_ref[:, pl.ds(h * half, half)].astype(jnp.float32) * scale for h in (0, 1)]
  qpos = qpos_ref[...]  # [Rq]

  def body(i, carry):
    o_a, o_b, m_prev, l_prev = carry
    sl = pl.ds(i * block, block)
    ku, kl, vu, vl = ku_ref[sl, :], kl_ref[sl, :], vu_ref[sl, :], vl_ref[sl, :]
    s = sum(
        jax.lax.dot_general(
            qs[h], _dequant(ku, kl, _per_token(klo_ref, sl, group, h, half),
                            _per_token(ksc_ref, sl, group, h, half), h, bits),
            (((1,), (1,)), ((), ())))
        for h in (0, 1))  # [Rq, block]
    pos = s_idx * split + i * block + jnp.arange(block)
    ok = (pos < length)[None, :]
    if window is not None:
      ok = ok & (qpos[:, None] - pos[None, :] < window)
    s = jnp.where(ok, s, _MASKED)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    p = jnp.where(ok, jnp.exp(s - m_next[:, None]), 0.0)
    corr = jnp.exp(m_prev - m_next)
    va, vb = (_dequant(vu, vl, _per_channel(vlo_ref, sl, value_group, h, half),
                       _per_channel(vsc_ref, sl, value_group, h, half), h, bits)
              for h in (0, 1))
    o_a = corr[:, None] * o_a + jnp.dot(p, va)
    o_b = corr[:, None] * o_b + jnp.dot(p, vb)
    return o_a, o_b, m_next, corr * l_prev + p.sum(axis=1)

  n_blocks = jnp.clip(pl.cdiv(length - s_idx * split, block), 0, split // block)
  init = (jnp.zeros((rows, half), jnp.float32), jnp.zeros((rows, half), jnp.float32),
          jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32))
  o_a, o_b, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
  o_ref[:, pl.ds(0, half)] = o_a
  o_ref[:, pl.ds(half, half)] = o_b
  m_ref[...] = m
  l_ref[...] = l


def padded_rows(rows: int) -> int:
  """Query rows per program, padded to a power of two of at least 16: Triton needs
  power-of-two tensors and 16-row dot operands (Qwen2.5-0.5B decodes with 7 rows)."""
  return max(16, 1 << (rows - 1).bit_length())


PROGRAMS = 512  # ~4 per SM on an H100 (132 SMs): enough to hide a program's load latency


def default_splits(batch: int, kv_heads: int, size: int, group: int) -> int:
  """Splits of the sequence that give the grid about `PROGRAMS` programs, each at least a
  key group long. A decode step has only B·K (batch × kv heads) programs otherwise — two
  for Qwen2.5-0.5B — and each would walk the whole cache alone. On an H100 this rule picks
  the fastest of the tilings `experiments/kernels_gpu.py` tried at every context from
  4k to 128k (32 splits at 4k, 256 from 32k on)."""
  return max(1, min(-(-PROGRAMS // (batch * kv_heads)), size // group))


def split_for(size: int, group: int, block: int, splits: int) -> tuple[int, int]:
  """(block, splits) that tile S: the block a multiple of G dividing S/splits."""
  splits = max(1, min(splits, size // group))
  while size % splits or (size // splits) % group:
    splits -= 1
  per = size // splits
  block = max(group, min(block, per) // group * group)
  while per % block:
    block -= group
  return block, splits


@functools.partial(jax.jit, static_argnames=("bits", "group", "value_group", "scale",
                                             "window", "block", "splits", "interpret"))
def quant_partials(q, q_pos, length, k_codes, v_codes, *, bits: int, group: int,
                   value_group: int, scale: float, window: int | None = None,
                   block: int = 256, splits: int | None = None, interpret: bool = False):
  """Flash partials over the quantised slots [0, length) of one layer.

  q [B, K, Rq, H], q_pos int32[B, Rq] (for a sliding window), length int32 scalar;
  k_codes / v_codes: `quant.Hier` of the layer. Returns o [B, K, splits, Rq, H] and
  m, l [B, K, splits, Rq]. `splits` None: `default_splits`."""
  B, K, rq, H = q.shape
  if not (value_group == H or (H // 2) % value_group == 0):
    raise ValueError(f"value group {value_group} must be the head dim {H} or divide its "
                     f"half {H // 2}: each nibble plane holds one half of the channels")
  Rq = padded_rows(rq)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, Rq - rq), (0, 0)))
  q_pos = jnp.pad(q_pos, ((0, 0), (0, Rq - rq)), mode="edge")
  S = k_codes.upper.shape[2]
  if splits is None:
    splits = default_splits(B, K, S, group)
  block, splits = split_for(S, group, block, splits)
  per = S // splits
  Hv = H // value_group
  kern = functools.partial(_kernel, bits=bits, block=block, group=group,
                           value_group=value_group, scale=scale, window=window)
  code_spec = pl.BlockSpec((None, None, per, H // 2), lambda b, k, s: (b, k, s, 0))
  kscale_spec = pl.BlockSpec((None, None, per // group, H), lambda b, k, s: (b, k, s, 0))
  vscale_spec = pl.BlockSpec((None, None, per, Hv), lambda b, k, s: (b, k, s, 0))
  o, m, l = pl.pallas_call(
      kern,
      grid=(B, K, splits),
      in_specs=[
          pl.BlockSpec((), lambda b, k, s: ()),
          pl.BlockSpec((None, Rq), lambda b, k, s: (b, 0)),
          pl.BlockSpec((None, None, Rq, H), lambda b, k, s: (b, k, 0, 0)),
          code_spec, code_spec, kscale_spec, kscale_spec,
          code_spec, code_spec, vscale_spec, vscale_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, Rq, H), lambda b, k, s: (b, k, s, 0, 0)),
          pl.BlockSpec((None, None, None, Rq), lambda b, k, s: (b, k, s, 0)),
          pl.BlockSpec((None, None, None, Rq), lambda b, k, s: (b, k, s, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((B, K, splits, Rq, H), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, splits, Rq), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, splits, Rq), jnp.float32)],
      interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
      name=f"quant_decode_attention_int{bits}",
  )(jnp.asarray(length, jnp.int32), q_pos.astype(jnp.int32), q, k_codes.upper,
    k_codes.lower, k_codes.lo, k_codes.scale, v_codes.upper, v_codes.lower, v_codes.lo,
    v_codes.scale)
  return o[..., :rq, :], m[..., :rq], l[..., :rq]


def dense_partials(q, q_pos, k, v, k_pos, k_valid, *, scale: float,
                   window: int | None = None):
  """Flash partials (o, m, l) of the full-precision part: q [B, K, Rq, H] against
  k, v [B, K, F, H] with key positions / validity [B, F]; causal (key pos ≤ query pos)
  and the sliding window masked here."""
  s = jnp.einsum("bkrh,bkfh->bkrf", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  ok = k_valid[:, None, None, :] & (k_pos[:, None, None, :] <= q_pos[:, None, :, None])
  if window is not None:
    ok &= q_pos[:, None, :, None] - k_pos[:, None, None, :] < window
  p, m = masked_softmax_terms(s, ok)
  return jnp.einsum("bkrf,bkfh->bkrh", p, v.astype(jnp.float32)), m, p.sum(-1)


def masked_softmax_terms(s, ok):
  """Scores s [B, K, Rq, F] under mask ok (broadcast to s): the unnormalised weights
  exp(s − m), 0 where masked, and the row maxima m [B, K, Rq]."""
  s = jnp.where(ok, s, _MASKED)
  m = s.max(-1)
  return jnp.where(ok, jnp.exp(s - m[..., None]), 0.0), m


def merge_splits(o, m, l) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The kernel's per-split partials o [B, K, splits, Rq, H], m, l [B, K, splits, Rq]
  folded into one partial. One reduction over the split axis: unrolling the splits into
  `merge` costs a chain of small ops per split (hundreds at long context on a GPU)."""
  top = m.max(axis=2)
  w = jnp.exp(m - top[:, :, None])  # an empty split (m masked, l = 0) weighs nothing
  return (o * w[..., None]).sum(axis=2), top, (l * w).sum(axis=2)


def merge(parts: list[tuple]) -> jax.Array:
  """Log-sum-exp merge of flash partials [(o [..., Rq, H], m [..., Rq], l [..., Rq])]
  into the attention output [..., Rq, H]."""
  m = functools.reduce(jnp.maximum, [p[1] for p in parts])
  num = sum(p[0] * jnp.exp(p[1] - m)[..., None] for p in parts)
  den = sum(p[2] * jnp.exp(p[1] - m) for p in parts)
  return num / den[..., None]


def quant_attention(q, q_pos, length, k_codes, v_codes, fp_k, fp_v, fp_pos, fp_valid, *,
                    bits: int, group: int, value_group: int, scale: float,
                    window: int | None = None, use_kernel: bool = True,
                    interpret: bool = False, block: int = 256, splits: int | None = None):
  """Attention of q [B, K, Rq, H] over the quantised slots [0, length) and the
  full-precision keys fp_k/fp_v [B, K, F, H]: [B, K, Rq, H]. `use_kernel=False` computes
  the quantised part with `reference_partials` instead (the jnp path). Which path a model
  takes is `specjax.ops.quant_attention`'s choice."""
  kw = dict(bits=bits, group=group, value_group=value_group, scale=scale, window=window)
  if use_kernel:
    partials = quant_partials(q, q_pos, length, k_codes, v_codes, block=block, splits=splits,
                              interpret=interpret, **kw)
  else:
    partials = reference_partials(q, q_pos, length, k_codes, v_codes, **kw)
  return merge([merge_splits(*partials), dense_partials(q, q_pos, fp_k, fp_v, fp_pos,
                                                        fp_valid, scale=scale, window=window)])


def _unpacked(codes):
  """Packed codes [..., H/2] -> float32 codes [..., H]: the low nibbles are channels
  [0, H/2), the high ones the rest."""
  return jnp.concatenate([codes & 0xF, codes >> 4], axis=-1).astype(jnp.float32)


def _values(h, bits: int, axis: int, group: int):
  """The floats a cache layer's codes stand for, [B, K, S, H], written out in full: the
  statistics repeated over their groups (`axis` 2: groups of slots, the keys; 3: groups
  of channels, the values), then lo + upper·scale (+ (lower − 7)·scale/15 at 8 bits). The
  kernel's independent check: it shares no code with `specjax.quant`, which owns the
  format."""
  lo, scale = (jnp.repeat(a, group, axis=axis) for a in (h.lo, h.scale))
  x = lo + _unpacked(h.upper) * scale
  if bits == 8:
    x = x + (_unpacked(h.lower) - 7.0) * (scale / 15.0)
  return x


def reference_partials(q, q_pos, length, k_codes, v_codes, *, bits, group, value_group,
                       scale, window=None):
  """The kernel's result in plain jnp, as one split: dequantise, mask, softmax partials.
  (The causal mask `dense_partials` applies is vacuous here: every quantised token
  precedes every query.)"""
  k = _values(k_codes, bits, 2, group)
  v = _values(v_codes, bits, 3, value_group)
  B, S = q.shape[0], k.shape[2]
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  o, m, l = dense_partials(q, q_pos, k, v, pos, pos < length, scale=scale, window=window)
  return o[:, :, None], m[:, :, None], l[:, :, None]
