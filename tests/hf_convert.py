"""HF transformers model -> specjax (config, params), for parity tests against models
nobody here wrote (random-init HF models of each family, e.g. Qwen3, which has no GGUF)."""

from __future__ import annotations

import dataclasses

from specjax.config import ModelConfig
from specjax.models.params import fuse_projections, state_from_flat

_HF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def config_from_hf(hf_config) -> ModelConfig:
  arch = _HF_ARCH[hf_config.model_type]
  D, N = hf_config.hidden_size, hf_config.num_attention_heads
  rope = getattr(hf_config, "rope_parameters", None) or {}
  if arch == "gemma3":
    rope_base = rope["full_attention"]["rope_theta"]
    local_base = rope["sliding_attention"]["rope_theta"]
  else:
    rope_base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10_000.0))
    local_base = 10_000.0
  kw = dict(
      arch=arch, num_layers=hf_config.num_hidden_layers, embed_dim=D,
      hidden_dim=hf_config.intermediate_size, num_heads=N,
      num_kv_heads=hf_config.num_key_value_heads,
      head_dim=getattr(hf_config, "head_dim", None) or D // N,
      vocab_size=hf_config.vocab_size, norm_eps=hf_config.rms_norm_eps,
      rope_base=rope_base, rope_local_base=local_base,
      tie_embeddings=hf_config.tie_word_embeddings,
      max_context=hf_config.max_position_embeddings,
  )
  if arch == "qwen2":
    kw.update(qkv_bias=True)
  if arch == "qwen3":
    kw.update(qk_norm=True)
  if arch == "gemma3":
    pattern = [t == "full_attention" for t in hf_config.layer_types]
    every = pattern.index(True) + 1 if any(pattern) else 0
    kw.update(qk_norm=True, post_norms=True, activation="gelu_tanh", embed_scale=True,
              sliding_window=hf_config.sliding_window, global_every=every,
              query_scale=hf_config.query_pre_attn_scalar**-0.5)
  return ModelConfig(**kw)


def params_from_hf(hf_model, config: ModelConfig):
  """HF weights are [out, in] and use the NeoX RoPE layout (rope_interleaved=False)."""
  config = dataclasses.replace(config, rope_interleaved=False)
  sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
  D, N, K, H = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
  norm = (lambda w: 1.0 + w) if config.arch == "gemma3" else (lambda w: w)

  def arrays():
    yield "embedding", sd["model.embed_tokens.weight"]
    yield "final_norm/scale", norm(sd["model.norm.weight"])
    if not config.tie_embeddings:
      yield "lm_head", sd["lm_head.weight"].T
    for l in range(config.num_layers):
      p, b = f"model.layers.{l}.", f"blocks/{l}/"
      for name, heads in (("q", N), ("k", K), ("v", K)):
        w = sd[p + f"self_attn.{name}_proj.weight"]
        yield b + f"attn/{name}", w  # [out, in], as `model.Attention` keeps it
        if config.qkv_bias:
          yield b + f"attn/{name}_bias", sd[p + f"self_attn.{name}_proj.bias"].reshape(heads, H)
      yield b + "attn/o", sd[p + "self_attn.o_proj.weight"].reshape(D, N, H).transpose(1, 2, 0)
      if config.qk_norm:
        yield b + "attn/q_norm/scale", norm(sd[p + "self_attn.q_norm.weight"])
        yield b + "attn/k_norm/scale", norm(sd[p + "self_attn.k_norm.weight"])
      yield b + "mlp/gate", sd[p + "mlp.gate_proj.weight"]  # [out, in], as `model.MLP` keeps it
      yield b + "mlp/up", sd[p + "mlp.up_proj.weight"]
      yield b + "mlp/down", sd[p + "mlp.down_proj.weight"].T
      yield b + "attn_norm/scale", norm(sd[p + "input_layernorm.weight"])
      if config.post_norms:
        yield b + "post_attn_norm/scale", norm(sd[p + "post_attention_layernorm.weight"])
        yield b + "mlp_norm/scale", norm(sd[p + "pre_feedforward_layernorm.weight"])
        yield b + "post_mlp_norm/scale", norm(sd[p + "post_feedforward_layernorm.weight"])
      else:
        yield b + "mlp_norm/scale", norm(sd[p + "post_attention_layernorm.weight"])

  graphdef, state = state_from_flat(config, fuse_projections(arrays()))
  return config, graphdef, state
