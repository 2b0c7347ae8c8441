"""Token selection: greedy, temperature, top-p. Shared by AR decoding and SSD acceptance,
so both sample from exactly the same target distribution."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import cpu_kernels
from specjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static (hashable) sampling settings; temperature 0 means greedy."""

  temperature: float = 0.0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def argmax(logits: jax.Array) -> jax.Array:
  """`jnp.argmax(logits, axis=-1)` as int32: the first maximum, or the first NaN. On a CPU
  it is one pass of `cpu_kernels.f32_argmax` over each row (float32 logits)."""
  if _kernel_takes(logits):
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
  if _kernel_takes(logits):
    return _argmax_and_top_kernel(logits)
  return _argmax_xla(logits), top_probability(logits)


def _kernel_takes(logits: jax.Array) -> bool:
  """Whether the greedy choice over `logits` takes the CPU kernel: a step's few float32
  rows (up to `cpu_kernels.FEW_ROWS`: the kernel runs on one thread, where XLA's
  reductions split many rows over all of them) on a CPU backend, the kernel built."""
  return (logits.dtype == jnp.float32 and logits.ndim >= 1 and logits.shape[-1] > 0
          and math.prod(logits.shape[:-1]) <= cpu_kernels.FEW_ROWS
          and cpu_kernels.runs_here("f32_argmax"))


def _argmax_xla(logits: jax.Array) -> jax.Array:
  """`jnp.argmax` in two plain reductions (the max, then the first index that holds it or a
  NaN), which XLA:CPU vectorises; its variadic (value, index) reduce does not. Same answer,
  ties and NaNs included, several times faster on a CPU (`python -m
  experiments.bench_greedy`; `tests/test_sampling.py` holds it equal to `jnp.argmax`)."""
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


def probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """The distribution tokens are drawn from: softmax(logits / T), cut to the top-p nucleus.

  Greedy is the limit T -> 0: a one-hot on the argmax.
  """
  logits = logits.astype(jnp.float32)
  if params.greedy:
    return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
  p = jax.nn.softmax(logits / params.temperature, axis=-1)
  if params.top_p < 1.0:
    p = _nucleus(p, params.top_p)
  return p


def _nucleus(p: jax.Array, top_p: float) -> jax.Array:
  """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
  sorted_p = jnp.sort(p, axis=-1)[..., ::-1]
  mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
  kept = jnp.where(mass_before < top_p, sorted_p, jnp.inf)
  threshold = jnp.min(kept, axis=-1, keepdims=True)  # smallest kept probability
  p = jnp.where(p >= threshold, p, 0.0)
  return p / jnp.sum(p, axis=-1, keepdims=True)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
  """One token id per row of logits[..., V]."""
  if params.greedy:
    return argmax(logits)
  p = probs(logits, params)
  return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)
