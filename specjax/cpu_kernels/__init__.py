"""C++ kernels that XLA:CPU lacks, compiled on first use and called through `jax.ffi`.

Each exists because XLA:CPU's own lowering made a draft or a verification cost more than
the method assumes; why each is as it is: docs/decisions/cpu.md; what each saves, per
model and CPU: docs/results/cpu-kernels.md and docs/results/step-costs.md (`python -m
experiments.bench_cpu_kernels` and `python -m experiments.bench_forward` measure it).

* `int8_matmul`: against int8 weights, one scale per output channel (8-bit drafts).
  XLA:CPU widens an int8 matrix to float32 in memory before its dot, so an 8-bit draft
  read more bytes than the full model; the kernel reads the codes.
* `int4_matmul`: against QuantSpec's 4-bit weights (`quant.Int4Matrix`, a minimum and a
  scale per group of input rows), multiplying the codes as integers with x on a grid of
  int16 levels per group (`quant.activation_grid`, which every other path applies too).
* `f32_matmul`: float32 for one to a few rows (a step, or a verification of γ + 1
  tokens), reading each weight once for all of them. XLA:CPU's GEMM for M ≥ 2 streams
  weights more slowly than its GEMV for M = 1, which made verification dear.
* `quant_attention`: scores and the weighted sum of values read from a quantised KV
  cache layer's 4+4-bit codes (`quant_kv_cache`), where XLA:CPU wrote and read a
  dequantised float32 copy of every layer each step.
* `f32_attention`: a step's or a verification's attention over a float32 cache segment,
  up to its filled slots, in place of two dots, a softmax fusion and the gathers of a kv
  head's query rows.
* `f32_argmax`: the greedy choice per row and its top softmax probability (a draft's
  confidence) in one pass, where XLA:CPU ran four threaded reductions
  (`sampling.argmax`, `sampling.argmax_and_top_probability`).
* `gguf_matmul`: against a GGUF file's own blocks (`gguf_matrix.GGUFMatrix`, `--dtype
  gguf`), each block dequantised in registers to the floats gguf-py gives, bit for bit,
  and met there by every row of the call: the target reads the file's 0.56-1.06 bytes a
  weight instead of float32's 4.
* `q4_0_int8_matmul`: a draft's matmul against Q4_0 blocks (`4bit`) with x quantised to 8
  bits per 32 inputs and each block's products summed as integers (AVX-512 VNNI), where
  `gguf_matmul` computes every weight's float (a draft's numbers need only be close).

How a source is built, and whether a kernel can run here: `build`. Which implementation
an op takes (this kernel, a Pallas kernel or XLA's ops) is decided in one place,
`specjax.ops`; the functions here only call their kernel, and fail with the reason where
it cannot run. No module here imports the models or the weight formats: a caller that
owns a format passes its XLA reference where a vmap may need it (`_by_rows`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cpu_kernels.build import (
  COMPILE_FLAGS,
  KernelBuildError,
  compile_flags,
  kernel_status,
  library,
  require,
  runs_here,
  unavailable,
)

# The most rows the few-row kernels take: verification forwards (γ ≤ 8, so T ≤ 9) and a
# little more; past this XLA's GEMM has the reuse it needs.
FEW_ROWS = 16


def int8_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array) -> jax.Array:
  """x[..., I] times the int8 matrix codes[O, I] scaled per output: [..., O] in float32."""
  require("int8_matmul")
  return _by_rows(_int8_kernel, int8_xla)(x.astype(jnp.float32), codes,
                                         scale.astype(jnp.float32))


def _int8_kernel(x, codes, scale):
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (codes.shape[0],), jnp.float32)
  return jax.ffi.ffi_call("specjax_int8_matmul", out)(x, codes, scale)


def int8_xla(x, codes, scale):
  """The same product in XLA's ops (any backend; what `_by_rows` hands a large batch)."""
  y = jnp.einsum("...i,oi->...o", x, codes.astype(x.dtype), preferred_element_type=jnp.float32)
  return y * scale


