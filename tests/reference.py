"""A deliberately plain re-implementation of the decoder, for property tests.

No cache, no conditionals, no fused tricks: full causal attention over the whole
sequence and a Python `if` per sub-layer. It shares only the parameters (and the
RMSNorm / RoPE helpers, tested separately) with specjax.model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.model import Transformer, apply_rope


def reference_forward(
    model: Transformer, tokens: jax.Array, run_attn=None, run_mlp=None
) -> tuple[jax.Array, list[jax.Array]]:
  """logits[B, T, V] and the residual after every sub-layer, skipping what run_* says."""
  cfg = model.config
  L, N, K = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
  run_attn = np.ones(L, bool) if run_attn is None else np.asarray(run_attn)
  run_mlp = np.ones(L, bool) if run_mlp is None else np.asarray(run_mlp)
  B, T = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  x = model.embed(tokens)
  residuals = []
  for l, blk in enumerate(model.blocks):
    if run_attn[l]:
      h = blk.attn_norm(x)
      qkv = (h @ blk.attn.qkv[...].T).reshape(B, T, N + 2 * K, cfg.head_dim)
      if cfg.qkv_bias:
        qkv = qkv + blk.attn.qkv_bias[...]
      q, k, v = qkv[:, :, :N], qkv[:, :, N : N + K], qkv[:, :, N + K :]
      if cfg.qk_norm:
        q, k = blk.attn.q_norm(q), blk.attn.k_norm(k)
      base = cfg.layer_rope_base(l)
      q = apply_rope(q, pos, base, cfg.rope_interleaved)
      k = apply_rope(k, pos, base, cfg.rope_interleaved)
      k = jnp.repeat(k, N // K, axis=2)
      v = jnp.repeat(v, N // K, axis=2)
      s = jnp.einsum("btnh,bsnh->bnts", q, k) * cfg.scale
      i, j = np.arange(T)[:, None], np.arange(T)[None, :]
      mask = j <= i
      if cfg.is_sliding(l):
        mask &= i - j < cfg.sliding_window
      s = jnp.where(mask, s, -jnp.inf)
      o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v)
      out = jnp.einsum("btnh,nhd->btd", o, blk.attn.o[...])
      x = x + (blk.post_attn_norm(out) if cfg.post_norms else out)
    residuals.append(x)
    if run_mlp[l]:
      gate, up = jnp.split(blk.mlp_norm(x) @ blk.mlp.gate_up[...].T, 2, axis=-1)
      act = jax.nn.gelu(gate, approximate=True) if cfg.activation == "gelu_tanh" else jax.nn.silu(gate)
      out = (act * up) @ blk.mlp.down[...]
      x = x + (blk.post_mlp_norm(out) if cfg.post_norms else out)
    residuals.append(x)
  return model.head(x), residuals
