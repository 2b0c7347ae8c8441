"""Tensor parallelism: a mesh of devices, where each parameter and each cache lives on it,
and the context every step runs in.

A model is placed on a one-axis mesh (`AXIS`, "tp") by one table of `PartitionSpec`s, one
rule per parameter (`RULES`); GSPMD (XLA's SPMD partitioner) then compiles each jitted
step for the mesh and inserts the collectives. The rules follow the Megatron split where
the shapes allow it, each weight read once per token across the devices:

- q/k/v and gate/up are sharded on their input dimension (D), so each device reads 1/N
  of them and XLA sums the partial products (one all-reduce): the fused rows [q | k | v]
  and [gate | up] do not fall on device boundaries by head, and their input dimension
  always divides;
- the output projection on its heads, down on its hidden dimension F, the embedding and
  an untied LM head on the vocabulary;
- norms and biases replicated.

A dimension that the device count does not divide is not split: the rule's next choice is
taken, else the parameter is replicated (as tpu-inference replicates kv heads when there
are fewer than devices). The KV caches are split on kv heads when the count divides, else
replicated (`cache_spec`). On a mesh `specjax.ops` takes XLA's ops (no C++ kernel ever
sees a shard), and `--dtype gguf`, whose blocks only those kernels read, is refused.

Multi-host: `jax.distributed.initialize()` first, then `make_mesh` over `jax.devices()`
(every process's); placement uses `jax.device_put`, which takes each process's share of
a global array, and nothing here reads a value back to the host.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.errors import ConfigError

AXIS = "tp"

# The last path element of a parameter -> the dimensions to split, in order of preference
# (the first that the device count divides); absent: replicated.
RULES: dict[str, tuple[int, ...]] = {
    "qkv": (1,),          # [(N + 2K)·H, D]: the input dimension
    "o": (0, 2),          # [N, H, D]: heads, else the output dimension
    "gate_up": (1,),      # [2F, D]: the input dimension
    "down": (0, 1),       # [F, D]: the hidden dimension, else D
    "embedding": (0, 1),  # [V, D]: the vocabulary, else D
    "lm_head": (1, 0),    # [D, V]: the vocabulary, else D
}


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


def param_spec(name: str, shape: tuple[int, ...], n: int) -> P:
  """Where a parameter named `name` (its path's last element) of `shape` lives on `n`
  devices: the first of its rule's dimensions that `n` divides, else nowhere split."""
  for dim in RULES.get(name, ()):
    if dim < len(shape) and shape[dim] % n == 0:
      return P(*(AXIS if d == dim else None for d in range(len(shape))))
  return P()


def place_state(state: nnx.State, mesh: Mesh) -> nnx.State:
  """`state` with every parameter put on `mesh` by its rule. Quantised formats are
  refused: they are read by C++ kernels (GGUF blocks), or are built from the placed float
  weights afterwards (the 8-bit and 4-bit draft copies)."""
  flat = list(nnx.to_flat_state(jax.tree.map(lambda x: x, state)))  # new Variables
  for path, var in flat:
    value = var.get_value()
    if not isinstance(value, jax.Array):
      raise ConfigError(f"{'/'.join(map(str, path))} is a {type(value).__name__}, which "
                        f"cannot be split over a mesh (--dtype gguf runs on one CPU only)")
    spec = param_spec(str(path[-1]), value.shape, mesh.size) if value.ndim >= 2 else P()
    var.set_value(jax.device_put(value, NamedSharding(mesh, spec)))
  return nnx.from_flat_state(flat)


def cache_spec(num_kv_heads: int, ndim: int = 4) -> P:
  """A cache array [B, K, ...] under the mesh in context: split on kv heads where their
  count divides the devices, else replicated (each device then holds every head)."""
  n = jax.sharding.get_abstract_mesh().size
  if n > 1 and num_kv_heads % n == 0:
    return P(None, AXIS, *([None] * (ndim - 2)))
  return P()


def place_cache(x: jax.Array, num_kv_heads: int) -> jax.Array:
  """A new cache array [B, K, ...] put where `cache_spec` says, when a mesh is set; as
  it is otherwise."""
  if jax.sharding.get_abstract_mesh().size <= 1:
    return x
  return jax.device_put(x, cache_spec(num_kv_heads, x.ndim))


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
