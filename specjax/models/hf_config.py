"""A Hugging Face `config.json` -> `ModelConfig`, every field that changes the math read.

Families: Llama 2 / 3 / 3.1 / 3.2 (`llama`), Mistral (`mistral`, a llama with an optional
sliding window on every layer), Qwen2 / 2.5 (`qwen2`: q/k/v biases), Qwen3 (`qwen3`:
q/k norms, its own head_dim) and Gemma 3's text model (`gemma3_text`: local and global
layers with a rope each, post-norms, a query scale of its own). Both config layouts are
read: the hub's (`rope_theta`, `rope_scaling`, `rope_local_base_freq`,
`sliding_window_pattern`) and transformers 5's (`rope_parameters`, per layer type for
Gemma 3, and `layer_types`).

A field whose value this decoder does not compute (soft-capping, biases on the output
projection or the MLP, rope scalings other than linear and llama3, partial rotary,
bidirectional attention ...) is refused by name rather than ignored: a model that loads
must compute what its checkpoint was trained to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specjax.config import ModelConfig, RopeScaling
from specjax.errors import SpecjaxError

# config.json `model_type` -> specjax family
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3"}
SUPPORTED = ("Llama 2 / 3 / 3.1 / 3.2 (llama), Mistral (mistral), Qwen2 / 2.5 (qwen2), "
             "Qwen3 (qwen3), Gemma 3 text (gemma3_text)")
# transformers' default of `tie_word_embeddings` per family, where config.json omits it
_TIED_BY_DEFAULT = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False,
                    "gemma3_text": True}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class UnsupportedArchitectureError(SpecjaxError, ValueError):
  """A checkpoint whose architecture, or one of whose settings, specjax does not compute."""


def read_folder(folder: Path) -> ModelConfig:
  """The config of a checkpoint folder: its config.json, and generation_config.json's EOS
  ids when there is one."""
  read = lambda name: json.loads((folder / name).read_text()) if (folder / name).is_file() \
      else {}
  return config_from_hf(read("config.json"), read("generation_config.json"),
                        where=str(folder / "config.json"))


def config_from_hf(cfg: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                   *, where: str = "config.json") -> ModelConfig:
  """The `ModelConfig` of a Hugging Face config (`generation`: its generation_config.json,
  whose EOS ids join the config's)."""
  model_type = cfg.get("model_type")
  if model_type == "gemma3" and "text_config" in cfg:
    raise UnsupportedArchitectureError(
        f"{where}: a Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration); "
        f"specjax reads Gemma 3's text models (gemma3_text: gemma-3-270m, gemma-3-1b). "
        f"Supported: {SUPPORTED}")
  if model_type not in FAMILIES:
    arch = ", ".join(cfg.get("architectures") or []) or "no architectures field"
    raise UnsupportedArchitectureError(
        f"{where}: model_type {model_type!r} ({arch}) is not supported. Supported: "
        f"{SUPPORTED}")
  arch = FAMILIES[model_type]
  refuse = _Refuser(cfg, where, model_type)
  refuse.unless("partial_rotary_factor", (None, 1, 1.0))
  refuse.unless("mlp_bias", (None, False))
  refuse.unless("use_bidirectional_attention", (None, False))
  refuse.unless("final_logit_softcapping", (None,))
  refuse.unless("attn_logit_softcapping", (None,))
  if arch in ("llama", "qwen3"):  # a bias on q/k/v and o alike; specjax has none on o
    refuse.unless("attention_bias", (None, False))
  if arch in ("qwen2", "qwen3"):
    refuse.unless("use_sliding_window", (None, False))
  act = cfg.get("hidden_activation") or cfg.get("hidden_act") or (
      "gelu_pytorch_tanh" if arch == "gemma3" else "silu")
  if act not in _ACTIVATIONS or (arch == "gemma3") != (act == "gelu_pytorch_tanh"):
    refuse.value("hidden_act", act, "silu (llama, mistral, qwen) or gelu_pytorch_tanh "
                 "(gemma3)")
  D, N = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
  L = _int(cfg, "num_hidden_layers", where)
  head_dim = cfg.get("head_dim") or D // N
  eos = _ids(cfg.get("eos_token_id")) | _ids((generation or {}).get("eos_token_id"))
  common = dict(
      arch=arch, num_layers=L, embed_dim=D, hidden_dim=_int(cfg, "intermediate_size", where),
      num_heads=N, num_kv_heads=int(cfg.get("num_key_value_heads") or N),
      head_dim=int(head_dim), vocab_size=_int(cfg, "vocab_size", where),
      norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      max_context=int(cfg.get("max_position_embeddings", 8192)),
      tie_embeddings=bool(cfg.get("tie_word_embeddings", _TIED_BY_DEFAULT[model_type])),
      bos_id=_opt_int(cfg.get("bos_token_id")), eos_ids=tuple(sorted(eos)),
      activation=_ACTIVATIONS[act])
  if arch == "gemma3":
    return _gemma3(cfg, refuse, common, L)
  base, scaling = _rope(cfg, cfg.get("rope_parameters") or {}, refuse)
  window = cfg.get("sliding_window") if model_type == "mistral" else None
  return ModelConfig(**common, rope_base=base, rope_scaling=scaling,
                     qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                     sliding_window=None if window is None else int(window))


def _gemma3(cfg, refuse: _Refuser, common: dict, L: int) -> ModelConfig:
  """Gemma 3: local (sliding) layers and global ones, each kind with its own rope."""
  window = _int(cfg, "sliding_window", "config.json")
  kinds = cfg.get("layer_types")
  if kinds is None:
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    kinds = ["full_attention" if (l + 1) % pattern == 0 else "sliding_attention"
             for l in range(L)]
  global_every = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0
  expected = ["full_attention" if global_every and (l + 1) % global_every == 0
              else "sliding_attention" for l in range(L)]
  if list(kinds) != expected:
    refuse.value("layer_types", kinds, "a global layer every n-th layer, the others sliding")
  params = cfg.get("rope_parameters") or {}
  if "full_attention" in params:  # transformers 5: a rope per layer type
    base, scaling = _rope(cfg, params["full_attention"], refuse)
    local, local_scaling = _rope(cfg, params.get("sliding_attention", {}), refuse)
    if local_scaling is not None:
      refuse.value("rope_parameters.sliding_attention", params["sliding_attention"],
                   "no scaling on the local layers")
  else:
    base, scaling = _rope(cfg, params, refuse)
    local = float(cfg.get("rope_local_base_freq", 10_000.0))
  scalar = cfg.get("query_pre_attn_scalar") or common["head_dim"]
  return ModelConfig(**common, rope_base=base, rope_local_base=local, rope_scaling=scaling,
                     qk_norm=True, post_norms=True, embed_scale=True, sliding_window=window,
                     global_every=global_every, query_scale=float(scalar) ** -0.5)


def _rope(cfg, params: Mapping, refuse: _Refuser) -> tuple[float, RopeScaling | None]:
  """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` and
  `rope_scaling` (the hub's configs)."""
  theta = float(params.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
  scaling = dict(params) if "rope_type" in params else dict(cfg.get("rope_scaling") or {})
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind not in ("linear", "llama3"):
    refuse.value("rope_scaling", scaling, "none (default), linear or llama3")
  return theta, RopeScaling(
      kind=kind, factor=float(scaling["factor"]),
      low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
      high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
      original_max_position=int(scaling.get("original_max_position_embeddings", 8192)))


class _Refuser:
  """Refusals that name the file, the family, the field and what is supported."""

  def __init__(self, cfg: Mapping, where: str, model_type: str):
    self.cfg, self.where, self.model_type = cfg, where, model_type

  def unless(self, key: str, allowed: tuple) -> None:
    if self.cfg.get(key) not in allowed:
      self.value(key, self.cfg.get(key), " or ".join(map(repr, allowed)))

  def value(self, key: str, value, supported: str) -> None:
    raise UnsupportedArchitectureError(
        f"{self.where}: {self.model_type} with {key} = {value!r} is not supported "
        f"(specjax computes {supported})")


def _int(cfg: Mapping, key: str, where: str) -> int:
  if cfg.get(key) is None:
    raise UnsupportedArchitectureError(f"{where}: no {key!r}, which every supported "
                                       f"architecture sets")
  return int(cfg[key])


def _ids(value) -> set[int]:
  if value is None:
    return set()
  return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _opt_int(value) -> int | None:
  return None if value is None else int(value)
