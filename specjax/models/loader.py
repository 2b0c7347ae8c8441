"""`load_model(source)`: a registered name, a GGUF file or a Hugging Face checkpoint (a
folder or a hub id, `source.resolve`) -> config, params and tokenizer.

GGUF files are dequantised to float32 once and the params cached with orbax (keyed by the
file's fingerprint) for fast reloads; a checkpoint folder's safetensors are streamed
tensor by tensor to the device in the requested dtype (`hf_checkpoint`)."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from specjax import ops, sharding
from specjax.config import ModelConfig
from specjax.errors import ConfigError
from specjax.gguf_matrix import GGUFMatrix
from specjax.model import Transformer
from specjax.models import checkpoint
from specjax.models import gguf as gguf_weights
from specjax.models.hf_checkpoint import hf_names, load_state
from specjax.models.hf_config import read_folder
from specjax.models.params import abstract_model, fuse_projections, param_shapes, state_from_flat
from specjax.models.registry import get_spec
from specjax.models.safetensors_file import Checkpoint
from specjax.models.source import Source, resolve
from specjax.models.tiny import tiny_model
from specjax.models.tokenizer import (
  ByteTokenizer,
  TextTokenizer,
  tokenizer_from_folder,
  tokenizer_from_gguf,
)
from specjax.storage import cache_root

CONVERTER_VERSION = 4  # bump when the GGUF -> params conversion changes (3: gate_up [O, I]; 4: qkv [O, I])


@dataclasses.dataclass
class LoadedModel:
  """A model ready to run: static config, NNX graph + state, tokenizer; `key` names its
  artefacts (`source.artefact_key`), `source` says where its weights came from."""

  name: str
  config: ModelConfig
  graphdef: nnx.GraphDef
  state: nnx.State
  tokenizer: TextTokenizer | ByteTokenizer
  key: str = ""
  source: Source | None = None
  mesh: Mesh | None = None  # the devices it is split over (`load_model(tensor_parallel=N)`)

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
  accelerator, though only it is token-exact there: it makes verification cost half as
  much again as in bfloat16 (docs/GPU.md)."""
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


def load_model(source: str | Path, *, dtype=None, revision: str | None = None,
               verbose: bool = True, tensor_parallel: int | None = None,
               mesh: Mesh | None = None) -> LoadedModel:
  """Load a model from `source` (a registered name, a .gguf file, a Hugging Face folder or
  hub id at `revision`: `source.resolve`) with weights in `dtype` (default:
  `default_dtype()`, bfloat16 on an accelerator and float32 on a CPU; its activations and
  KV cache follow, but for "mixed": bfloat16 weights computed in float32, and "gguf": a
  GGUF file's own blocks, computed in float32 on a CPU, `with_gguf_blocks`).

  `tensor_parallel=N` splits it over the first N devices (`sharding.make_mesh`), or `mesh`
  over a mesh of your own whose one axis is `sharding.AXIS`; `generate` and
  `speculative_generate` then run every step on that mesh."""
  if tensor_parallel is not None and mesh is None and tensor_parallel > 1:
    mesh = sharding.make_mesh(tensor_parallel)  # before loading: a mesh that cannot be is refused
  if mesh is not None and mesh.size > 1 and dtype == GGUF:
    raise ConfigError("--dtype gguf reads a GGUF file's blocks through C++ kernels, which see "
                      "one device's buffer: it runs on one CPU, not over --tensor-parallel")
  m = _load_placed(source, dtype, revision, verbose)
  if mesh is None or mesh.size == 1:
    return m
  if sharding.AXIS not in mesh.axis_names:
    raise ConfigError(f"a model is split over a mesh axis named {sharding.AXIS!r}; this "
                      f"mesh has {mesh.axis_names}")
  graphdef, state = sharding.place(m.graphdef, m.state, mesh)
  return dataclasses.replace(m, graphdef=graphdef, state=state, mesh=mesh)