def int4_matmul(x: jax.Array, codes: jax.Array, lo: jax.Array, scale: jax.Array, *,
                reference=None) -> jax.Array:
  """x[..., I] times a 4-bit matrix stored output-major (`quant.Int4Matrix`): codes
  uint8[O, I/2], lo and scale float32[O, I/G] -> [..., O] in float32. Only where
  `runs_here("int4_matmul")`; `Int4Matrix.matmul` takes XLA's dot elsewhere.
  `reference(x, codes, lo, scale)`: the same product in XLA's ops, which a vmap past
  FEW_ROWS rows takes; the format's math belongs to its owner (`quant`), so the caller
  brings it. Without one every batch folds into the kernel's rows."""
  require("int4_matmul")
  return _by_rows(_int4_kernel, reference)(x.astype(jnp.float32), codes,
                                           lo.astype(jnp.float32), scale.astype(jnp.float32))


def _int4_kernel(x, codes, lo, scale):
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (codes.shape[0],), jnp.float32)
  return jax.ffi.ffi_call("specjax_int4_matmul", out)(x, codes, lo, scale)


def _by_rows(kernel, xla):
  """`kernel(x, *weights)` (x[..., I]: any leading dims are rows) with its own vmap rule. A
  vmap over x folds its batch into the rows of one call, which reads the weights once,
  while at most FEW_ROWS rows result (the layer probes' tokens and candidates); past that,
  or with a weight batched, `xla` (the same product in XLA's ops; None: always fold)
  takes the batch. Folded
  without a bound (the kernels' default `vmap_method`s), 40 000 vmapped sampling rounds
  made calls of 40 000 rows, 3x slower than XLA's dot, or 40 000 calls in a loop."""

  @jax.custom_batching.custom_vmap
  def call(x, *weights):
    return kernel(x, *weights)

  @call.def_vmap
  def _batched(axis_size, in_batched, x, *weights):
    if not in_batched[0]:
      x = jnp.broadcast_to(x, (axis_size, *x.shape))
    if xla is None and any(in_batched[1:]):
      raise ValueError("a batch of weight matrices needs the product's XLA reference")
    if xla is not None and (any(in_batched[1:]) or x.size // x.shape[-1] > FEW_ROWS):
      axes = (0, *(0 if b else None for b in in_batched[1:]))
      return jax.vmap(xla, in_axes=axes)(x, *weights), True
    return call(x, *weights), True

  return call


def gguf_matmul(x: jax.Array, blocks: jax.Array, kind: int) -> jax.Array:
  """x[..., I] times a GGUF matrix of ggml type `kind` stored as its file's rows of blocks,
  blocks uint8[O, bytes per row] (`gguf_matrix.GGUFMatrix`) -> [..., O] in float32, the
  weights dequantised in registers exactly as gguf-py does. Only where
  `runs_here("gguf_matmul")`."""
  require("gguf_matmul")
  kernel = functools.partial(_gguf_kernel, kind)
  xla = lambda x, blocks: jnp.einsum("...i,oi->...o", x, gguf_dequantize(blocks, kind))
  return _by_rows(kernel, xla)(x.astype(jnp.float32), blocks)


def _gguf_kernel(kind, x, blocks):
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (blocks.shape[0],), jnp.float32)
  return jax.ffi.ffi_call("specjax_gguf_matmul", out)(x, blocks, kind=np.int64(kind))


