"""Params pytree <-> flat {"blocks/3/attn/q": array} dicts.

Every weight source (GGUF, HF state dicts in tests, the orbax cache) produces the flat
form; this module checks it against the model's abstract shapes and builds the NNX state.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.model import Transformer


class ParamsError(SpecjaxError, ValueError):
  """Missing, unexpected or mis-shaped weights."""


def abstract_model(config: ModelConfig, dtype=jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and shape-only state, without allocating weights.

  Tracing the init costs seconds on real models, so it is traced once per config; each
  call returns fresh Variable containers, safe to fill.
  """
  graphdef, state = _abstract_model(config, jnp.dtype(dtype))
  return graphdef, jax.tree.map(lambda x: x, state)


@functools.lru_cache(maxsize=8)
def _abstract_model(config: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
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


# Separate projections as checkpoints store them -> the fused parameter that holds them,
# in concatenation order and along which axis.
_FUSED = {
    "attn/qkv": (("attn/q", "attn/k", "attn/v"), 0),  # [heads·H, D] each: output-major
    "attn/qkv_bias": (("attn/q_bias", "attn/k_bias", "attn/v_bias"), 0),
    "mlp/gate_up": (("mlp/gate", "mlp/up"), 0),  # [F, D] each: output-major
}
_PART_OF = {part: (fused, i) for fused, (parts, _) in _FUSED.items() for i, part in enumerate(parts)}


def fuse_projections(arrays: Iterable[tuple[str, np.ndarray]]) -> Iterable[tuple[str, np.ndarray]]:
  """Concatenate q/k/v and gate/up as they stream past (as soon as a group is complete)."""
  pending: dict[str, dict[int, np.ndarray]] = {}
  for name, arr in arrays:
    for part, (fused, index) in _PART_OF.items():
      if name.endswith("/" + part):
        block = name[: -len(part)]
        group = pending.setdefault(block + fused, {})
        group[index] = arr
        parts, axis = _FUSED[fused]
        if len(group) == len(parts):
          yield block + fused, np.concatenate([group[i] for i in range(len(parts))], axis=axis)
          del pending[block + fused]
        break
    else:
      yield name, arr
  if pending:
    raise ParamsError(f"incomplete projection groups: {sorted(pending)[:3]}")
