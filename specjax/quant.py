"""Hierarchical 4+4-bit quantisation (QuantSpec, Tiwari et al. 2025), 4-bit packing, and
the quantised weights a draft reads (4-bit MLP, 8-bit everywhere, GGUF Q4_0 everywhere).

Per group, asymmetric min/max:

    scale = (max − min) / 15
    upper = round((x − min) / scale)                            ∈ [0, 15]
    lower = round((x − min − upper·scale) / (scale/15)) + 7     ∈ [0, 15]

`upper` alone is a 4-bit code (error ≤ scale/2); upper and lower together an 8-bit one
(error ≤ scale/30): the draft reads the first, the target both, from one copy.

Why scale/15 and +7 rather than QuantSpec's scale/16 and +8: the residual
x − min − upper·scale spans [−scale/2, scale/2], and with a step of scale/16 its codes
run from 0 to 16 — seventeen levels. Clipping the top one to 15 leaves an error of up to
scale/16 on the ~3 % of entries whose residual is near +scale/2. Sixteen levels over an
interval of width scale cannot do better than scale/30 in the worst case (so the
scale/32 often quoted is unreachable). Levels (lower − 7)·scale/15 reach scale/30 and
keep a zero residual exact (the ±7.5 boundary residuals land on −7 and +8 within half a
step).

Codes are packed two per byte (`pack`: first half of the axis in the low nibbles, second
half in the high). Everything here is jnp and jit-friendly; the Pallas kernels
(`pallas_kernels/`) read the same layout.

Group axis conventions (the KV cache's): keys per channel over groups of G tokens, values
per token over groups of channels. Weights: 4-bit (upper only) over groups of 128 input
rows (QuantSpec's MLP, `Int4Matrix`), or 8-bit symmetric with one scale per output channel
for every matmul of a draft (`Int8Matrix`); on a CPU the C++ int4 and int8
kernels read both from their codes. Or every matmul as GGUF Q4_0 blocks (`GGUFMatrix`:
32 weights and a half-float scale, 0.56 bytes a weight), read by the gguf kernel.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import ops, sharding
from specjax.errors import SpecjaxError
from specjax.gguf_matrix import GGUFMatrix


class QuantError(SpecjaxError, ValueError):
  """Shapes that do not split into groups, or values that cannot be quantised."""


@flax.struct.dataclass
class Hier:
  """Hierarchical codes of an array quantised over one axis in groups of `group`."""

  upper: jax.Array  # uint8, packed: two 4-bit codes per byte along the last axis
  lower: jax.Array  # uint8, packed likewise
  lo: jax.Array  # float32: group minimum, the group axis reduced to size/group
  scale: jax.Array  # float32: (max − min) / 15 per group


def pack(codes: jax.Array) -> jax.Array:
  """uint8 codes in [0, 15], last axis n even -> bytes [..., n/2]: byte j holds code j in
  its low nibble and code j + n/2 in its high one. Halves, not neighbours, so a kernel
  unpacks without interleaving: the two nibble planes are the two halves of the axis."""
  n = codes.shape[-1]
  if n % 2:
    raise QuantError(f"packing needs an even last axis, got {codes.shape}")
  c = codes.astype(jnp.uint8)
  return c[..., : n // 2] | (c[..., n // 2 :] << 4)


def unpack(packed: jax.Array) -> jax.Array:
  """Bytes -> uint8 codes, last axis doubled (inverse of `pack`)."""
  return jnp.concatenate([packed & 0xF, packed >> 4], axis=-1)


def _grouped(x: jax.Array, axis: int, group: int) -> jax.Array:
  """x with `axis` split into (n, group): the group becomes axis + 1."""
  axis = axis % x.ndim
  n = x.shape[axis]
  if group < 1 or n % group:
    raise QuantError(f"axis {axis} of size {n} does not split into groups of {group}")
  return x.reshape(x.shape[:axis] + (n // group, group) + x.shape[axis + 1 :])


@functools.partial(jax.jit, static_argnames=("axis", "group"))
def quantize(x: jax.Array, axis: int, group: int) -> Hier:
  """Hierarchical codes of x over `axis` in groups of `group`; codes are packed along the
  last axis (which must be even). NaN/inf inputs give NaN scales (see `check_finite`).
  Jitted: called outside a step (a weight matrix, a test's cache) it is one program per
  shape, not a dozen single-op programs each compiled on its own."""
  axis = axis % x.ndim
  g = _grouped(x.astype(jnp.float32), axis, group)
  lo = jnp.min(g, axis=axis + 1, keepdims=True)
  hi = jnp.max(g, axis=axis + 1, keepdims=True)
  scale = (hi - lo) / 15.0
  safe = jnp.where(scale > 0, scale, 1.0)  # a constant group: every code 0, exact
  upper = jnp.clip(jnp.round((g - lo) / safe), 0, 15)
  lower = jnp.clip(jnp.round((g - lo - upper * safe) / (safe / 15.0)) + 7, 0, 15)
  codes = lambda c: pack(c.reshape(x.shape).astype(jnp.uint8))
  return Hier(codes(upper), codes(lower), jnp.squeeze(lo, axis + 1),
              jnp.squeeze(scale, axis + 1))


@functools.partial(jax.jit, static_argnames=("axis", "group", "bits"))
def dequantize(h: Hier, axis: int, group: int, bits: int = 8) -> jax.Array:
  """float32 values from the codes: `bits`=4 reads `upper` only, 8 both.

  Each packed half of the last axis (`pack`) is widened on its own, its group statistics
  broadcast over the groups' elements. Unpacking first (a concatenation) and repeating
  the statistics to full size (`jnp.repeat`) gives the same numbers, bit for bit, more
  slowly on a CPU: XLA:CPU materialises both, where this form fuses into the reads."""
  if bits not in (4, 8):
    raise QuantError(f"precision is 4 or 8 bits, got {bits}")
  ndim = h.upper.ndim
  axis = axis % ndim
  n = h.upper.shape[-1]  # channels per packed half
  if axis == ndim - 1 and n % group:  # a group spans both halves: widen whole rows
    return _dequantize_rows(h, axis, group, bits)

  def half(j: int) -> jax.Array:
    codes = lambda p: ((p >> (4 * j)) & 0xF).astype(jnp.float32)
    if axis == ndim - 1:  # groups of channels: this half's groups
      per = n // group
      lo, scale = (a[..., j * per:(j + 1) * per, None] for a in (h.lo, h.scale))
      grouped = lambda c: c.reshape(c.shape[:-1] + (per, group))
    else:  # groups of rows along `axis`: this half's channels
      lo, scale = (jnp.expand_dims(a[..., j * n:(j + 1) * n], axis + 1)
                   for a in (h.lo, h.scale))
      grouped = lambda c: _grouped(c, axis, group)
    x = lo + grouped(codes(h.upper)) * scale
    if bits == 8:
      x = x + (grouped(codes(h.lower)) - 7.0) * (scale / 15.0)
    return x.reshape(h.upper.shape)

  return jnp.concatenate([half(0), half(1)], axis=-1)


def _dequantize_rows(h: Hier, axis: int, group: int, bits: int) -> jax.Array:
  """`dequantize` by unpacking whole rows and repeating the statistics: for groups of
  channels that do not divide a packed half."""
  upper = unpack(h.upper).astype(jnp.float32)
  lo = jnp.repeat(h.lo, group, axis=axis)
  scale = jnp.repeat(h.scale, group, axis=axis)
  x = lo + upper * scale
  if bits == 8:
    x = x + (unpack(h.lower).astype(jnp.float32) - 7.0) * (scale / 15.0)
  return x


def check_finite(x: jax.Array, what: str) -> None:
  """Host-side guard for values about to be quantised (eager callers, tests)."""
  if not bool(jnp.all(jnp.isfinite(x))):
    raise QuantError(f"{what} contain NaN/inf: quantising them would give garbage codes")


# --- 4-bit weights -------------------------------------------------------------------------

ACTIVATION_LEVELS = 32767  # int16 levels on each side of zero
# A group's unit is max|x_g| times this float32 reciprocal, never max|x_g| divided by the
# constant: XLA rewrites a division by a constant into a multiply by its reciprocal in some
# programs and not in others (one row alone and the same row among three got units an ulp
# apart on an AMD EPYC), which would tie a row's grid to its neighbours. The C++ kernel
# (`int4_matmul.cc`, kUnitPerAmax) multiplies by the same constant.
UNIT_PER_AMAX = np.float32(1) / np.float32(ACTIVATION_LEVELS)


def activation_grid(x: jax.Array, group: int) -> jax.Array:
  """x[..., I] (I a multiple of `group`) as a 4-bit matmul reads it: each group of `group`
  inputs rounded, half to even, to a multiple of its step max|x_g| / 32767, in float32.
  On a CPU the `int4_matmul` kernel multiplies those int16 levels with the codes as
  integers; every other path rounds x here first, so all compute one product. The error
  is at most 2^-16 of the group's largest input."""
  g = _grouped(x.astype(jnp.float32), -1, group)
  amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
  inverse = jnp.where(amax > 0, ACTIVATION_LEVELS / jnp.where(amax > 0, amax, 1.0), 0.0)
  levels = jnp.round(g * inverse)
  return (levels * (amax * UNIT_PER_AMAX)).reshape(x.shape)


@flax.struct.dataclass
class Int4Matrix:
  """A [In, Out] matrix at 4 bits over groups of `group` input rows (upper codes only),
  stored output-major like `Int8Matrix`: each output channel's codes are contiguous, one
  group after another (64 bytes, a cache line, for G = 128), packed within the group
  (`pack`: byte j holds inputs j and j + G/2), which is the order the CPU kernel reads."""

  codes: jax.Array  # uint8[Out, In'/2] (In' = In rounded up to a group)
  lo: jax.Array  # float32[Out, In'/group]
  scale: jax.Array  # float32[Out, In'/group]
  group: int = flax.struct.field(pytree_node=False, default=128)
  rows: int = flax.struct.field(pytree_node=False, default=0)  # In
  # Who multiplies it (`ops.int4_matmul`): None, the backend's choice; "pallas", the
  # Pallas kernel for a step's few rows; "xla" (`with_kernel`).
  kernel: str | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def quantize(cls, w: jax.Array, group: int = 128) -> Int4Matrix:
    """A last partial group (SmolLM2's D = 576 is 4.5 groups of 128) is padded by
    repeating the last row, which leaves its min and max — so its scale — unchanged."""
    n, out = w.shape
    padded = jnp.pad(w, ((0, -n % group), (0, 0)), mode="edge")
    h = quantize(padded.T.reshape(out, -1, group), axis=2, group=group)
    return cls(h.upper.reshape(out, -1), h.lo.reshape(out, -1), h.scale.reshape(out, -1),
               group, n)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The [In, Out] matrix the codes stand for."""
    out, groups = self.lo.shape
    packed = self.codes.reshape(out, groups, self.group // 2)
    codes = unpack(packed).astype(jnp.float32)  # [Out, In'/G, G]
    w = self.lo[..., None] + codes * self.scale[..., None]
    return w.reshape(out, -1)[:, : self.rows].T.astype(dtype)

  @property
  def nbytes(self) -> int:
    return self.codes.nbytes + self.lo.nbytes + self.scale.nbytes

  def matmul(self, x: jax.Array) -> jax.Array:
    """x[..., In] @ this matrix -> [..., Out] in x's dtype, x on its `activation_grid`.
    On a CPU the `int4_matmul` kernel reads the codes; elsewhere they are dequantised
    inside the jitted step (XLA fuses that into the dot's input on a GPU; XLA:CPU would
    write a float32 copy)."""
    pad = 2 * self.codes.shape[1] - self.rows  # the padded rows meet zeros
    xp = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, pad)])

    def otherwise():
      on_grid = activation_grid(xp, self.group)[..., : self.rows].astype(x.dtype)
      return on_grid @ self.dequantize(x.dtype)

    return ops.int4_matmul(xp, self.codes, self.lo, self.scale, reference=_int4_reference,
                           otherwise=otherwise, kernel=self.kernel,
                           on_grid=lambda xp: activation_grid(xp, self.group)).astype(x.dtype)

  @property
  def shape(self) -> tuple[int, int]:
    return self.rows, self.lo.shape[0]


def _int4_reference(x, codes, lo, scale):
  """`Int4Matrix.matmul`'s kernel product in XLA's ops, for batches past the kernel's rows:
  x (padded to whole groups) on its activation grid, over the dequantised matrix."""
  group = 2 * codes.shape[1] // lo.shape[1]
  w = Int4Matrix(codes, lo, scale, group, 2 * codes.shape[1]).dequantize()
  return jnp.einsum("...i,io->...o", activation_grid(x, group), w)


# --- 8-bit weights -------------------------------------------------------------------------


@jax.jit
def _int8_codes(w_oi: jax.Array) -> tuple[jax.Array, jax.Array]:
  """int8 codes[Out, In] and float32 scales[Out] of w[Out, In], one scale per output."""
  w_oi = w_oi.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w_oi), axis=1)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)  # an all-zero channel stays exact
  return jnp.clip(jnp.round(w_oi / scale[:, None]), -127, 127).astype(jnp.int8), scale


@flax.struct.dataclass
class Int8Matrix:
  """A [In, Out] matrix at 8 bits: symmetric int8 codes with one float32 scale per output
  channel (error ≤ scale/2 = max|w[:, o]|/254), stored output-major as codes[Out, In] so
  that each output's weights are contiguous for the CPU kernel (`ops.int8_matmul`)."""

  codes: jax.Array  # int8[Out, In]
  scale: jax.Array  # float32[Out]
  kernel: str | None = flax.struct.field(pytree_node=False, default=None)  # as Int4Matrix's

  @classmethod
  def quantize(cls, w: jax.Array, *, output_major: bool = False) -> Int8Matrix:
    """w[In, Out], or w[Out, In] with `output_major` (a tied embedding used as the head)."""
    return cls(*_int8_codes(w if output_major else w.T))

  def matmul(self, x: jax.Array) -> jax.Array:
    """x[..., In] @ this matrix -> [..., Out] in x's dtype."""
    return ops.int8_matmul(x, self.codes, self.scale, self.kernel).astype(x.dtype)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return (self.codes.astype(jnp.float32) * self.scale[:, None]).T.astype(dtype)

  def take_outputs(self, ids: jax.Array) -> Int8Matrix:
    """Output channels `ids` only, still 8-bit: an LM-head shortlist's rows [In, K]."""
    return Int8Matrix(jnp.take(self.codes, ids, axis=0), jnp.take(self.scale, ids),
                      self.kernel)

  @property
  def shape(self) -> tuple[int, int]:
    return self.codes.shape[1], self.codes.shape[0]

  @property
  def nbytes(self) -> int:
    return self.codes.nbytes + self.scale.nbytes


# --- a draft's weights ---------------------------------------------------------------------


@flax.struct.dataclass
class LayerWeights:
  """One layer's matrices for the draft, as [In, Out] matrices with a `matmul`; None
  keeps the layer's own full-precision parameter."""

  qkv: Int8Matrix | GGUFMatrix | None = None  # [D, (N + 2K)·H]
  o: Int8Matrix | GGUFMatrix | None = None  # [N·H, D]
  gate_up: Int8Matrix | Int4Matrix | GGUFMatrix | None = None  # [D, 2F]
  down: Int8Matrix | Int4Matrix | GGUFMatrix | None = None  # [F, D]


# The quantised copies a draft can read, by `DraftWeights.kind`, named as reports say them:
# int8, every matmul and the head (`8bit`; QuantSpec at 8 bits); int4, the MLP matrices in
# groups of 128 rows (QuantSpec at 4 bits, the paper's); q4_0, GGUF blocks of every matmul
# and the head (`4bit`).
WEIGHT_KINDS = {
    "int8": "the 8-bit weights",
    "int4": "QuantSpec's 4-bit MLP weights",
    "q4_0": "the Q4_0 weights",
}


@flax.struct.dataclass
class DraftWeights:
  """Quantised copies of the target's matrices that a draft reads instead of its own
  (the target always reads its own: losslessness never depends on them)."""

  layers: tuple[LayerWeights, ...]
  # the LM head [D, V] (the embedding's transpose if tied)
  head: Int8Matrix | GGUFMatrix | None = None
  bits: int = flax.struct.field(pytree_node=False, default=8)  # per weight, for reports
  # which copy this is (`WEIGHT_KINDS`): what latency profiles and searched plans are
  # made for, since two copies of the same bits cost differently (QuantSpec's 4-bit MLP
  # matrices are not `4bit`'s Q4_0 blocks)
  kind: str = flax.struct.field(pytree_node=False, default="int8")

  @property
  def nbytes(self) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(self))


