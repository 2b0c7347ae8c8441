"""Relative cost of a draft step under a plan, before any profiling.

Decoding small models is memory-bound, so a sub-layer's cost is taken proportional to
the bytes of weights it reads — its own parameters at the target's precision, or a
draft's quantised copies (`plan.weights`: 8-bit matrices read a quarter of fp32's bytes)
— and the LM head always runs. The latency profiler (measured per device and context
length) supersedes this where available.
"""

from __future__ import annotations

import numpy as np

from specjax.config import ModelConfig
from specjax.plan import DraftPlan


def sublayer_weights(config: ModelConfig) -> tuple[float, float, float]:
  """Parameter counts of one attention sub-layer, one MLP sub-layer, and the LM head."""
  D, N, K, H, F = (config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.hidden_dim)
  attn = D * (N + 2 * K) * H + N * H * D
  mlp = 3 * D * F
  return float(attn), float(mlp), float(config.vocab_size * D)


def draft_cost(config: ModelConfig, plan: DraftPlan, target_bits: int = 32) -> float:
  """Cost of one draft step relative to one full-model step (1.0 = full model), in bytes
  of weights read; the target's weights are `target_bits` wide (32: fp32, 16: bf16)."""
  attn, mlp, head = (n * target_bits / 8 for n in sublayer_weights(config))
  full = config.num_layers * (attn + mlp) + head
  weights = plan.weights
  if weights is None:
    used = float(np.sum(plan.attn)) * attn + float(np.sum(plan.mlp)) * mlp + head
    return used / full
  # A sub-layer's own bytes, split between its matrices by their sizes.
  own = {"qkv": attn, "o": attn, "gate_up": mlp, "down": mlp}
  N, K = config.num_heads, config.num_kv_heads
  share = {"qkv": (N + 2 * K) / (2 * N + 2 * K), "o": N / (2 * N + 2 * K),
           "gate_up": 2 / 3, "down": 1 / 3}
  runs = {"qkv": plan.attn, "o": plan.attn, "gate_up": plan.mlp, "down": plan.mlp}
  used = float(weights.head.nbytes) if weights.head is not None else head
  for l, layer in enumerate(weights.layers):
    for name in own:
      if bool(np.asarray(runs[name])[l]):
        mat = getattr(layer, name)
        used += float(mat.nbytes) if mat is not None else own[name] * share[name]
  return used / full


def expected_tokens(alpha, gamma):
  """Tokens a round of γ drafts commits when each is accepted with probability α, given
  the ones before it (Leviathan et al. 2023): (1 − α^{γ+1}) / (1 − α), γ + 1 at α = 1.
  Elementwise over arrays; the one closed form every γ and plan choice here prices with."""
  eps = 1.0 - np.clip(np.asarray(alpha, np.float64), 0.0, 1.0)
  gamma = np.asarray(gamma, np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):  # α = 0 (log 0) and α = 1 (0 / 0)
    # −expm1((γ+1)·log α) / (1 − α): no cancellation as α → 1, where drafts are cheap
    tokens = -np.expm1((gamma + 1.0) * np.log1p(-eps)) / eps
  return np.where(eps <= 0.0, gamma + 1.0, tokens)


def expected_speedup(alpha: float, gamma: int, cost: float) -> float:
  """Tokens per round over time per round, in full-step units: `expected_tokens` over
  γ·cost + 1 (one verification ≈ one step)."""
  return float(expected_tokens(alpha, gamma)) / (gamma * cost + 1.0)