def gguf_dequantize(blocks: jax.Array, kind: int) -> jax.Array:
  """GGUF rows of blocks uint8[..., O, bytes per row] of ggml type `kind` -> float32
  [..., O, I], bit for bit what `gguf.quants.dequantize` gives."""
  require("gguf_matmul")
  from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

  weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
  out = jax.ShapeDtypeStruct(blocks.shape[:-1] + (blocks.shape[-1] // nbytes * weights,),
                             jnp.float32)
  rows = blocks.reshape(-1, blocks.shape[-1])
  flat = jax.ffi.ffi_call("specjax_gguf_dequantize",
                          jax.ShapeDtypeStruct((rows.shape[0], out.shape[-1]), jnp.float32),
                          vmap_method="broadcast_all")(rows, kind=np.int64(kind))
  return flat.reshape(out.shape)


def q4_0_int8_matmul(x: jax.Array, blocks: jax.Array) -> jax.Array:
  """x[..., I] times a matrix of Q4_0 blocks uint8[O, I / 32 · 18] -> [..., O] in float32,
  with x quantised to 8 bits per block of 32 inputs (ggml's Q8_0) and each block's products
  summed as integers: close to `gguf_matmul`'s product, not equal to it, so for drafts
  only. A row's result depends on that row alone. Only where `runs_here("q4_0_int8_matmul")`;
  fast where `q4_0_int8_fast()`."""
  require("q4_0_int8_matmul")
  return _by_rows(_q4_0_int8_kernel, q4_0_int8_xla)(x.astype(jnp.float32), blocks)


def _q4_0_int8_kernel(x, blocks):
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (blocks.shape[0],), jnp.float32)
  return jax.ffi.ffi_call("specjax_q4_0_int8_matmul", out)(x, blocks)


def q4_0_int8_xla(x, blocks):
  """The kernel's product in XLA's ops (a prompt's rows, a vmap's batch past FEW_ROWS): x
  on its 8-bit grid per block, times the dequantised weights."""
  from gguf.constants import GGMLQuantizationType

  I = x.shape[-1]
  xb = x.reshape(*x.shape[:-1], I // 32, 32)
  d = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / 127.0
  inv = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0)
  grid = (jnp.clip(jnp.rint(xb * inv), -128, 127) * d).reshape(x.shape)
  return jnp.einsum("...i,oi->...o", grid, gguf_dequantize(blocks, GGMLQuantizationType.Q4_0))


@functools.cache
def q4_0_int8_fast() -> bool:
  """Whether `q4_0_int8_matmul` runs here with its AVX-512 VNNI loop. Elsewhere it takes a
  scalar loop (the same integers, slower than `gguf_matmul`'s float path), so drafts keep
  float inputs there."""
  if unavailable("q4_0_int8_matmul"):
    return False
  return bool(library("q4_0_int8_matmul").Q4_0Int8Fast())