def with_kernel(weights: DraftWeights, kernel: str | None) -> DraftWeights:
  """`weights` with every int8 and int4 matrix multiplied by `kernel` (`ops.WEIGHT_KERNELS`:
  None, the backend's choice; "pallas", the Pallas few-row kernel, interpreted on a CPU;
  "xla"). The arrays are shared, not copied. Q4_0 blocks have one reader, the CPU kernel."""
  from specjax.errors import ConfigError

  if kernel not in ops.WEIGHT_KERNELS:
    raise ConfigError(f"a draft's weight kernel is one of "
                      f"{', '.join(str(k) for k in ops.WEIGHT_KERNELS)}, got {kernel!r}")

  def choose(m):
    if isinstance(m, GGUFMatrix):
      if kernel is not None:
        raise ConfigError(f"Q4_0 copies are read by the gguf_matmul CPU kernel only: no "
                          f"{kernel!r} kernel for the 4bit draft")
      return m
    return m.replace(kernel=kernel)

  return jax.tree.map(choose, weights,
                      is_leaf=lambda m: isinstance(m, (Int8Matrix, Int4Matrix, GGUFMatrix)))


def model_matrices(state, num_layers: int):
  """(layer, name, [In, Out] matrix) of every matmul weight of an `nnx.State` (a
  `GGUFMatrix`, `--dtype gguf`, dequantised)."""
  def in_out(var, output_major: bool) -> jax.Array:
    value = var.get_value()
    if isinstance(value, GGUFMatrix):
      return value.dequantize().T  # the file's rows are outputs
    return value.T if output_major else value.reshape(-1, value.shape[-1])

  for l in range(num_layers):
    block = state["blocks"][l]
    yield l, "qkv", in_out(block["attn"]["qkv"], True)  # stored [(N + 2K)·H, D]
    yield l, "o", in_out(block["attn"]["o"], False)  # stored [N, H, D]
    yield l, "gate_up", in_out(block["mlp"]["gate_up"], True)  # stored [2F, D]
    yield l, "down", in_out(block["mlp"]["down"], False)


