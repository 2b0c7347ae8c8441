"""`quantspec`: QuantSpec (Tiwari et al. 2025). The draft is the target's own layers
reading the shared hierarchical KV cache at 4 bits (upper nibbles) with 4-bit MLP
weights; verification reads the same cache at 8 bits. With a `base` layer drafter the
two compose: QuantSpec × KnapSpec drafts with KnapSpec's sub-layers at 4-bit precision.

The cache itself is chosen here (`kv_cache`), so `speculative_generate(..., drafter)`
builds a `QuantKVCache`. Losslessness is with respect to the target as it runs on that
cache (8-bit KV): greedy SSD equals greedy AR on the same `QuantKV` cache.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.drafters.base import Drafter
from specjax.drafters.overlay import OverlayDrafter
from specjax.plan import DraftPlan
from specjax.quant import quantize_mlp_weights
from specjax.quant_kv_cache import QuantKV


@dataclasses.dataclass(frozen=True)
class QuantSpecDrafter(OverlayDrafter):
  name = "quantspec"
  fields = ("kv_bits", "mlp_weights")
  own_threshold: ClassVar[float] = 0.0  # QuantSpec drafts a fixed γ: its drafts are close
  weights: tuple | None = None  # quant.Int4MLP per layer; None: full-precision weights
  base: Drafter | None = None
  kv_cache: QuantKV = QuantKV()

  @classmethod
  def for_model(cls, model, *, base: Drafter | None = None, weight_group: int = 128,
                kv_cache: QuantKV = QuantKV(), quantize_weights: bool = True
                ) -> QuantSpecDrafter:
    """Quantise the model's MLP weights once (4-bit, groups of `weight_group` rows)."""
    weights = quantize_mlp_weights(model.state, model.config.num_layers, weight_group) \
        if quantize_weights else None
    return cls(weights=weights, base=base, kv_cache=kv_cache)

  def overlay_plan(self, session) -> DraftPlan:
    L = session.config.num_layers
    return DraftPlan.full(L).replace(kv_bits=4, mlp_weights=self.weights).check(L)
