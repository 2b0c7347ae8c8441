"""Tensor parallelism: a mesh of devices, where each parameter and each cache lives on it,
and the context every step runs in.

A model is placed on a one-axis mesh (`AXIS`, "tp") by one table of `PartitionSpec`s, one
rule per parameter (`RULES`); GSPMD (XLA's SPMD partitioner) then compiles each jitted
step for the mesh and inserts the collectives. The rules follow the Megatron split where
the shapes allow it, each weight read once per token across the devices:

- q/k/v on their heads and gate/up on F (column-parallel: no communication), the output
  projection on its heads and down on F (row-parallel: one all-reduce each), so a layer
  costs two all-reduces of the residual [B, T, D] and no weight moves;
- the embedding and an untied LM head on the vocabulary;
- norms and biases replicated.

The fused matrices hold [q | k | v] and [gate | up] one after the other, so an even split
of their rows would hand device 0 all of q. `place` therefore regroups their rows
(`group_rows`) into one block per device, [q_i | k_i | v_i] and [gate_i | up_i], and
tells the model so (the modules' `shards`, which `Attention.project` and `MLP` read to
split them again). Regrouping needs the kv heads (and F) to divide the devices; where
they do not (2 kv heads on 4 devices), those matrices are split on their input dimension
D instead: still correct, each weight still read once, but the partial sums then move
the activations between devices far more often (a test counts both).

A dimension that the device count does not divide is not split: the rule's next choice is
taken, else the parameter is replicated (as tpu-inference replicates kv heads when there
are fewer than devices). The KV caches are split on kv heads when the count divides, else
replicated (`cache_spec`). On a mesh `specjax.ops` takes XLA's ops (no C++ kernel ever
sees a shard), and `--dtype gguf`, whose blocks only those kernels read, is refused.

Multi-host: `jax.distributed.initialize()` first, then `make_mesh` over `jax.devices()`
(every process's). Each process loads the whole model and `put` keeps the shards of its
own devices; the decoders read back only replicated values (tokens, counts).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.errors import ConfigError

AXIS = "tp"

# The last path element of a parameter -> the dimensions to split, in order of preference
# (the first that the device count divides); absent: replicated.
RULES: dict[str, tuple[int, ...]] = {
    "qkv": (0, 1),        # [(N + 2K)·H, D]: the heads (rows regrouped), else the input D
    "o": (0, 2),          # [N, H, D]: heads, else the output dimension
    "gate_up": (0, 1),    # [2F, D]: the hidden dimension (rows regrouped), else D
    "down": (0, 1),       # [F, D]: the hidden dimension, else D
    "embedding": (0, 1),  # [V, D]: the vocabulary, else D
    "lm_head": (1, 0),    # [D, V]: the vocabulary, else D
}
# Fused matrices: their rows are split only once regrouped one block per device.
FUSED = ("qkv", "gate_up")


def make_mesh(tensor_parallel: int, devices=None) -> Mesh:
  """A one-axis mesh of `tensor_parallel` devices (default the first of `jax.devices()`),
  its axis automatic, so GSPMD propagates the parameters' shardings through each step."""
  devices = list(jax.devices() if devices is None else devices)
  if tensor_parallel < 1:
    raise ConfigError(f"--tensor-parallel must be at least 1, got {tensor_parallel}")
  if tensor_parallel > len(devices):
    raise ConfigError(
        f"--tensor-parallel {tensor_parallel} needs {tensor_parallel} devices; this process "
        f"sees {len(devices)} ({devices[0].platform}). On a CPU, "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel} (set before jax "
        f"starts) fakes them; across hosts, call jax.distributed.initialize() first.")
  return Mesh(np.asarray(devices[:tensor_parallel]), (AXIS,),
              axis_types=(jax.sharding.AxisType.Auto,))


def put(x, where: NamedSharding) -> jax.Array:
  """`x` (the same whole value in every process) laid out as `where` says. Across
  processes `jax.device_put` refuses devices this process cannot address, so each
  process builds the shards of its own devices from its copy instead (or, for an array
  that already spans the processes, moves it as one computation)."""
  if where.is_fully_addressable or not getattr(x, "is_fully_addressable", True):
    return jax.device_put(x, where)
  return jax.make_array_from_callback(x.shape, where, lambda index: x[index])


