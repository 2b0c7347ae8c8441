"""Token selection: greedy, temperature, top-p. Shared by AR decoding and SSD acceptance,
so both sample from exactly the same target distribution."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import ops
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
  one pass of a C++ kernel over each row (`ops.argmax` chooses)."""
  return ops.argmax(logits)


def top_probability(logits: jax.Array) -> jax.Array:
  """max(softmax(logits)) over the last axis (`ops.top_probability`)."""
  return ops.top_probability(logits)


def argmax_and_top_probability(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(`argmax`, `top_probability`) of logits[..., V]: a draft's greedy token and its
  confidence, in one kernel call per step on a CPU."""
  return ops.argmax_and_top_probability(logits)


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
