"""Weight-only quantised matmul for a decode step's few rows (Pallas, Triton lowering).

A draft step multiplies one row (verification γ + 1 ≤ 16) by every weight matrix, so it
is a read of the weights and nothing else; XLA:GPU instead converts a quantised matrix
to the activations' dtype before a generic dot, which costs more than the bytes saved
(docs/decisions/gpu.md, G4). Here each program owns a block of output channels, holds all
the rows of x, and walks the input dimension once: each code is read once, widened in
registers, and met by every row, the products accumulated in float32.

Two formats, as `specjax.quant` stores them, output-major so that a program's block is
contiguous rows of codes:

- int8 per output channel (`Int8Matrix`): codes[O, I] int8, scale[O];
- int4 over groups of G input rows (`Int4Matrix`, QuantSpec's MLP): codes[O, I/2], byte j
  of a group holding inputs j and j + G/2 (`quant.pack`), and lo, scale[O, I/G]. With
  w = lo + c·s, a group's product is s·(x·c) + lo·Σx: the codes meet x as two
  half-group dots (one per nibble plane: no interleaving), and lo needs only x's sum.

For the Triton lowering every tensor is a power of two: x's rows are padded to 16 (the
smallest dot), the input is walked in blocks of a power of two that divides it, and a
matrix whose dimensions allow no such blocks is not taken (`takes`). On a CPU the kernels
run with interpret=True, against the jnp references below (the tests).

Shapes: R rows of x (padded), I inputs, O outputs, G group, bo / bi block sizes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

ROWS = 16  # x's rows are padded to this: Triton's smallest dot, and the most a step has
MAX_BLOCK_O = 128
MAX_BLOCK_I = 512
MIN_BLOCK = 16


def _block(n: int, most: int) -> int | None:
  """The largest power of two ≤ `most` and ≥ MIN_BLOCK that divides n, or None."""
  b = most
  while b >= MIN_BLOCK:
    if n % b == 0:
      return b
    b //= 2
  return None


def takes(rows: int, inputs: int, outputs: int, group: int | None = None) -> bool:
  """Whether the kernel takes x[rows, inputs] times a matrix of `outputs` channels (int4:
  in groups of `group` inputs): few rows, and blocks the Triton lowering can tile."""
  if not 1 <= rows <= ROWS or _block(outputs, MAX_BLOCK_O) is None:
    return False
  if group is None:
    return _block(inputs, MAX_BLOCK_I) is not None
  return inputs % group == 0 and group // 2 >= MIN_BLOCK and group & (group - 1) == 0


def _rows_of(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
  """x[..., I] as [ROWS, I] (zero rows below its own) and its leading shape."""
  lead = x.shape[:-1]
  flat = x.reshape(-1, x.shape[-1])
  return jnp.pad(flat, ((0, ROWS - flat.shape[0]), (0, 0))), lead


def _xwT(x, w):
  """x[R, n] · w[bo, n]ᵀ -> [R, bo] in float32."""
  return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _int8_kernel(x_ref, codes_ref, scale_ref, o_ref, *, block_i: int, blocks: int):
  def body(i, acc):
    cols = pl.ds(i * block_i, block_i)
    x = x_ref[:, cols]
    return acc + _xwT(x, codes_ref[:, cols].astype(x.dtype))

  acc = jax.lax.fori_loop(0, blocks, body, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc * scale_ref[...][None, :]


@functools.partial(jax.jit, static_argnames=("interpret",))
def int8_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, *,
                interpret: bool = False) -> jax.Array:
  """x[..., I] (≤ ROWS rows; float32 or bfloat16) times int8 codes[O, I] with one scale
  per output -> [..., O] float32."""
  O, I = codes.shape
  xr, lead = _rows_of(x)
  bo, bi = _block(O, MAX_BLOCK_O), _block(I, MAX_BLOCK_I)
  out = pl.pallas_call(
      functools.partial(_int8_kernel, block_i=bi, blocks=I // bi),
      grid=(O // bo,),
      in_specs=[pl.BlockSpec((ROWS, I), lambda o: (0, 0)),
                pl.BlockSpec((bo, I), lambda o: (o, 0)),
                pl.BlockSpec((bo,), lambda o: (o,))],
      out_specs=pl.BlockSpec((ROWS, bo), lambda o: (0, o)),
      out_shape=jax.ShapeDtypeStruct((ROWS, O), jnp.float32),
      interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=3),
      name="weight_only_int8_matmul",
  )(xr, codes, scale.astype(jnp.float32))
  return out[: math.prod(lead)].reshape(lead + (O,))


def _int4_kernel(x_ref, codes_ref, lo_ref, scale_ref, o_ref, *, group: int, groups: int):
  half = group // 2

  def body(g, acc):
    c = codes_ref[:, pl.ds(g * half, half)]  # [bo, G/2]: inputs j and j + G/2 per byte
    x1 = x_ref[:, pl.ds(g * group, half)]
    x2 = x_ref[:, pl.ds(g * group + half, half)]
    low, high = (c & 0xF).astype(x1.dtype), (c >> 4).astype(x1.dtype)
    coded = _xwT(x1, low) + _xwT(x2, high)  # [R, bo]
    total = (jnp.sum(x1.astype(jnp.float32), axis=1, keepdims=True)
             + jnp.sum(x2.astype(jnp.float32), axis=1, keepdims=True))  # [R, 1]
    s = scale_ref[pl.ds(g, 1), :]  # [1, bo]
    lo = lo_ref[pl.ds(g, 1), :]
    return acc + coded * s + total * lo

  o_ref[...] = jax.lax.fori_loop(0, groups, body, jnp.zeros(o_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def int4_matmul(x: jax.Array, codes: jax.Array, lo: jax.Array, scale: jax.Array, *,
                interpret: bool = False) -> jax.Array:
  """x[..., I] (≤ ROWS rows, I whole groups, on the format's activation grid already)
  times a 4-bit matrix: codes uint8[O, I/2], lo and scale float32[O, I/G] -> [..., O]
  float32. lo and scale are read group-major ([I/G, O]: a group's row is one load)."""
  O, groups = lo.shape
  group = 2 * codes.shape[1] // groups
  xr, lead = _rows_of(x)
  bo = _block(O, MAX_BLOCK_O)
  per_group = pl.BlockSpec((groups, bo), lambda o: (0, o))
  out = pl.pallas_call(
      functools.partial(_int4_kernel, group=group, groups=groups),
      grid=(O // bo,),
      in_specs=[pl.BlockSpec((ROWS, x.shape[-1]), lambda o: (0, 0)),
                pl.BlockSpec((bo, codes.shape[1]), lambda o: (o, 0)),
                per_group, per_group],
      out_specs=pl.BlockSpec((ROWS, bo), lambda o: (0, o)),
      out_shape=jax.ShapeDtypeStruct((ROWS, O), jnp.float32),
      interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=3),
      name="weight_only_int4_matmul",
  )(xr, codes, lo.T.astype(jnp.float32), scale.T.astype(jnp.float32))
  return out[: math.prod(lead)].reshape(lead + (O,))


# --- references ----------------------------------------------------------------------------


def int8_reference(x, codes, scale):
  """The int8 product in jnp: x · codesᵀ, then each output's scale, in float32."""
  y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32), codes.astype(jnp.float32),
                 precision="highest")
  return y * scale.astype(jnp.float32)


def int4_reference(x, codes, lo, scale):
  """The int4 product in jnp over the dequantised matrix lo + c·s, in float32."""
  O, groups = lo.shape
  group = 2 * codes.shape[1] // groups
  packed = codes.reshape(O, groups, group // 2)
  c = jnp.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(jnp.float32)
  w = (lo[..., None] + c * scale[..., None]).reshape(O, groups * group)
  return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w, precision="highest")
