"""Hugging Face checkpoint folders written here, without torch: a specjax model exported to
HF's names and layouts (`export`), sharded safetensors with their index
(`write_checkpoint`), a tokenizer folder, and a hub cache laid out as `huggingface_hub`
leaves it (`hub_layout`), for `HF_HUB_OFFLINE=1` loads by hub id.

The export is the inverse of `specjax.models.hf_checkpoint` written out by hand: q/k/v and
gate/up split, o and down transposed back, gemma3 norms as w (not 1 + w), and the llama
family's interleaved rotary pairs (the tiny llama's layout) reordered into HF's halves,
which leaves every q·k unchanged."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from flax import nnx

from specjax.config import ModelConfig
from specjax.models import safetensors_file

MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
  safetensors_file.write(path, {n: (a.shape, a.dtype) for n, a in tensors.items()},
                         tensors.__getitem__)


def write_checkpoint(folder: Path, hf_config: dict, tensors: dict[str, np.ndarray], *,
                     shards: int = 2, generation: dict | None = None) -> Path:
  """config.json, `shards` safetensors files (tensors dealt out in order) and their index."""
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(hf_config, indent=1))
  if generation is not None:
    (folder / "generation_config.json").write_text(json.dumps(generation))
  names = list(tensors)
  per = -(-len(names) // shards)
  weight_map = {}
  for i in range(shards):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
    write_safetensors(folder / file, part)
    weight_map |= dict.fromkeys(part, file)
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
       "weight_map": weight_map}))
  return folder


def hf_config_of(config: ModelConfig) -> dict:
  """The config.json of a specjax tiny config, in the hub's (pre-transformers-5) layout."""
  cfg = {"model_type": MODEL_TYPES[config.arch], "hidden_size": config.embed_dim,
         "intermediate_size": config.hidden_dim, "num_hidden_layers": config.num_layers,
         "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
         "head_dim": config.head_dim, "vocab_size": config.vocab_size,
         "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_base,
         "max_position_embeddings": config.max_context,
         "tie_word_embeddings": config.tie_embeddings, "bos_token_id": config.bos_id,
         "eos_token_id": list(config.eos_ids), "torch_dtype": "float32"}
  if config.arch == "gemma3":
    cfg |= {"sliding_window": config.sliding_window, "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window_pattern": config.global_every,
            "rope_local_base_freq": config.rope_local_base,
            "query_pre_attn_scalar": round(config.scale ** -2)}
  else:
    cfg["hidden_act"] = "silu"
  return cfg


def export(config: ModelConfig, state: nnx.State, dtype=np.float32) -> dict[str, np.ndarray]:
  """The HF tensors of a specjax model (its `state`), in `dtype`."""
  flat = {"/".join(map(str, p)): np.asarray(v.get_value(), np.float32)
          for p, v in nnx.to_flat_state(state)}
  D, N, K, H = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
  # interleaved pairs (2i, 2i + 1) -> halves (i, i + H/2); identity for HF's own layout
  order = (np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)]) if config.rope_interleaved
           else np.arange(H))
  heads = lambda w, n: w.reshape(n, H, *w.shape[1:])[:, order].reshape(w.shape)
  norm = (lambda w: w - 1.0) if config.arch == "gemma3" else (lambda w: w)
  out = {"model.embed_tokens.weight": flat["embedding"]}
  for l in range(config.num_layers):
    b, p = f"blocks/{l}/", f"model.layers.{l}."
    q, k, v = np.split(flat[b + "attn/qkv"], [N * H, (N + K) * H])
    out[p + "input_layernorm.weight"] = norm(flat[b + "attn_norm/scale"])
    out[p + "self_attn.q_proj.weight"] = heads(q, N)
    out[p + "self_attn.k_proj.weight"] = heads(k, K)
    out[p + "self_attn.v_proj.weight"] = v
    if config.qkv_bias:
      qb, kb, vb = np.split(flat[b + "attn/qkv_bias"], [N, N + K])
      out[p + "self_attn.q_proj.bias"] = heads(qb.reshape(-1), N)
      out[p + "self_attn.k_proj.bias"] = heads(kb.reshape(-1), K)
      out[p + "self_attn.v_proj.bias"] = vb.reshape(-1)
    if config.qk_norm:
      out[p + "self_attn.q_norm.weight"] = norm(flat[b + "attn/q_norm/scale"])[order]
      out[p + "self_attn.k_norm.weight"] = norm(flat[b + "attn/k_norm/scale"])[order]
    out[p + "self_attn.o_proj.weight"] = flat[b + "attn/o"].transpose(2, 0, 1).reshape(D, N * H)
    if config.post_norms:
      out[p + "post_attention_layernorm.weight"] = norm(flat[b + "post_attn_norm/scale"])
      out[p + "pre_feedforward_layernorm.weight"] = norm(flat[b + "mlp_norm/scale"])
      out[p + "post_feedforward_layernorm.weight"] = norm(flat[b + "post_mlp_norm/scale"])
    else:
      out[p + "post_attention_layernorm.weight"] = norm(flat[b + "mlp_norm/scale"])
    gate, up = np.split(flat[b + "mlp/gate_up"], 2)
    out[p + "mlp.gate_proj.weight"] = gate
    out[p + "mlp.up_proj.weight"] = up
    out[p + "mlp.down_proj.weight"] = flat[b + "mlp/down"].T
  out["model.norm.weight"] = norm(flat["final_norm/scale"])
  if not config.tie_embeddings:
    out["lm_head.weight"] = flat["lm_head"].T
  return {n: np.ascontiguousarray(a).astype(dtype) for n, a in out.items()}


def word_tokenizer(folder: Path, vocab_size: int, chat_template: str | None = None) -> None:
  """A word-level tokenizer.json of `vocab_size` words (w0, w1, ...: ids below the tiny
  models' vocabulary), with <s> and </s> as ids 1 and 2, and its tokenizer_config.json."""
  from tokenizers import Tokenizer, models, pre_tokenizers, processors

  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
      ("<s>", 1)])
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
  if chat_template:
    config["chat_template"] = chat_template
  (folder / "tokenizer_config.json").write_text(json.dumps(config))


def hub_layout(cache: Path, repo_id: str, folder: Path, revision: str = "main") -> Path:
  """`folder`'s files as `huggingface_hub` caches a snapshot of `repo_id`: content-named
  blobs, a snapshot folder of links to them, and refs/`revision` naming the commit."""
  repo = cache / f"models--{repo_id.replace('/', '--')}"
  commit = hashlib.sha1(repo_id.encode()).hexdigest()
  snapshot = repo / "snapshots" / commit
  (repo / "blobs").mkdir(parents=True, exist_ok=True)
  snapshot.mkdir(parents=True, exist_ok=True)
  for f in sorted(folder.iterdir()):
    data = f.read_bytes()
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
  (repo / "refs").mkdir(exist_ok=True)
  (repo / "refs" / revision).write_text(commit)
  return snapshot
