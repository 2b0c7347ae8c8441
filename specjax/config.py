"""Model configuration: one decoder, four architecture families selected by flags.

The families differ only in a handful of switches (biases, q/k norms, extra norms,
activation, embedding scale, sliding-window pattern, RoPE layout), so one `Transformer`
covers them all and every drafter works on every family unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from specjax.errors import ConfigError

Arch = Literal["llama", "qwen2", "qwen3", "gemma3"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How a checkpoint stretches its rotary frequencies past the context it was trained at.

  "linear" divides every frequency by `factor` (Gemma 3's global layers at 4B and up).
  "llama3" (Llama 3.1 and later) divides only the low frequencies, whose wavelengths are
  longer than `original_max_position / low_freq_factor`, keeps the high ones (wavelengths
  below `original_max_position / high_freq_factor`) and blends linearly between, so the
  model sees nearby tokens as it did in training and stretches only the slow angles."""

  kind: Literal["linear", "llama3"]
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    if self.kind not in ("linear", "llama3"):
      raise ConfigError(f"rope scaling {self.kind!r}: linear and llama3 are supported")
    if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
      raise ConfigError(f"rope scaling needs factor > 0 and high_freq_factor > "
                        f"low_freq_factor, got {self}")

  def apply(self, inv_freq: np.ndarray) -> np.ndarray:
    """The scaled frequencies (float64) of unscaled ones `inv_freq`."""
    if self.kind == "linear":
      return inv_freq / self.factor
    wavelength = 2 * np.pi / inv_freq
    slow = wavelength > self.original_max_position / self.low_freq_factor
    fast = wavelength < self.original_max_position / self.high_freq_factor
    # 0 at the slow end of the blend, 1 at the fast end
    t = ((self.original_max_position / wavelength - self.low_freq_factor)
         / (self.high_freq_factor - self.low_freq_factor))
    blended = (1 - t) * inv_freq / self.factor + t * inv_freq
    return np.where(slow, inv_freq / self.factor, np.where(fast, inv_freq, blended))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder. Hashable, so it can be a jit static argument."""

  arch: Arch
  num_layers: int  # L
  embed_dim: int  # D
  hidden_dim: int  # MLP inner width
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  vocab_size: int  # V
  norm_eps: float = 1e-6
  rope_base: float = 10_000.0
  rope_local_base: float = 10_000.0  # gemma3 sliding-window layers
  rope_interleaved: bool = False  # llama GGUF keeps Meta's interleaved q/k layout
  rope_scaling: RopeScaling | None = None  # of the global layers' frequencies
  qkv_bias: bool = False  # qwen2
  qk_norm: bool = False  # qwen3, gemma3
  post_norms: bool = False  # gemma3: norm after attention and after the MLP too
  activation: Literal["silu", "gelu_tanh"] = "silu"
  embed_scale: bool = False  # gemma3 multiplies embeddings by sqrt(D)
  tie_embeddings: bool = True
  sliding_window: int | None = None
  global_every: int = 0  # gemma3: layer i is global iff (i + 1) % global_every == 0
  query_scale: float | None = None  # softmax scale; None means head_dim ** -0.5
  max_context: int = 8192
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  # The dtype activations and the KV cache are computed in; None: the weights' dtype.
  # "float32" over bfloat16 weights (`--dtype mixed`): a step still reads 2-byte weights,
  # but no activation is rounded to bfloat16, so a verification forward's logits match
  # the AR step's to float32 rounding, and greedy SSD stays token for token equal to AR
  # on real models (bfloat16 activations turn the dot's row-count-dependent rounding into
  # logit differences of up to 0.8 on SmolLM2: docs/decisions/gpu.md, G3).
  activation_dtype: str | None = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")

  def to_dict(self) -> dict:
    """Plain JSON-ready fields (`from_dict` reads them back)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, fields: dict) -> ModelConfig:
    fields = dict(fields)
    fields["eos_ids"] = tuple(fields.get("eos_ids", ()))
    if fields.get("rope_scaling") is not None:
      fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return cls(**fields)

  @property
  def num_sublayers(self) -> int:
    """2L: one attention and one MLP sub-layer per layer."""
    return 2 * self.num_layers

  def is_sliding(self, layer: int) -> bool:
    """True for the local (sliding-window) attention layers."""
    if self.sliding_window is None:
      return False
    if self.global_every <= 0:
      return True
    return (layer + 1) % self.global_every != 0

  def is_local(self, layer: int) -> bool:
    """A gemma3-style local layer: sliding, beside global ones, with a rope of its own. A
    model whose every layer slides (Mistral 7B v0.1) has one rope for all of them."""
    return self.global_every > 0 and self.is_sliding(layer)

  def layer_rope_base(self, layer: int) -> float:
    return self.rope_local_base if self.is_local(layer) else self.rope_base

  def layer_rope_scaling(self, layer: int) -> RopeScaling | None:
    return None if self.is_local(layer) else self.rope_scaling

  @property
  def scale(self) -> float:
    return self.query_scale if self.query_scale is not None else self.head_dim**-0.5


def tiny_config(arch: Arch, *, num_layers: int = 4, vocab_size: int = 97) -> ModelConfig:
  """A small random-init config of each family, for fast tests."""
  common = dict(
      arch=arch,
      num_layers=num_layers,
      embed_dim=64,
      hidden_dim=128,
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      vocab_size=vocab_size,
      norm_eps=1e-6,
      max_context=512,
      bos_id=1,
      eos_ids=(2,),
  )
  if arch == "llama":
    return ModelConfig(**common, rope_interleaved=True, tie_embeddings=True)
  if arch == "qwen2":
    return ModelConfig(**common, rope_base=1e6, qkv_bias=True, tie_embeddings=False)
  if arch == "qwen3":
    return ModelConfig(**common, rope_base=1e6, qk_norm=True, tie_embeddings=True)
  if arch == "gemma3":
    return ModelConfig(
        **common,
        rope_base=1e6,
        rope_local_base=1e4,
        qk_norm=True,
        post_norms=True,
        activation="gelu_tanh",
        embed_scale=True,
        tie_embeddings=True,
        sliding_window=8,
        global_every=2,
    )
  raise ConfigError(f"unknown architecture {arch!r}; expected llama, qwen2, qwen3 or gemma3")