def quant_partials(q: jax.Array, q_pos: jax.Array, length: jax.Array, k_codes, v_codes, *,
                   bits: int, scale: float, window: int | None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Unnormalised attention of q[B, K, R, H] at q_pos[B, R] over slots [0, length) of a
  quantised cache layer (`quant.Hier` codes [B, K, S, H/2]; keys grouped over slots,
  values over channels), read at `bits` (4: the upper nibbles): the exp-weighted values
  o [B, K, R, H], the row maxima m and the sums of exp l [B, K, R], for a log-sum-exp
  merge. Slot t sits at position t, before every row (no causal mask: the quantised tokens
  precede a step's); a row sees it within `window` of its position.

  One call does the scores, the softmax and the value sums, over the filled slots only:
  with the softmax between two kernels in XLA, a verification wrote and reread a
  [B, K, R, S] score array over every allocated slot, filled or not.
  A vmap over q (and q_pos) alone, the sampling tests' rounds over one cache layer,
  becomes more rows of one call, which reads the layer's codes once; with the length or
  the codes batched too, one call per element (jax's `sequential`)."""
  require("quant_attention")
  codes = (k_codes.upper, k_codes.lower, k_codes.lo.astype(jnp.float32),
           k_codes.scale.astype(jnp.float32), v_codes.upper, v_codes.lower,
           v_codes.lo.astype(jnp.float32), v_codes.scale.astype(jnp.float32))
  attrs = dict(bits=np.int64(bits), scale=np.float32(scale), window=np.int64(window or 0))

  def kernel(q, q_pos, length, *codes, vmap_method=None):
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32),) + (
        jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32),) * 2
    return jax.ffi.ffi_call("specjax_quant_partials", out, vmap_method=vmap_method)(
        q, q_pos, length, *codes, **attrs)

  @jax.custom_batching.custom_vmap
  def call(q, q_pos, length, *codes):
    return kernel(q, q_pos, length, *codes)

  @call.def_vmap
  def _batched(axis_size, in_batched, q, q_pos, length, *codes):
    if any(in_batched[2:]):
      axes = tuple(0 if b else None for b in in_batched)
      one = functools.partial(kernel, vmap_method="sequential")
      return jax.vmap(one, in_axes=axes)(q, q_pos, length, *codes), (True,) * 3
    A, (B, K, R, H) = axis_size, q.shape[-4:]
    q = jnp.broadcast_to(q, (A, B, K, R, H)).transpose(1, 2, 0, 3, 4).reshape(B, K, A * R, H)
    q_pos = jnp.broadcast_to(q_pos, (A, B, R)).transpose(1, 0, 2).reshape(B, A * R)
    o, m, l = call(q, q_pos, length, *codes)
    unfold = lambda a: jnp.moveaxis(a.reshape(B, K, A, R, *a.shape[3:]), 2, 0)
    return (unfold(o), unfold(m), unfold(l)), (True,) * 3

  return call(q.astype(jnp.float32), q_pos.astype(jnp.int32), jnp.asarray(length, jnp.int32),
              *codes)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def f32_matmul(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
  """x[..., I] @ w[I, O] (w[O, I] when `transposed`: a tied embedding) -> [..., O], by the
  few-row kernel (`ops.matmul` says when). Differentiable: the tangents take XLA's dots."""
  require("f32_matmul")
  if transposed:
    return _by_rows(functools.partial(_f32_kernel, "oi"), _f32_oi_xla)(x, w)
  return _by_rows(functools.partial(_f32_kernel, "io"), _f32_io_xla)(x, w)


def _f32_kernel(layout: str, x, w):
  O = w.shape[0] if layout == "oi" else w.shape[1]
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (O,), jnp.float32)
  return jax.ffi.ffi_call(f"specjax_f32_matmul_{layout}", out)(x, w)


def _f32_io_xla(x, w):
  return jnp.einsum("...i,io->...o", x, w)


def _f32_oi_xla(x, w):
  return jnp.einsum("...i,oi->...o", x, w)


@f32_matmul.defjvp
def _f32_matmul_jvp(transposed, primals, tangents):
  (x, w), (dx, dw) = primals, tangents
  spec = "...i,oi->...o" if transposed else "...i,io->...o"
  return f32_matmul(x, w, transposed), jnp.einsum(spec, dx, w) + jnp.einsum(spec, x, dw)