def _like_parent(copy, state, l: int, name: str):
  """`copy` of layer l's matrix `name`, placed as the parameter is (on a mesh)."""
  parent = state["blocks"][l]["attn" if name in ("qkv", "o") else "mlp"][name].get_value()
  return sharding.place_copy(copy, parent, name)


def quantize_mlp_weights(state, num_layers: int, group: int = 128) -> DraftWeights:
  """QuantSpec's 4-bit draft weights: every layer's MLP matrices, groups of `group` rows."""
  layers = [dict() for _ in range(num_layers)]
  for l, name, w in model_matrices(state, num_layers):
    if name in ("gate_up", "down"):
      layers[l][name] = _like_parent(Int4Matrix.quantize(w, group), state, l, name)
  return DraftWeights(tuple(LayerWeights(**kw) for kw in layers), bits=4, kind="int4")


def quantize_weights_int8(state, num_layers: int) -> DraftWeights:
  """8-bit copies of every matmul the draft runs: attention projections, MLP, LM head."""
  layers = [dict() for _ in range(num_layers)]
  for l, name, w in model_matrices(state, num_layers):
    layers[l][name] = _like_parent(Int8Matrix.quantize(w), state, l, name)
  table = state["lm_head" if "lm_head" in state else "embedding"].get_value()
  if isinstance(table, GGUFMatrix):  # the file's [V, D] rows
    head = Int8Matrix.quantize(table.dequantize(), output_major=True)
  elif "lm_head" in state:
    head = sharding.place_copy(Int8Matrix.quantize(table), table, "lm_head")
  else:
    head = sharding.place_copy(Int8Matrix.quantize(table, output_major=True), table,
                               "embedding")
  return DraftWeights(tuple(LayerWeights(**kw) for kw in layers), head=head, bits=8, kind="int8")


