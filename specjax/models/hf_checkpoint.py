"""A Hugging Face checkpoint folder's weights -> the model's state, a tensor at a time.

Every tensor's name and shape is checked against the config before one byte of weights
is read, so a folder of another model, or missing a shard, fails at once and by name.
Then each tensor is read (`safetensors_file`), converted to specjax's layout and put on
the device in the requested dtype before the next is read: q/k/v and gate/up are joined
layer by layer (`params.fuse_projections`), so the host holds at most one layer's
projections and never a float32 copy of the model.

Layouts: HF linear weights are [out, in]. specjax keeps q/k/v and gate/up so, and o as
[N, H, D] and down as [F, D]. HF's rotary layout is NeoX's (halves), so the config runs
`rope_interleaved=False`. Gemma 3 stores its norms as w and multiplies by (1 + w); specjax
stores the multiplier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.models.params import fuse_projections, state_from_flat
from specjax.models.safetensors_file import Checkpoint, CheckpointFolderError


def hf_names(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str, object]]:
  """HF tensor name -> (its shape, the specjax parameter it feeds, the conversion from
  HF's layout), in the order the model is built: embedding, layer by layer, head."""
  D, N, K, H, F = (config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.hidden_dim)
  same = lambda w: w
  norm = _gemma_norm if config.arch == "gemma3" else same
  out = {"model.embed_tokens.weight": ((config.vocab_size, D), "embedding", same)}
  for l in range(config.num_layers):
    p, b = f"model.layers.{l}.", f"blocks/{l}/"
    out[p + "input_layernorm.weight"] = ((D,), b + "attn_norm/scale", norm)
    for name, heads in (("q", N), ("k", K), ("v", K)):
      out[p + f"self_attn.{name}_proj.weight"] = ((heads * H, D), b + f"attn/{name}", same)
      if config.qkv_bias:
        out[p + f"self_attn.{name}_proj.bias"] = ((heads * H,), b + f"attn/{name}_bias",
                                                  _heads(heads, H))
    if config.qk_norm:
      out[p + "self_attn.q_norm.weight"] = ((H,), b + "attn/q_norm/scale", norm)
      out[p + "self_attn.k_norm.weight"] = ((H,), b + "attn/k_norm/scale", norm)
    out[p + "self_attn.o_proj.weight"] = ((D, N * H), b + "attn/o", _o_layout(N, H))
    if config.post_norms:
      out[p + "post_attention_layernorm.weight"] = ((D,), b + "post_attn_norm/scale", norm)
      out[p + "pre_feedforward_layernorm.weight"] = ((D,), b + "mlp_norm/scale", norm)
      out[p + "post_feedforward_layernorm.weight"] = ((D,), b + "post_mlp_norm/scale", norm)
    else:
      out[p + "post_attention_layernorm.weight"] = ((D,), b + "mlp_norm/scale", norm)
    out[p + "mlp.gate_proj.weight"] = ((F, D), b + "mlp/gate", same)
    out[p + "mlp.up_proj.weight"] = ((F, D), b + "mlp/up", same)
    out[p + "mlp.down_proj.weight"] = ((D, F), b + "mlp/down", _transposed)
  out["model.norm.weight"] = ((D,), "final_norm/scale", norm)
  if not config.tie_embeddings:
    out["lm_head.weight"] = ((config.vocab_size, D), "lm_head", _transposed)
  return out


def _gemma_norm(w: np.ndarray) -> np.ndarray:
  return (1.0 + w.astype(np.float32)).astype(w.dtype)


def _heads(heads: int, H: int):
  return lambda b: b.reshape(heads, H)


def _o_layout(N: int, H: int):
  return lambda w: w.reshape(w.shape[0], N, H).transpose(1, 2, 0)


def _transposed(w: np.ndarray) -> np.ndarray:
  return w.T


def check(config: ModelConfig, checkpoint: Checkpoint) -> None:
  """Every tensor the config needs is in the checkpoint, at its shape (headers only)."""
  for name, (shape, _, _) in hf_names(config).items():
    if name not in checkpoint:
      raise CheckpointFolderError(f"{checkpoint.folder}: no tensor {name}, which this "
                            f"config.json's {config.arch} model needs (a shard of another "
                            f"model, or a checkpoint saved in another layout)")
    got = checkpoint.shape(name)
    if got != shape:
      raise CheckpointFolderError(f"{checkpoint.folder}: tensor {name} has shape {list(got)}; "
                            f"config.json says {list(shape)}")


def arrays(config: ModelConfig, checkpoint: Checkpoint) -> Iterator[tuple[str, np.ndarray]]:
  """(specjax parameter, array in its layout), read one tensor at a time."""
  for name, (_, target, convert) in hf_names(config).items():
    yield target, convert(checkpoint.read(name))


def load_state(config: ModelConfig, checkpoint: Checkpoint, dtype, progress=None):
  """(config for HF's rotary layout, graphdef, state) in `dtype`, streamed tensor by
  tensor to the device (`progress`: called once per tensor read)."""
  config = dataclasses.replace(config, rope_interleaved=False)
  check(config, checkpoint)

  def counted():
    for item in arrays(config, checkpoint):
      if progress:
        progress()
      yield item

  graphdef, state = state_from_flat(config, fuse_projections(counted()), jnp.dtype(dtype))
  return config, graphdef, state
