"""`load_model(name)`: GGUF -> params + tokenizer, cached with orbax for fast reloads."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from specjax import cpu_kernels
from specjax.config import ModelConfig
from specjax.errors import ConfigError
from specjax.gguf_matrix import GGUFMatrix
from specjax.model import Transformer
from specjax.models import checkpoint
from specjax.models import gguf as gguf_weights
from specjax.models.params import abstract_model, fuse_projections, param_shapes, state_from_flat
from specjax.models.registry import cache_root, get_spec
from specjax.models.tiny import tiny_model
from specjax.models.tokenizer import ByteTokenizer, TextTokenizer, tokenizer_from_gguf

CONVERTER_VERSION = 4  # bump when the GGUF -> params conversion changes (3: gate_up [O, I]; 4: qkv [O, I])


@dataclasses.dataclass
class LoadedModel:
  """A model ready to run: static config, NNX graph + state, tokenizer."""

  name: str
  config: ModelConfig
  graphdef: nnx.GraphDef
  state: nnx.State
  tokenizer: TextTokenizer | ByteTokenizer

  @property
  def module(self) -> Transformer:
    return nnx.merge(self.graphdef, self.state)


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# bfloat16 weights, float32 activations and KV cache (`ModelConfig.activation_dtype`).
MIXED = "mixed"
# The GGUF file's own blocks for every matrix the `gguf_matmul` CPU kernel reads, computed
# in float32 (`gguf_matrix`); the rest of the model float32.
GGUF = "gguf"
DTYPE_CHOICES = ("auto", *DTYPES, MIXED, GGUF)


def default_dtype(backend: str | None = None):
  """bfloat16 on an accelerator (half the bytes a decode step reads); float32 on a CPU,
  where XLA's bfloat16 dots are slower than float32 ones (measured). Not `mixed` on an
  accelerator, though only it is token-exact there: on an H200 it made verification cost
  1.56-1.76 AR steps against 1.04-1.06 in bfloat16 (docs/BENCHMARKS.md, fourth lease)."""
  backend = backend or jax.default_backend()
  return jnp.float32 if backend == "cpu" else jnp.bfloat16


def resolve_dtype(name: str | None):
  """A `--dtype` value (`DTYPE_CHOICES`) or None -> the jnp dtype of the weights."""
  if name in (None, "auto"):
    return default_dtype()
  if name == MIXED:
    return jnp.bfloat16
  if name == GGUF:
    return jnp.float32
  if name not in DTYPES:
    raise ConfigError(f"unknown dtype {name!r}: choose {', '.join(DTYPE_CHOICES)}")
  return DTYPES[name]


def with_precision(config: ModelConfig, dtype) -> ModelConfig:
  """`config` computing in float32 when `dtype` is `MIXED`, else in its weights' dtype."""
  return dataclasses.replace(config, activation_dtype="float32" if dtype == MIXED else None)


def at_precision(config: ModelConfig, state: nnx.State, dtype: str
                 ) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """A model (config, state) at another `--dtype`, without reloading: the weights cast, and
  a graph definition whose modules hold the new config (they read its activation dtype)."""
  if dtype == GGUF or any(isinstance(v, GGUFMatrix) for v in _values(state)):
    raise ConfigError("a model's GGUF blocks are read from its file: load it again with "
                      "load_model(name, dtype=...) rather than recast it")
  weights = resolve_dtype(dtype)
  config = with_precision(config, dtype)
  graphdef, _ = abstract_model(config, weights)
  return config, graphdef, jax.tree.map(lambda x: x.astype(weights), state)


def load_model(name: str, *, dtype=None, verbose: bool = True) -> LoadedModel:
  """Load a registered model by name (see `specjax models`) with weights in `dtype`
  (default: `default_dtype()`; its activations and KV cache follow, but for "mixed":
  bfloat16 weights computed in float32, and "gguf": the file's own blocks, computed in
  float32 on a CPU, `with_gguf_blocks`)."""
  m = _load(name, resolve_dtype(dtype) if dtype is None or isinstance(dtype, str) else dtype,
            verbose)
  if dtype == GGUF:
    return with_gguf_blocks(m, verbose)
  if dtype != MIXED:
    return m
  config, graphdef, state = at_precision(m.config, m.state, MIXED)
  return dataclasses.replace(m, config=config, graphdef=graphdef, state=state)