def param_spec(name: str, shape: tuple[int, ...], n: int, regrouped: bool = False) -> P:
  """Where a parameter named `name` (its path's last element) of `shape` lives on `n`
  devices: the first of its rule's dimensions that `n` divides, else nowhere split. The
  rows of a fused matrix are split only when `regrouped` (`group_rows`)."""
  for dim in RULES.get(name, ()):
    if name in FUSED and dim == 0 and not regrouped:
      continue
    if dim < len(shape) and shape[dim] % n == 0:
      return P(*(AXIS if d == dim else None for d in range(len(shape))))
  return P()


def group_rows(w: jax.Array, sizes: tuple[int, ...], shards: int) -> jax.Array:
  """The rows of `w`, parts of `sizes` rows one after the other ([q | k | v]), laid out as
  `shards` blocks that each hold 1/shards of every part ([q_0 | k_0 | v_0 | q_1 | ...]):
  split evenly, each device's rows are then whole heads of each. Each size must divide."""
  parts = jnp.split(w, np.cumsum(sizes)[:-1], axis=0)
  blocks = [p.reshape((shards, -1) + p.shape[1:]) for p in parts]
  return jnp.concatenate(blocks, axis=1).reshape(w.shape)


def shards_for(config, n: int) -> tuple[int, int]:
  """(attention's, the MLP's) regrouping on `n` devices: n where the kv heads (every
  device a whole group of query heads with its kv head) or F divide, else 1."""
  return (n if config.num_kv_heads % n == 0 else 1, n if config.hidden_dim % n == 0 else 1)


def place(graphdef: nnx.GraphDef, state: nnx.State, mesh: Mesh
          ) -> tuple[nnx.GraphDef, nnx.State]:
  """The model (graphdef, state) split over `mesh`: fused rows regrouped per device where
  the shapes allow (the graphdef records it), then every parameter put by its rule.
  Quantised formats are refused: GGUF blocks are read by C++ kernels only, and the 8-bit
  and 4-bit draft copies are built from the placed float weights afterwards."""
  for path, var in nnx.to_flat_state(state):
    if not isinstance(var.get_value(), jax.Array):
      raise ConfigError(f"{'/'.join(map(str, path))} is a {type(var.get_value()).__name__}, "
                        f"which cannot be split over a mesh (--dtype gguf runs on one CPU only)")
  model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new Variables
  config, n = model.config, mesh.size
  attn_shards, mlp_shards = shards_for(config, n)
  for what, count, shards in (("kv heads", config.num_kv_heads, attn_shards),
                              ("MLP hidden size", config.hidden_dim, mlp_shards)):
    if shards == 1 and n > 1:
      warnings.warn(f"the model's {count} {what} do not divide {n} devices: those matrices "
                    f"are split on their input dimension instead, which is correct but moves "
                    f"activations between devices at every layer; a mesh of a divisor of "
                    f"{count} devices avoids it", stacklevel=2)
  N, K, H, F = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_dim
  for block in model.blocks:
    if attn_shards > 1:
      block.attn.qkv.set_value(group_rows(block.attn.qkv.get_value(), (N * H, K * H, K * H),
                                          attn_shards))
      if config.qkv_bias:
        block.attn.qkv_bias.set_value(group_rows(block.attn.qkv_bias.get_value(), (N, K, K),
                                                 attn_shards))
    if mlp_shards > 1:
      block.mlp.gate_up.set_value(group_rows(block.mlp.gate_up.get_value(), (F, F),
                                             mlp_shards))
    block.attn.shards, block.mlp.shards = attn_shards, mlp_shards
  graphdef, state = nnx.split(model)
  flat = list(nnx.to_flat_state(state))
  regrouped = {"qkv": attn_shards > 1, "gate_up": mlp_shards > 1}
  for path, var in flat:
    value, name = var.get_value(), str(path[-1])
    spec = param_spec(name, value.shape, n, regrouped.get(name, False)) if value.ndim >= 2 \
        else P()
    var.set_value(put(value, NamedSharding(mesh, spec)))
  return graphdef, nnx.from_flat_state(flat)