def q4_0_draft_weights(state, num_layers: int, *,
                        int8_inputs: bool | None = None) -> DraftWeights:
  """`quantize_weights_q4_0` for a draft that will read them: refused, naming why, where
  the `gguf_matmul` CPU kernel that reads Q4_0 blocks cannot run."""
  from specjax.errors import ConfigError

  why = ops.blocks_unavailable(state["embedding"].get_value())  # (on a mesh: refused)
  if why:
    raise ConfigError(f"the 4bit draft reads Q4_0 blocks through the gguf_matmul CPU "
                      f"kernel ({why}); use 8bit elsewhere")
  return quantize_weights_q4_0(state, num_layers, int8_inputs=int8_inputs)


def quantize_weights_q4_0(state, num_layers: int, *,
                          int8_inputs: bool | None = None) -> DraftWeights:
  """Q4_0 copies of every matmul the draft runs, as gguf-py quantises them: 0.56 bytes a
  weight, under a GGUF target's own Q5_0-Q8_0 blocks (0.69-1.06), which 8-bit copies are
  not. Read with x at 8 bits by `ops.q4_0_int8_matmul` where its VNNI loop runs
  (`int8_inputs` None: `q4_0_int8_fast()`), else by `gguf_matmul` (CPU only)."""
  from specjax.gguf_matrix import KINDS

  if int8_inputs is None:
    int8_inputs = ops.q4_0_int8_fast()
  quantize = functools.partial(GGUFMatrix.quantize, kind=KINDS["Q4_0"], int8_inputs=int8_inputs)
  layers = [dict() for _ in range(num_layers)]
  for l, name, w in model_matrices(state, num_layers):
    layers[l][name] = quantize(np.asarray(w).T)  # blocks along inputs
  table = state["lm_head" if "lm_head" in state else "embedding"].get_value()
  if isinstance(table, GGUFMatrix):  # the file's [V, D] rows
    rows = table.dequantize()
  else:  # lm_head is stored [D, V], a tied embedding [V, D]
    rows = table.T if "lm_head" in state else table
  head = quantize(np.asarray(rows, np.float32))
  return DraftWeights(tuple(LayerWeights(**kw) for kw in layers), head=head, bits=4,
                      kind="q4_0")
