"""Params pytree <-> flat {"blocks/3/attn/q": array} dicts.

Every weight source (GGUF, HF state dicts in tests, the orbax cache) produces the flat
form; this module checks it against the model's abstract shapes and builds the NNX state.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ModelConfig
from specjax.model import Transformer


class ParamsError(ValueError):
  """Missing, unexpected or mis-shaped weights."""


def abstract_model(config: ModelConfig, dtype=jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and shape-only state, without allocating weights."""
  return nnx.split(nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0), dtype)))


def _key(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def param_shapes(config: ModelConfig, dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
  _, state = abstract_model(config, dtype)
  return {
      _key(path): jax.ShapeDtypeStruct(var.shape, var.dtype)
      for path, var in nnx.to_flat_state(state)
  }


def state_from_flat(
    config: ModelConfig, arrays: Iterable[tuple[str, np.ndarray]], dtype=jnp.float32
) -> tuple[nnx.GraphDef, nnx.State]:
  """Place named arrays into the model's state, checking names and shapes."""
  graphdef, state = abstract_model(config, dtype)
  flat = nnx.to_flat_state(state)
  expected = {_key(path): var for path, var in flat}
  seen = set()
  for name, arr in arrays:
    if name not in expected:
      raise ParamsError(f"unexpected weight {name!r} for a {config.arch} model")
    var = expected[name]
    if tuple(arr.shape) != tuple(var.shape):
      raise ParamsError(f"weight {name!r} has shape {arr.shape}, expected {var.shape}")
    var.set_value(jnp.asarray(arr, dtype))
    seen.add(name)
  missing = sorted(set(expected) - seen)
  if missing:
    raise ParamsError(f"missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
  return graphdef, nnx.from_flat_state(flat)


def flat_from_state(state: nnx.State) -> dict[str, jax.Array]:
  return {_key(path): var.get_value() for path, var in nnx.to_flat_state(state)}