# Parameters stored output-major ([Out, In]); the others are [In..., Out].
_OUTPUT_MAJOR = ("qkv", "gate_up", "embedding")


def place_copy(copy, parent: jax.Array, name: str):
  """A quantised copy of the parameter `name` (an `Int8Matrix` or `Int4Matrix`: arrays
  whose first axis is the outputs and whose second, if any, runs along the inputs),
  put along the axes its parent is split on: each device then reads the copy's share of
  the rows or columns its own share of the parent covers, and a draft's matmul needs the
  collectives the target's does. Unchanged off a mesh."""
  sharding = getattr(parent, "sharding", None)
  if not isinstance(sharding, NamedSharding) or sharding.mesh.size <= 1:
    return copy
  spec = tuple(sharding.spec) + (None,) * (parent.ndim - len(sharding.spec))
  out_first = name in _OUTPUT_MAJOR
  split_out = AXIS in (spec[:1] if out_first else spec[-1:])
  split_in = AXIS in (spec[1:] if out_first else spec[:-1])
  n = sharding.mesh.size

  def along(x):
    dims = [AXIS if split_out and x.shape[0] % n == 0 else None]
    if x.ndim > 1:
      dims.append(AXIS if split_in and x.shape[1] % n == 0 else None)
    return put(x, NamedSharding(sharding.mesh, P(*dims)))

  return jax.tree.map(along, copy)


def cache_spec(num_kv_heads: int, ndim: int = 4) -> P:
  """A cache array [B, K, ...] under the mesh in context: split on kv heads where their
  count divides the devices, else replicated (each device then holds every head)."""
  n = jax.sharding.get_abstract_mesh().size
  if n > 1 and num_kv_heads % n == 0:
    return P(None, AXIS, *([None] * (ndim - 2)))
  return P()


def cache_zeros(shape: tuple[int, ...], dtype, num_kv_heads: int) -> jax.Array:
  """A new cache array [B, K, ...] of zeros, made where `cache_spec` says when a mesh is
  set (each device writing only its own shard, across processes too)."""
  if jax.sharding.get_abstract_mesh().size <= 1:
    return jnp.zeros(shape, dtype)
  where = NamedSharding(jax.sharding.get_mesh(), cache_spec(num_kv_heads, len(shape)))
  return jnp.zeros(shape, dtype, device=where)


def mesh_of(tree) -> Mesh | None:
  """The mesh of more than one device that `tree`'s arrays live on, or None."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
      return sharding.mesh
  return None


@contextlib.contextmanager
def running_on(tree):
  """Run the enclosed steps under the mesh `tree` (a model's state) lives on, if any: the
  caches they create are placed on it, and `specjax.ops` keeps to XLA's ops. A mesh
  already set is kept."""
  mesh = mesh_of(tree)
  if mesh is None or jax.sharding.get_abstract_mesh().size > 1:
    yield
    return
  with jax.set_mesh(mesh):
    yield


def on_the_models_mesh(fn):
  """Decorate `fn(graphdef, state, ...)` (`generate`, `speculative_generate`) to run under
  the mesh `state` lives on, so a caller of a model loaded with `tensor_parallel` needs
  nothing more."""

  @functools.wraps(fn)
  def run(graphdef, state, *args, **kwargs):
    with running_on(state):
      return fn(graphdef, state, *args, **kwargs)

  return run


def bytes_per_device(tree) -> dict[int, int]:
  """Bytes of `tree`'s arrays held on each device (by device id), read from their shards:
  what placing a model on N devices saves each one."""
  out: dict[int, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in getattr(leaf, "addressable_shards", ()):
      out[shard.device.id] = out.get(shard.device.id, 0) + math.prod(shard.data.shape) * (
          shard.data.dtype.itemsize)
  return out
