"""The ops whose implementation depends on where they run, each chosen here and only here.

The model, sampling, the weight formats and the caches call these ops: a matmul over each
weight format, attention over a float cache segment or a quantised layer, the greedy
choice. Each picks one of three implementations from the backend, the operands' dtype and
row count, and whether the operands are sharded:

- a C++ kernel (`specjax.cpu_kernels`) on a CPU, for a decode step's few rows, where
  XLA:CPU's own lowering streams weights or caches slowly (docs/decisions/cpu.md);
- a Pallas kernel (`pallas_kernels`) for attention over a quantised cache where a cache
  asks for it, on a mesh under `shard_map`, each device running it on its own kv heads
  (a Pallas call is opaque to GSPMD, which would otherwise gather the codes to run it);
  and for a step's few rows times quantised weights that ask for it (one device);
- XLA's ops everywhere else: a prompt's many rows, a GPU, and any sharded operand. A C++
  custom call sees one device's buffer, so a sharded array must never reach one: XLA
  would gather it first, or the call would compute on a shard as if it were the whole.

`sharded` reads both signals jax gives while tracing: a mesh set for the computation
(`jax.set_mesh`) and an operand's own sharding (explicit-mode arrays carry it in their
type). The kernels themselves only compute; they decide nothing.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax import cpu_kernels
from specjax.cpu_kernels import FEW_ROWS
from specjax.sharding import AXIS

__all__ = ["FEW_ROWS", "argmax", "argmax_and_top_probability", "blocks_unavailable",
           "f32_attention", "f32_attention_takes", "f32_matmul_takes", "gguf_dequantize",
           "gguf_matmul", "int4_matmul", "int8_matmul", "matmul", "PLAN_PATHS", "plan_path",
           "WEIGHT_KERNELS",
           "q4_0_int8_fast",
           "q4_0_int8_matmul", "quant_attention", "quant_codes_on_cpu", "quant_partials_cpu",
           "sharded", "top_probability"]


# --- where an op runs ------------------------------------------------------------------


def sharded(*operands) -> bool:
  """Whether the computation is split over devices: a mesh of more than one device set
  for it (`jax.set_mesh`, what a tensor-parallel model runs under), or an operand whose
  sharding spans several devices (a concrete array, or a traced one in explicit mode)."""
  if jax.sharding.get_abstract_mesh().size > 1:
    return True
  for x in operands:
    try:
      mesh = jax.typeof(x).sharding.mesh
    except (AttributeError, TypeError):
      continue
    if mesh.size > 1:
      return True
  return False


def _cpu_kernel(kernel: str, *operands) -> bool:
  """A C++ kernel runs: a CPU backend, the kernel built, nothing sharded."""
  return cpu_kernels.runs_here(kernel) and not sharded(*operands)


def _rows(x: jax.Array) -> int:
  return x.size // x.shape[-1] if x.shape[-1] else 0


# --- a plan chosen at decode time ------------------------------------------------------

PLAN_PATHS = ("cond", "dispatch")


def plan_path() -> str:
  """How a draft runs a plan that is data (CLaSp's, KnapSpec's, SWIFT's, chosen between
  rounds): "cond", each sub-layer in a `lax.cond` of one draft executable
  (`round.draft_fn`), or "dispatch", the host calling one executable per sub-layer the
  plan runs (`decode.dispatched_draft`). A CPU keeps "cond": there a conditional runs its
  branch in place and one executable serves every plan. An accelerator pays a host round
  trip per conditional (docs/GPU.md), which "dispatch" avoids; it stays "cond" there too
  until a GPU has timed the two (docs/decisions/gpu.md). Meanwhile
  `speculative_generate(plan_path="dispatch")` chooses it for a run, and the environment
  variable SPECJAX_PLAN_PATH for every run of a process (`specjax bench`, sweeps)."""
  return os.environ.get("SPECJAX_PLAN_PATH", "cond")


# --- matmuls -----------------------------------------------------------------------------


def matmul(x: jax.Array, w, output_major: bool = False, preferred=None) -> jax.Array:
  """x[..., I] @ w for every weight format. A float matrix is w[I, O] (w[O, I] when
  `output_major`: a tied embedding, gate_up, q/k/v): on a CPU a decode step's one to
  FEW_ROWS float32 rows take `f32_matmul`, which reads each weight once for all of them,
  else XLA's dot (`preferred`: its accumulation dtype). A quantised format (`Int8Matrix`,
  `Int4Matrix`, `GGUFMatrix`) reads itself through its own op below."""
  if hasattr(w, "matmul"):
    return w.matmul(x)
  if f32_matmul_takes(x, w):
    return cpu_kernels.f32_matmul(x, w, output_major)
  spec = "...i,oi->...o" if output_major else "...i,io->...o"
  return jnp.einsum(spec, x, w, preferred_element_type=preferred)


def f32_matmul_takes(x: jax.Array, w: jax.Array) -> bool:
  """Whether `x @ w` takes the few-row kernel: float32 on a CPU, 1 to FEW_ROWS rows (one
  included: the kernel streams an AR or draft step's weights faster than XLA's GEMV),
  the kernel built, nothing sharded."""
  rows = _rows(x)
  return (1 <= rows <= FEW_ROWS and x.dtype == w.dtype == jnp.float32 and w.ndim == 2
          and _cpu_kernel("f32_matmul", x, w))


WEIGHT_KERNELS = (None, "pallas", "xla")


def _pallas_matmul(kernel: str | None, x: jax.Array, codes: jax.Array, outputs: int,
                   group: int | None = None) -> bool:
  """A quantised matrix asked for the Pallas kernel (`kernel="pallas"`) takes it where the
  kernel tiles its shape (`pallas_kernels.quant_matmul.takes`) and nothing is sharded."""
  if kernel not in WEIGHT_KERNELS:
    raise ValueError(f"a quantised matrix's kernel is one of {WEIGHT_KERNELS}, got {kernel!r}")
  if kernel != "pallas" or sharded(x, codes):
    return False
  from pallas_kernels import quant_matmul

  return quant_matmul.takes(_rows(x), x.shape[-1], outputs, group)


def int8_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array,
                kernel: str | None = None) -> jax.Array:
  """x[..., I] times int8 codes[O, I] with one scale per output -> [..., O] float32.
  `kernel` None: on a CPU the C++ kernel widens each code in registers (XLA:CPU converts
  the whole matrix to float32 in memory before its dot), elsewhere XLA's dot. "pallas": the
  Pallas kernel for a step's few rows (`pallas_kernels.quant_matmul`; interpreted on a
  CPU), XLA's dot where it does not tile; "xla": XLA's dot."""
  if _pallas_matmul(kernel, x, codes, codes.shape[0]):
    from pallas_kernels import quant_matmul

    return quant_matmul.int8_matmul(x, codes, scale, interpret=jax.default_backend() == "cpu")
  if kernel is None and _cpu_kernel("int8_matmul", x, codes):
    return cpu_kernels.int8_matmul(x, codes, scale)
  return cpu_kernels.int8_xla(x, codes, scale)


def int4_matmul(x: jax.Array, codes: jax.Array, lo: jax.Array, scale: jax.Array, *,
                reference, otherwise, on_grid=None, kernel: str | None = None):
  """x[..., I'] times a 4-bit matrix stored output-major (`quant.Int4Matrix`). The format's
  math is its owner's, so the caller brings both XLA forms: `reference(x, codes, lo,
  scale)`, the kernel's float32 product, which a vmap past FEW_ROWS rows takes, and
  `otherwise()`, the product where the kernel does not run (in the caller's dtype).
  `kernel` as for `int8_matmul`; the Pallas kernel multiplies `on_grid(x)`, x as the
  format reads it."""
  group = 2 * codes.shape[1] // lo.shape[1]
  if _pallas_matmul(kernel, x, codes, codes.shape[0], group):
    from pallas_kernels import quant_matmul

    return quant_matmul.int4_matmul(on_grid(x), codes, lo, scale,
                                    interpret=jax.default_backend() == "cpu")
  if kernel is None and _cpu_kernel("int4_matmul", x, codes):
    return cpu_kernels.int4_matmul(x, codes, lo, scale, reference=reference)
  return otherwise()


def blocks_unavailable(*operands) -> str | None:
  """None where GGUF blocks can be read here, else why not: they are read by C++ kernels
  only (`--dtype gguf`, the `4bit` draft), which need a CPU backend, a compiler, and one
  device's buffer."""
  if sharded(*operands):
    return "the operands are sharded over a mesh, and a C++ kernel reads one device's buffer"
  return cpu_kernels.unavailable("gguf_matmul")


def q4_0_int8_fast() -> bool:
  """Whether a Q4_0 draft reads with x at 8 bits here (the kernel's VNNI loop runs)."""
  return cpu_kernels.q4_0_int8_fast()


def _blocks_here(what: str, *operands) -> None:
  """Refuse, naming why, where GGUF blocks cannot be read."""
  if why := blocks_unavailable(*operands):
    from specjax.errors import ConfigError

    raise ConfigError(f"{what} reads GGUF blocks through the gguf_matmul CPU kernel ({why})")


def gguf_matmul(x: jax.Array, blocks: jax.Array, kind: int) -> jax.Array:
  """x[..., I] times one part of a `GGUFMatrix` (rows of blocks of ggml type `kind`) ->
  [..., O] float32. A step's or a verification's few rows take the kernel, which reads
  each block once for all of them; a prompt's many rows dequantise the part and take
  XLA's dot, which reuses each weight across them."""
  _blocks_here("a matmul", x, blocks)
  if _rows(x) > FEW_ROWS:
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), gguf_dequantize(blocks, kind))
  return cpu_kernels.gguf_matmul(x, blocks, kind)


def gguf_dequantize(blocks: jax.Array, kind: int) -> jax.Array:
  """Rows of GGUF blocks -> float32 [..., O, I], bit for bit gguf-py's dequantisation."""
  _blocks_here("dequantising", blocks)
  return cpu_kernels.gguf_dequantize(blocks, kind)


def q4_0_int8_matmul(x: jax.Array, blocks: jax.Array) -> jax.Array:
  """x[..., I] times Q4_0 blocks with x at 8 bits per 32 inputs (ggml's Q8_0): a `4bit`
  draft's product. The kernel for a step's few rows; the same product in XLA's ops for
  a prompt's many rows."""
  _blocks_here("the 4bit draft", x, blocks)
  x = x.astype(jnp.float32)
  if _rows(x) > FEW_ROWS:
    return cpu_kernels.q4_0_int8_xla(x, blocks)
  return cpu_kernels.q4_0_int8_matmul(x, blocks)


# --- attention ---------------------------------------------------------------------------


def f32_attention_takes(q: jax.Array, k: jax.Array) -> bool:
  """Whether attention of q[B, T, N, H] over cache segments like k[B, K, S, H] takes
  `f32_attention`: float32 on a CPU, 1 to FEW_ROWS tokens (a step or a verification; a
  prompt's many rows keep XLA's dots, which reuse each key for all of them), whole
  vectors of H, the kernel built, nothing sharded."""
  return (1 <= q.shape[1] <= FEW_ROWS and q.dtype == k.dtype == jnp.float32
          and q.shape[-1] % 16 == 0 and _cpu_kernel("f32_attention", q, k))


def f32_attention(*args, **kwargs):
  """`cpu_kernels.f32_attention`, where `f32_attention_takes` said so: the caller keeps
  its segments in one layout for both paths, so the choice is made once per attention."""
  return cpu_kernels.f32_attention(*args, **kwargs)


def quant_codes_on_cpu() -> bool:
  """Whether a quantised KV cache made now is read from its codes by the C++ kernels (a
  CPU, the kernel built, no mesh) rather than dequantised or read by Pallas."""
  return _cpu_kernel("quant_attention")


def quant_attention(q, q_pos, length, k_codes, v_codes, fp_k, fp_v, fp_pos, fp_valid, *,
                    bits: int, group: int, value_group: int, scale: float,
                    window: int | None = None, cpu: bool = False):
  """Attention of rows q[B, K, Rq, H] over a quantised layer's slots [0, length) and the
  full-precision keys and values fp_k/fp_v[B, K, F, H] after them: [B, K, Rq, H]. The
  quantised part by the C++ kernel where the cache was made to read on a CPU (`cpu`),
  else by the Pallas kernel (interpreted on a CPU backend, which is what the tests run);
  the full-precision part and the log-sum-exp merge in XLA's ops."""
  from pallas_kernels import dense_partials, merge, merge_splits, quant_partials

  kw = dict(scale=scale, window=window)
  if cpu:
    part = quant_partials_cpu(q, q_pos, length, k_codes, v_codes, bits=bits, **kw)
  else:
    kernel = functools.partial(quant_partials, bits=bits, group=group,
                               value_group=value_group,
                               interpret=jax.default_backend() == "cpu", **kw)
    if sharded(q, k_codes.upper):
      kernel = _per_kv_head_shard(kernel, q.shape[1])
    part = merge_splits(*kernel(q, q_pos, length, k_codes, v_codes))
  return merge([part, dense_partials(q, q_pos, fp_k, fp_v, fp_pos, fp_valid, **kw)])


def _per_kv_head_shard(kernel, kv_heads: int):
  """`kernel(q, q_pos, length, k_codes, v_codes)` -> partials, all [B, K, ...], run on the
  mesh in context by `shard_map`: each device on the kv heads it holds (the cache's split,
  `sharding.cache_spec`), or on all of them where the heads are replicated. Heads are
  independent, so no collective is needed."""
  mesh = jax.sharding.get_abstract_mesh()
  heads = P(None, AXIS) if mesh.size > 1 and kv_heads % mesh.size == 0 else P()
  return jax.shard_map(kernel, in_specs=(heads, P(), P(), heads, heads),
                       out_specs=(heads, heads, heads), check_vma=False)


def quant_partials_cpu(q, q_pos, length, k_codes, v_codes, *, bits: int, scale: float,
                       window: int | None = None):
  """The quantised slots' flash partials (o [B, K, Rq, H], m, l [B, K, Rq]) from the codes
  by the C++ kernel: scores, softmax terms and weighted values in one call, where
  dequantising first made XLA write and read a float32 copy of every layer."""
  return cpu_kernels.quant_partials(q, q_pos, length, k_codes, v_codes, bits=bits,
                                    scale=scale, window=window)


# --- the greedy choice -------------------------------------------------------------------


def _greedy_kernel(logits: jax.Array) -> bool:
  """A step's few float32 rows (up to FEW_ROWS: the kernel runs on one thread, where XLA's
  reductions split many rows over all of them) on a CPU, the kernel built."""
  return (logits.dtype == jnp.float32 and logits.ndim >= 1 and logits.shape[-1] > 0
          and math.prod(logits.shape[:-1]) <= FEW_ROWS
          and _cpu_kernel("f32_argmax", logits))


def argmax(logits: jax.Array) -> jax.Array:
  """`jnp.argmax(logits, axis=-1)` as int32: the first maximum, or the first NaN."""
  if _greedy_kernel(logits):
    return cpu_kernels.f32_argmax(jax.lax.stop_gradient(logits))[0]  # piecewise constant
  return _argmax_xla(logits)


def top_probability(logits: jax.Array) -> jax.Array:
  """max(softmax(logits)) over the last axis, which is 1 / Σ exp(logits - max): two passes
  over the logits instead of a softmax's three and a third reduction."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  return 1.0 / jnp.sum(jnp.exp(logits - top), axis=-1)


def argmax_and_top_probability(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(`argmax`, `top_probability`) of logits[..., V]: a draft's greedy token and its
  confidence, in one kernel call per step on a CPU."""
  if _greedy_kernel(logits):
    return _argmax_and_top_kernel(logits)
  return _argmax_xla(logits), top_probability(logits)


def _argmax_xla(logits: jax.Array) -> jax.Array:
  """`jnp.argmax` in two plain reductions (the max, then the first index that holds it or
  a NaN), which XLA:CPU vectorises; its variadic (value, index) reduce does not. Same
  answer, ties and NaNs included (`tests/test_sampling.py` holds it equal)."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
  hit = (logits == top) | jnp.isnan(logits)
  return jnp.min(jnp.where(hit, ids, logits.shape[-1]), axis=-1)


@jax.custom_jvp
def _argmax_and_top_kernel(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  return cpu_kernels.f32_argmax(logits, probability=True)


@_argmax_and_top_kernel.defjvp
def _argmax_and_top_jvp(primals, tangents):
  """The kernel does not differentiate: the probability's tangent is XLA's expression's."""
  (logits,), (dlogits,) = primals, tangents
  ids, p = _argmax_and_top_kernel(logits)
  _, dp = jax.jvp(top_probability, (logits,), (dlogits,))
  return (ids, p), (np.zeros(ids.shape, jax.dtypes.float0), dp)