def with_gguf_blocks(m: LoadedModel, verbose: bool = True) -> LoadedModel:
  """`m` (float32) with its matrices replaced by its GGUF file's blocks; a tiny model's,
  which has no file, quantised to Q8_0 by gguf-py. CPU only: elsewhere, or without a C++
  compiler, a `ConfigError` saying why."""
  why = cpu_kernels.unavailable("gguf_matmul")
  if why:
    raise ConfigError(f"--dtype gguf needs a CPU backend and the gguf_matmul kernel ({why})")
  spec = get_spec(m.name)
  if spec.is_tiny:
    blocks = quantized_blocks(m.state, m.config, GGUFMatrix.KIND_Q8_0)
  else:
    reader = gguf_weights.open_gguf(spec.locate())
    blocks = tqdm(gguf_weights.block_matrices(m.config, reader), desc=f"{m.name} blocks",
                  unit="matrix", disable=not verbose)
  return dataclasses.replace(m, state=with_values(m.state, blocks))


def with_values(state: nnx.State, values) -> nnx.State:
  """A copy of `state` with the parameters named in `values` ((params path, value) pairs)
  set to those values; `state` itself keeps its own. Names it lacks are passed over (a
  tied model has no lm_head for its file's output.weight)."""
  flat = dict(nnx.to_flat_state(jax.tree.map(lambda x: x, state)))  # new Variables
  by_name = {"/".join(map(str, path)): var for path, var in flat.items()}
  for target, value in values:
    if target in by_name:
      by_name[target].set_value(value)
  return nnx.from_flat_state(list(flat.items()))


def quantized_blocks(state: nnx.State, config: ModelConfig, kind: int):
  """(params path, `GGUFMatrix` of ggml type `kind`) for every matrix of `state`, quantised
  by gguf-py: the blocks a GGUF file of the model would hold (tests, tiny models)."""
  from specjax.quant import model_matrices

  for l, name, w in model_matrices(state, config.num_layers):
    group = "attn" if name in ("qkv", "o") else "mlp"
    yield f"blocks/{l}/{group}/{name}", GGUFMatrix.quantize(w.T, kind)
  yield "embedding", GGUFMatrix.quantize(state["embedding"].get_value(), kind)
  if "lm_head" in state:
    yield "lm_head", GGUFMatrix.quantize(state["lm_head"].get_value().T, kind)


def _values(state: nnx.State):
  return (var.get_value() for _, var in nnx.to_flat_state(state))


def _load(name: str, dtype, verbose: bool) -> LoadedModel:
  spec = get_spec(name)
  if spec.is_tiny:
    # Trained on first use (about 20 s on 2 cores), then read from the cache.
    config, graphdef, state = tiny_model(spec.arch, vocab_size=ByteTokenizer.vocab_size)
    state = jax.tree.map(lambda x: x.astype(dtype), state)
    return LoadedModel(name, config, graphdef, state, ByteTokenizer())
  path = spec.locate()
  cache_dir = cache_root() / "params" / f"{name}-{_fingerprint(path, dtype)}"
  config = _cached_config(cache_dir)
  if config is not None:
    try:
      flat = checkpoint.restore_tree(cache_dir, param_shapes(config, dtype))
      tok = TextTokenizer.load(cache_dir)
      graphdef, state = state_from_flat(config, flat.items(), dtype)
      return LoadedModel(name, config, graphdef, state, tok)
    except Exception as err:  # any damage: rebuild from the GGUF rather than crash
      print(f"specjax: cached params at {cache_dir} are unusable ({err}); rebuilding from "
            f"{path.name}", file=sys.stderr)
      shutil.rmtree(cache_dir, ignore_errors=True)
  return _convert(name, path, cache_dir, dtype, verbose)


def _fingerprint(path: Path, dtype) -> str:
  return f"v{CONVERTER_VERSION}-{path.stat().st_size}-{jnp.dtype(dtype).name}"


def _cached_config(cache_dir: Path) -> ModelConfig | None:
  try:
    meta = checkpoint.load_meta(cache_dir)
    cfg = meta["config"]
    cfg["eos_ids"] = tuple(cfg["eos_ids"])
    return ModelConfig(**cfg)
  except (checkpoint.CheckpointError, KeyError, TypeError):
    return None


def _convert(name: str, path: Path, cache_dir: Path, dtype, verbose: bool) -> LoadedModel:
  reader = gguf_weights.open_gguf(path)
  config = gguf_weights.config_from_gguf(path, reader)
  tensors = tqdm(
      gguf_weights.iter_params(path, config, reader),
      total=gguf_weights.num_tensors(path, reader),
      desc=f"converting {name}",
      unit="tensor",
      disable=not verbose,
  )
  graphdef, state = state_from_flat(config, fuse_projections(tensors), dtype)
  tok = tokenizer_from_gguf(reader)
  flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
  checkpoint.save_tree(cache_dir, flat, {"config": dataclasses.asdict(config), "gguf": str(path)})
  tok.save(cache_dir)
  return LoadedModel(name, config, graphdef, state, tok)