def _load_placed(source, dtype, revision, verbose) -> LoadedModel:
  src = resolve(source, revision)
  weights = resolve_dtype(dtype) if dtype is None or isinstance(dtype, str) else dtype
  if src.kind == "folder":
    if dtype == GGUF:
      raise ConfigError(f"--dtype gguf computes over a GGUF file's blocks; {src.name} is a "
                        f"safetensors checkpoint: choose float32, bfloat16 or mixed")
    m = _load_folder(src, weights, verbose)
  else:
    m = _load(src, weights, verbose)
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
  why = ops.blocks_unavailable()
  if why:
    raise ConfigError(f"--dtype gguf needs a CPU backend and the gguf_matmul kernel ({why})")
  if m.source is None or m.source.is_tiny or m.source.kind == "folder":  # no GGUF file
    blocks = quantized_blocks(m.state, m.config, GGUFMatrix.KIND_Q8_0)
  else:
    reader = gguf_weights.open_gguf(*m.source.gguf_files())
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


def _load(src: Source, dtype, verbose: bool) -> LoadedModel:
  if src.is_tiny:
    # Trained on first use (about 20 s on 2 cores), then read from the cache.
    config, graphdef, state = tiny_model(get_spec(src.name).arch,
                                         vocab_size=ByteTokenizer.vocab_size)
    state = jax.tree.map(lambda x: x.astype(dtype), state)
    return LoadedModel(src.name, config, graphdef, state, ByteTokenizer(), src.key, src)
  files = src.gguf_files()
  key = src.key
  cache_dir = cache_root() / "params" / f"{key}-v{CONVERTER_VERSION}-{jnp.dtype(dtype).name}"
  config = _cached_config(cache_dir)
  if config is not None:
    try:
      flat = checkpoint.restore_tree(cache_dir, param_shapes(config, dtype))
      tok = TextTokenizer.load(cache_dir)
      graphdef, state = state_from_flat(config, flat.items(), dtype)
      return LoadedModel(src.name, config, graphdef, state, tok, key, src)
    except Exception as err:  # any damage: rebuild from the GGUF rather than crash
      print(f"specjax: cached params at {cache_dir} are unusable ({err}); rebuilding from "
            f"{files[0].name}", file=sys.stderr)
      shutil.rmtree(cache_dir, ignore_errors=True)
  m = _convert(src.name, files, cache_dir, dtype, verbose)
  return dataclasses.replace(m, key=key, source=src)


def _load_folder(src: Source, dtype, verbose: bool) -> LoadedModel:
  """A Hugging Face checkpoint folder, its safetensors streamed to the device."""
  folder = src.path
  config = read_folder(folder)
  tok = tokenizer_from_folder(folder)
  ckpt = Checkpoint(folder)
  bar = tqdm(total=len(hf_names(config)), desc=f"loading {src.name}", unit="tensor",
             disable=not verbose)
  config, graphdef, state = load_state(config, ckpt, dtype, progress=bar.update)
  bar.close()
  if not config.eos_ids and tok.special.get("eos_token"):
    eos = tok.token_id(tok.special["eos_token"])
    config = dataclasses.replace(config, eos_ids=() if eos is None else (eos,))
  return LoadedModel(src.name, config, graphdef, state, tok, src.key, src)


def _cached_config(cache_dir: Path) -> ModelConfig | None:
  try:
    meta = checkpoint.load_meta(cache_dir)
    return ModelConfig.from_dict(meta["config"])
  except (checkpoint.CheckpointError, KeyError, TypeError):
    return None


def _convert(name: str, files: tuple[Path, ...], cache_dir: Path, dtype, verbose: bool
             ) -> LoadedModel:
  path = files[0]
  reader = gguf_weights.open_gguf(*files)
  config = gguf_weights.config_from_gguf(path, reader)
  tensors = tqdm(
      gguf_weights.iter_params(path, config, reader),
      total=len(reader.tensors),
      desc=f"converting {name}",
      unit="tensor",
      disable=not verbose,
  )
  graphdef, state = state_from_flat(config, fuse_projections(tensors), dtype)
  tok = tokenizer_from_gguf(reader)
  flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
  checkpoint.save_tree(cache_dir, flat, {"config": config.to_dict(),
                                         "gguf": [str(f) for f in files]})
  tok.save(cache_dir)
  return LoadedModel(name, config, graphdef, state, tok)
