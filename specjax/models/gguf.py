"""GGUF file -> `ModelConfig` + params pytree (dequantised to float32).

GGUF stores every matrix as [out, in]. specjax keeps q/k/v and gate/up so (the few-row
CPU kernel streams their rows fastest: `model.Attention`, `model.MLP`) and transposes o to
[N, H, D] and down to [F, D] (as [out, in], down was slower at a verification's five rows
and o faster on one model, slower on the other: docs/decisions/cpu.md, C6). llama.cpp leaves the llama Q/K
rows in Meta's interleaved-RoPE order, so the llama config uses interleaved RoPE instead
of un-permuting; gemma3 norms are already stored as (1 + w).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import SpecjaxError
from specjax.gguf_matrix import KINDS, GGUFMatrix
from specjax.models.gguf_file import GGUFFile

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# Tokens that end a chat turn in the supported families, stopped on in addition to EOS.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<|eot_id|>")


class GGUFFormatError(SpecjaxError, ValueError):
  """The file is not a GGUF model specjax can load."""


def _reader(path: str | Path) -> GGUFFile:
  try:
    return GGUFFile(path)
  except (ValueError, OSError) as err:  # GGUFParseError, or an empty file mmap refuses
    raise GGUFFormatError(f"{path} is not a readable GGUF file: {err}") from err


def _field(reader: GGUFFile, key: str, default=None):
  return reader.fields.get(key, default)


def config_from_gguf(path: str | Path, reader=None) -> ModelConfig:
  """Build the `ModelConfig` from GGUF metadata."""
  reader = reader or _reader(path)
  arch = _field(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise GGUFFormatError(f"{path}: architecture {arch!r} is not one of {SUPPORTED_ARCHS}")
  p = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
  D, N = int(p("embedding_length")), int(p("attention.head_count"))
  tensor_names = {t.name for t in reader.tensors}
  tokens = _field(reader, "tokenizer.ggml.tokens", [])
  eos = _field(reader, "tokenizer.ggml.eos_token_id")
  eos_ids = {int(eos)} if eos is not None else set()
  eos_ids |= {i for i, t in enumerate(tokens) if t in _END_OF_TURN}
  common = dict(
      arch=arch,
      num_layers=int(p("block_count")),
      embed_dim=D,
      hidden_dim=int(p("feed_forward_length")),
      num_heads=N,
      num_kv_heads=int(p("attention.head_count_kv", N)),
      head_dim=int(p("attention.key_length", D // N)),
      vocab_size=len(tokens),
      norm_eps=float(p("attention.layer_norm_rms_epsilon", 1e-6)),
      rope_base=float(p("rope.freq_base", 10_000.0)),
      max_context=int(p("context_length", 8192)),
      tie_embeddings="output.weight" not in tensor_names,
      bos_id=_opt_int(_field(reader, "tokenizer.ggml.bos_token_id")),
      eos_ids=tuple(sorted(eos_ids)),
  )
  if arch == "llama":
    return ModelConfig(**common, rope_interleaved=True)
  if arch == "qwen2":
    return ModelConfig(**common, qkv_bias=True)
  if arch == "qwen3":
    return ModelConfig(**common, qk_norm=True)
  # gemma3: facts from the Gemma 3 report / HF config not stored in GGUF metadata.
  return ModelConfig(
      **common,
      qk_norm=True,
      post_norms=True,
      activation="gelu_tanh",
      embed_scale=True,
      sliding_window=int(p("attention.sliding_window", 512)),
      global_every=6,
      rope_local_base=10_000.0,
      query_scale=256**-0.5,  # query_pre_attn_scalar = 256
  )


def _opt_int(x) -> int | None:
  return None if x is None else int(x)


def _layer_map(config: ModelConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
  """GGUF tensor suffix -> (params path suffix, converter from the [out, in] matrix)."""
  D, N, K, H = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
  same = lambda w: w
  return {
      "attn_norm.weight": ("attn_norm/scale", same),
      "ffn_norm.weight": ("mlp_norm/scale", same),
      "post_attention_norm.weight": ("post_attn_norm/scale", same),
      "post_ffw_norm.weight": ("post_mlp_norm/scale", same),
      "attn_q_norm.weight": ("attn/q_norm/scale", same),
      "attn_k_norm.weight": ("attn/k_norm/scale", same),
      "attn_q.weight": ("attn/q", same),  # kept [out, in]: `model.Attention`
      "attn_k.weight": ("attn/k", same),  # kept [out, in]: `model.Attention`
      "attn_v.weight": ("attn/v", same),  # kept [out, in]: `model.Attention`
      "attn_q.bias": ("attn/q_bias", lambda b: b.reshape(N, H)),
      "attn_k.bias": ("attn/k_bias", lambda b: b.reshape(K, H)),
      "attn_v.bias": ("attn/v_bias", lambda b: b.reshape(K, H)),
      "attn_output.weight": ("attn/o", lambda w: w.reshape(D, N, H).transpose(1, 2, 0)),
      "ffn_gate.weight": ("mlp/gate", same),  # kept [out, in]: `model.MLP`
      "ffn_up.weight": ("mlp/up", same),
      "ffn_down.weight": ("mlp/down", lambda w: w.T),
  }


def iter_params(path: str | Path, config: ModelConfig, reader=None) -> Iterator[tuple[str, np.ndarray]]:
  """Yield (params path, float32 array) for every tensor, dequantised one at a time."""
  import gguf

  reader = reader or _reader(path)
  layer_map = _layer_map(config)
  for t in reader.tensors:
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    w = w.reshape(tuple(reversed(t.shape)))  # GGUF dims are [in, out]
    if t.name == "token_embd.weight":
      yield "embedding", w
    elif t.name == "output.weight":
      yield "lm_head", w.T
    elif t.name == "output_norm.weight":
      yield "final_norm/scale", w
    elif t.name.startswith("blk."):
      _, layer, suffix = t.name.split(".", 2)
      if suffix not in layer_map:
        raise GGUFFormatError(f"{path}: tensor {t.name} has no place in a {config.arch} model")
      target, convert = layer_map[suffix]
      yield f"blocks/{layer}/{target}", convert(w)
    elif t.name == "rope_freqs.weight":
      raise GGUFFormatError(f"{path}: rope frequency scaling is not supported")
    else:
      raise GGUFFormatError(f"{path}: unexpected tensor {t.name}")


# Matrices kept as the file's blocks under `--dtype gguf`: params path suffix -> the GGUF
# tensors whose output rows it concatenates (`params.fuse_projections`' order).
_BLOCK_MATRICES = {
    "attn/qkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "attn/o": ("attn_output.weight",),
    "mlp/gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "mlp/down": ("ffn_down.weight",),
}


def block_matrices(config: ModelConfig, reader: GGUFFile) -> Iterator[tuple[str, GGUFMatrix]]:
  """(params path, `GGUFMatrix`) for every matrix whose tensors are all of a type the
  `gguf_matmul` kernel reads; the others (float16 or float32 tensors, other quantisations)
  stay dense float32 parameters."""
  tensors = {t.name: t for t in reader.tensors}
  names = {"embedding": ("token_embd.weight",), "lm_head": ("output.weight",)}
  for l in range(config.num_layers):
    for suffix, parts in _BLOCK_MATRICES.items():
      names[f"blocks/{l}/{suffix}"] = tuple(f"blk.{l}.{p}" for p in parts)
  for target, parts in names.items():
    found = [tensors.get(p) for p in parts]
    if all(t is not None and int(t.tensor_type) in KINDS.values() for t in found):
      yield target, GGUFMatrix.from_rows(
          [(np.asarray(t.data), int(t.tensor_type)) for t in found])


def open_gguf(path: str | Path, *more: str | Path) -> GGUFFile | SplitGGUFFile:
  """The parsed GGUF file (memory-mapped), shared by config, weights and tokenizer readers;
  `GGUFFormatError` on a damaged layout, tensors past the end of the file included. With
  `more`, the files of a split set in order (llama.cpp's gguf-split), read as one."""
  if not more:
    return _reader(path)
  return SplitGGUFFile([_reader(p) for p in (path, *more)], [Path(p).name for p in (path, *more)])


class SplitGGUFFile:
  """The files of a split GGUF as one: the first file's metadata, every file's tensors.
  Each file says its place (`split.no`, `split.count`) and the first how many tensors the
  set holds (`split.tensors.count`): a file missing, repeated or out of order is refused."""

  def __init__(self, files: list[GGUFFile], names: list[str]):
    for i, (f, name) in enumerate(zip(files, names)):
      no, count = f.fields.get("split.no"), f.fields.get("split.count")
      if (no, count) != (i, len(files)):
        raise GGUFFormatError(f"{name} says it is split file {no} of {count}; as file {i} of "
                              f"{len(files)} it should say {i} of {len(files)}")
    self.fields = files[0].fields
    self.tensors = [t for f in files for t in f.tensors]
    want = self.fields.get("split.tensors.count")
    if want is not None and int(want) != len(self.tensors):
      raise GGUFFormatError(f"{names[0]}: the split set should hold {want} tensors, its "
                            f"{len(files)} files hold {len(self.tensors)}")