def f32_attention(q: jax.Array, q_pos: jax.Array, k: jax.Array, v: jax.Array,
                  key_pos: jax.Array, valid: jax.Array, bound: jax.Array, *, scale: float,
                  window: int | None, xla, own: tuple | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Unnormalised attention of q[B, T, N, H] at q_pos[B, T] over one cache segment
  (k/v[B, K, S, H] at key_pos[B, S], where `valid`), reading slots [0, bound) only, and
  over `own` = (k, v[B, K, U, H], positions[B, U], valid[B, U]), the tokens' own keys and
  values, read as the slots after `bound`: each query row's masked score max m[B, T, N],
  l = Σ exp(s - m)[B, T, N] and acc = Σ exp(s - m)·v [B, T, N, H], for a log-sum-exp merge
  over segments. A slot is visible to a row when valid, at or before it and within
  `window` of it. A row's results have the same bits for any T (see the kernel's source):
  an AR step (the cache filled to p, its token after it) and a verification's row at p
  read the same slots in the same order.

  `xla(q, q_pos, k, v, key_pos, valid)` is the same in XLA's ops, for one segment. It takes
  a vmap (the sampling tests' batched rounds: one call per element would be one per round)
  and the tangents (XLA's ops differentiate; the kernel does not)."""
  require("f32_attention")
  B, _, _, H = q.shape
  if own is None:
    K = k.shape[1]
    own = (jnp.zeros((B, K, 0, H), k.dtype), jnp.zeros((B, K, 0, H), v.dtype),
           jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0), jnp.bool_))

  def kernel(q, q_pos, k, v, key_pos, valid, bound, own_k, own_v, own_pos, own_valid):
    B, T, N, H = q.shape
    out = (jax.ShapeDtypeStruct((B, T, N), jnp.float32),) * 2 + (
        jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),)
    return jax.ffi.ffi_call("specjax_f32_attention", out)(
        q, q_pos.astype(jnp.int32), k, v, key_pos.astype(jnp.int32), valid, bound, own_k,
        own_v, own_pos.astype(jnp.int32), own_valid, scale=np.float32(scale),
        window=np.int64(window or 0))

  def joined_xla(q, q_pos, k, v, key_pos, valid, bound, own_k, own_v, own_pos, own_valid):
    """Both segments' partials in XLA's ops, merged into one (m, l, acc). `bound` is the
    kernel's shortcut, not a mask: a segment with a `filled` bound marks the slots past it
    invalid too (`KVCacheView`, `QuantCacheView`)."""
    del bound
    if own_k.shape[2] == 0:
      return xla(q, q_pos, k, v, key_pos, valid)
    (m1, l1, a1), (m2, l2, a2) = (xla(q, q_pos, k, v, key_pos, valid),
                                  xla(q, q_pos, own_k, own_v, own_pos, own_valid))
    m = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return m, w1 * l1 + w2 * l2, w1[..., None] * a1 + w2[..., None] * a2

  @jax.custom_batching.custom_vmap
  def batchable(*args):
    return kernel(*args)

  @batchable.def_vmap
  def _batched(axis_size, in_batched, *args):
    axes = tuple(0 if b else None for b in in_batched)
    return jax.vmap(joined_xla, in_axes=axes)(*args), (True,) * 3

  @jax.custom_jvp
  def call(*args):
    return batchable(*args)

  @call.defjvp
  def _jvp(primals, tangents):
    return call(*primals), jax.jvp(joined_xla, primals, tangents)[1]

  # `bound` is an argument, not a constant the functions close over: under a vmap it may
  # be batched (a quantised cache's buffer count in a batch of sampling rounds).
  return call(q, q_pos, k, v, key_pos, valid, jnp.asarray(bound, jnp.int32), *own)


def f32_argmax(logits: jax.Array, probability: bool = False) -> tuple[jax.Array, jax.Array]:
  """Per row of float32 logits[..., V]: (the index of the first maximum, or of the first
  NaN, as int32[...]; with `probability`, 1 / Σ exp(logits - max) as float32[...], NaN
  where the maximum is not finite; without, that output is unspecified). Rows are
  independent, so a vmap adds rows. Not differentiable: callers that differentiate take
  XLA's expression (`sampling.top_probability`)."""
  require("f32_argmax")
  rows = logits.shape[:-1]
  out = (jax.ShapeDtypeStruct(rows, jnp.int32), jax.ShapeDtypeStruct(rows, jnp.float32))
  return jax.ffi.ffi_call("specjax_f32_argmax", out, vmap_method="broadcast_all")(
      logits, probability=probability)


__all__ = ["COMPILE_FLAGS", "FEW_ROWS", "KernelBuildError", "compile_flags", "f32_argmax",
           "f32_attention", "f32_matmul", "gguf_dequantize", "gguf_matmul", "int4_matmul",
           "int8_matmul", "int8_xla", "kernel_status", "q4_0_int8_fast", "q4_0_int8_matmul", "q4_0_int8_xla",
           "quant_partials", "runs_here", "unavailable"]
