"""A target's matrix kept in its GGUF file's own block formats (`--dtype gguf`).

Why: a float32 target streams 4 bytes a weight every decode step; the file holds 0.56 of
a byte (Q4_1) to 1.06 (Q8_0). llama.cpp decodes from those blocks several times faster
than specjax's float32 target on the same CPU (docs/decisions/cpu.md, C8). Here the model keeps
the blocks and the `gguf_matmul` C++ kernel dequantises them in registers to the float32
weights gguf-py would give, bit for bit, so the numbers are the float32 model's up to the
order of each dot product's sums — and that order is the same for one row or a
verification's few, which is what keeps greedy SSD equal to greedy AR.

A matrix is stored output-major, as the file stores it: one row of blocks per output.
Matrices that specjax fuses (q|k|v, gate|up) are kept as parts, one per run of outputs of
one ggml type (Qwen2.5's Q4_K_M files store some layers' v in Q8_0 and q, k in Q5_0), each
its own kernel call, their outputs concatenated.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import ops
from specjax.errors import SpecjaxError

# ggml types the kernel reads (gguf.GGMLQuantizationType values).
KINDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


class GGUFMatrixError(SpecjaxError, ValueError):
  """Blocks of a type the kernel cannot read, or parts that do not line up."""


@flax.struct.dataclass
class GGUFMatrix:
  """A [In, Out] matrix as GGUF rows of blocks: parts[p] uint8[O_p, bytes per row] of ggml
  type kinds[p], outputs concatenated in part order."""

  parts: tuple[jax.Array, ...]
  kinds: tuple[int, ...] = flax.struct.field(pytree_node=False)
  inputs: int = flax.struct.field(pytree_node=False)  # In
  # A draft's Q4_0 copy (`4bit`): a step's x quantised to 8 bits per block of 32 and
  # multiplied as integers (`ops.q4_0_int8_matmul`), close to the float product
  # but not equal to it, so never a target's matrix.
  int8_inputs: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def from_rows(cls, rows: list[tuple[np.ndarray, int]]) -> GGUFMatrix:
    """Consecutive output rows as (blocks uint8[O, bytes], ggml type) from the file,
    merged into one part where neighbours share a type."""
    parts: list[tuple[list[np.ndarray], int]] = []
    inputs = None
    for blocks, kind in rows:
      if kind not in KINDS.values():
        raise GGUFMatrixError(f"ggml type {kind} is not one the gguf_matmul kernel reads "
                              f"({', '.join(KINDS)})")
      weights, nbytes = _block(kind)
      n = blocks.shape[-1] // nbytes * weights
      if inputs not in (None, n):
        raise GGUFMatrixError(f"parts of {inputs} and {n} inputs cannot form one matrix")
      inputs = n
      if parts and parts[-1][1] == kind:
        parts[-1][0].append(blocks)
      else:
        parts.append(([blocks], kind))
    return cls(tuple(jnp.asarray(np.concatenate(b)) for b, _ in parts),
               tuple(k for _, k in parts), int(inputs))

  KIND_Q8_0 = KINDS["Q8_0"]

  @classmethod
  def quantize(cls, w_oi: jax.Array | np.ndarray, kind: int, *,
               int8_inputs: bool = False) -> GGUFMatrix:
    """A float matrix [Out, In] quantised by gguf-py to ggml type `kind` (those it can
    quantise: Q4_0, Q4_1, Q5_0, Q8_0), as a GGUF writer would store it; `int8_inputs`
    (Q4_0 only): a draft's copy, multiplied with x at 8 bits."""
    import gguf

    if int8_inputs and kind != KINDS["Q4_0"]:
      raise GGUFMatrixError("only Q4_0 matrices take 8-bit inputs (q4_0_int8_matmul)")
    w = np.asarray(w_oi, np.float32)
    m = cls.from_rows([(gguf.quants.quantize(w, gguf.GGMLQuantizationType(kind)), kind)])
    return m.replace(int8_inputs=int8_inputs)

  @property
  def shape(self) -> tuple[int, int]:
    return self.inputs, sum(p.shape[0] for p in self.parts)

  @property
  def dtype(self):
    """What its products are computed in."""
    return jnp.dtype(jnp.float32)

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.parts)

  def matmul(self, x: jax.Array) -> jax.Array:
    """x[..., In] @ this matrix -> [..., Out] in float32: each part by `ops.gguf_matmul`
    (or `ops.q4_0_int8_matmul` with 8-bit inputs), which takes the kernel for a step's or
    a verification's few rows and XLA's dot over the dequantised part for a prompt's."""
    if self.int8_inputs:  # its own XLA path past a few rows: the same 8-bit product
      outs = [ops.q4_0_int8_matmul(x, blocks) for blocks in self.parts]
    else:
      outs = [ops.gguf_matmul(x, blocks, kind) for blocks, kind in zip(self.parts, self.kinds)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)

  def dequantize(self) -> jax.Array:
    """The float32 matrix, output-major [Out, In]."""
    rows = [ops.gguf_dequantize(b, k) for b, k in zip(self.parts, self.kinds)]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows)

  def take_outputs(self, ids: jax.Array) -> GGUFMatrix:
    """Output rows `ids` only, still in blocks: an LM-head shortlist's rows [In, K], which
    a draft then reads at the file's bytes (as float32 rows, 32k of SmolLM2's tokens cost
    more than its whole Q8_0 head)."""
    self._one_part()
    return self.replace(parts=(jnp.take(self.parts[0], ids, axis=0),))

  def _one_part(self) -> None:
    if len(self.parts) != 1:
      raise GGUFMatrixError("rows are gathered from one-part matrices (embeddings, heads)")

  def take_rows(self, ids: jax.Array) -> jax.Array:
    """Output rows `ids` as float32 [..., In] (an embedding lookup, a shortlist's head
    rows), only those rows dequantised."""
    self._one_part()
    return ops.gguf_dequantize(jnp.take(self.parts[0], ids, axis=0), self.kinds[0])


def _block(kind: int) -> tuple[int, int]:
  """(weights, bytes) of one block of ggml type `kind`."""
  from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

  return GGML_QUANT_SIZES[GGMLQuantizationType(kind)]

