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
needs no interleaving shuffles. Written for the Triton / Mosaic GPU lowering (static
shapes, 2-D dots, masks instead of dynamic shapes); on CPU it runs with interpret=True.

Shapes: B batch, K kv heads, S quantised slots, H head dim, G key group (tokens),
Gv value group (channels), Rq query rows per kv head, F full-precision keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(masked - m) == 0, no NaN


def _dequant_halves(codes, lower, lo, scale, bits: int):
  """Packed codes [rows, H/2] + per-row lo/scale [rows, H] -> the two halves [rows, H/2]
  of the dequantised values."""
  half = codes.shape[-1]
  out = []
  for plane, sl in ((codes & 0xF, slice(0, half)), (codes >> 4, slice(half, 2 * half))):
    lo_h, sc_h = lo[:, sl], scale[:, sl]
    x = lo_h + plane.astype(jnp.float32) * sc_h
    if bits == 8:
      low = (lower & 0xF) if sl.start == 0 else (lower >> 4)
      x = x + (low.astype(jnp.float32) - 7.0) * (sc_h / 15.0)
    out.append(x)
  return out


def _rows(per_group, group: int, axis: int):
  """Expand per-group scales to per-row (axis 0, keys) or per-channel (axis 1, values)."""
  a, b = per_group.shape
  if axis == 0:
    return jnp.broadcast_to(per_group[:, None, :], (a, group, b)).reshape(a * group, b)
  return jnp.broadcast_to(per_group[:, :, None], (a, b, group)).reshape(a, b * group)


def _kernel(length_ref, qpos_ref, q_ref, ku_ref, kl_ref, klo_ref, ksc_ref, vu_ref, vl_ref,
            vlo_ref, vsc_ref, o_ref, m_ref, l_ref, *, bits, block, group, value_group,
            scale, window):
  split = ku_ref.shape[0]
  rows, H = q_ref.shape
  half = H // 2
  s_idx = pl.program_id(2)
  length = length_ref[()]
  q = q_ref[...].astype(jnp.float32) * scale
  qa, qb = q[:, :half], q[:, half:]
  qpos = qpos_ref[...]  # [Rq]

  def body(i, carry):
    o_a, o_b, m_prev, l_prev = carry
    start = i * block
    sl, gsl = pl.ds(start, block), pl.ds(start // group, block // group)
    ka, kb = _dequant_halves(ku_ref[sl, :], kl_ref[sl, :], _rows(klo_ref[gsl, :], group, 0),
                             _rows(ksc_ref[gsl, :], group, 0), bits)
    s = (jax.lax.dot_general(qa, ka, (((1,), (1,)), ((), ())))
         + jax.lax.dot_general(qb, kb, (((1,), (1,)), ((), ()))))  # [Rq, block]
    pos = s_idx * split + start + jnp.arange(block)
    ok = (pos < length)[None, :]
    if window is not None:
      ok = ok & (qpos[:, None] - pos[None, :] < window)
    s = jnp.where(ok, s, _MASKED)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    p = jnp.where(ok, jnp.exp(s - m_next[:, None]), 0.0)
    corr = jnp.exp(m_prev - m_next)
    va, vb = _dequant_halves(vu_ref[sl, :], vl_ref[sl, :],
                             _rows(vlo_ref[sl, :], value_group, 1),
                             _rows(vsc_ref[sl, :], value_group, 1), bits)
    o_a = corr[:, None] * o_a + jnp.dot(p, va)
    o_b = corr[:, None] * o_b + jnp.dot(p, vb)
    return o_a, o_b, m_next, corr * l_prev + p.sum(axis=1)

  n_blocks = jnp.clip(pl.cdiv(length - s_idx * split, block), 0, split // block)
  init = (jnp.zeros((rows, half), jnp.float32), jnp.zeros((rows, half), jnp.float32),
          jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32))
  o_a, o_b, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
  o_ref[:, :half] = o_a
  o_ref[:, half:] = o_b
  m_ref[...] = m
  l_ref[...] = l


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
                   block: int = 256, splits: int = 8, interpret: bool = False):
  """Flash partials over the quantised slots [0, length) of one layer.

  q [B, K, Rq, H], q_pos int32[B, Rq] (for a sliding window), length int32 scalar;
  k_codes / v_codes: `quant.Hier` of the layer. Returns o [B, K, splits, Rq, H] and
  m, l [B, K, splits, Rq]."""
  B, K, Rq, H = q.shape
  S = k_codes.upper.shape[2]
  block, splits = split_for(S, group, block, splits)
  per = S // splits
  Hv = H // value_group
  kern = functools.partial(_kernel, bits=bits, block=block, group=group,
                           value_group=value_group, scale=scale, window=window)
  code_spec = pl.BlockSpec((None, None, per, H // 2), lambda b, k, s: (b, k, s, 0))
  kscale_spec = pl.BlockSpec((None, None, per // group, H), lambda b, k, s: (b, k, s, 0))
  vscale_spec = pl.BlockSpec((None, None, per, Hv), lambda b, k, s: (b, k, s, 0))
  return pl.pallas_call(
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
      name=f"quant_decode_attention_int{bits}",
  )(jnp.asarray(length, jnp.int32), q_pos.astype(jnp.int32), q, k_codes.upper,
    k_codes.lower, k_codes.lo, k_codes.scale, v_codes.upper, v_codes.lower, v_codes.lo,
    v_codes.scale)


def dense_partials(q, q_pos, k, v, k_pos, k_valid, *, scale: float,
                   window: int | None = None):
  """Flash partials (o, m, l) of the full-precision part: q [B, K, Rq, H] against
  k, v [B, K, F, H] with key positions / validity [B, F]; causal (key pos ≤ query pos)
  and the sliding window masked here."""
  s = jnp.einsum("bkrh,bkfh->bkrf", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  ok = k_valid[:, None, None, :] & (k_pos[:, None, None, :] <= q_pos[:, None, :, None])
  if window is not None:
    ok &= q_pos[:, None, :, None] - k_pos[:, None, None, :] < window
  s = jnp.where(ok, s, _MASKED)
  m = s.max(-1)
  p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
  return jnp.einsum("bkrf,bkfh->bkrh", p, v.astype(jnp.float32)), m, p.sum(-1)


def merge(parts: list[tuple]) -> jax.Array:
  """Log-sum-exp merge of flash partials [(o [..., Rq, H], m [..., Rq], l [..., Rq])],
  each possibly with a leading split axis at -3 / -2 (already flattened by the caller)."""
  m = functools.reduce(jnp.maximum, [p[1] for p in parts])
  num = sum(p[0] * jnp.exp(p[1] - m)[..., None] for p in parts)
  den = sum(p[2] * jnp.exp(p[1] - m) for p in parts)
  return num / den[..., None]


def quant_attention(q, q_pos, length, k_codes, v_codes, fp_k, fp_v, fp_pos, fp_valid, *,
                    bits: int, group: int, value_group: int, scale: float,
                    window: int | None = None, use_kernel: bool = True,
                    interpret: bool = False, block: int = 256, splits: int = 8):
  """Attention of q [B, K, Rq, H] over the quantised slots [0, length) and the
  full-precision keys fp_k/fp_v [B, K, F, H]: [B, K, Rq, H]. `use_kernel=False` computes
  the quantised part with `reference_partials` instead (the jnp path)."""
  kw = dict(bits=bits, group=group, value_group=value_group, scale=scale, window=window)
  if use_kernel:
    o, m, l = quant_partials(q, q_pos, length, k_codes, v_codes, block=block, splits=splits,
                             interpret=interpret, **kw)
  else:
    o, m, l = reference_partials(q, q_pos, length, k_codes, v_codes, **kw)
  quantised = [(o[:, :, s], m[:, :, s], l[:, :, s]) for s in range(o.shape[2])]
  return merge(quantised + [dense_partials(q, q_pos, fp_k, fp_v, fp_pos, fp_valid,
                                           scale=scale, window=window)])


def reference_partials(q, q_pos, length, k_codes, v_codes, *, bits, group, value_group,
                       scale, window=None):
  """The kernel's result in plain jnp, as one split: dequantise, mask, softmax partials.
  (The causal mask `dense_partials` applies is vacuous here: every quantised token
  precedes every query.)"""
  from specjax import quant

  k = quant.dequantize(k_codes, axis=2, group=group, bits=bits)
  v = quant.dequantize(v_codes, axis=3, group=value_group, bits=bits)
  B, S = q.shape[0], k.shape[2]
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  o, m, l = dense_partials(q, q_pos, k, v, pos, pos < length, scale=scale, window=window)
  return o[:, :, None], m[:, :, None], l[:, :, None]
