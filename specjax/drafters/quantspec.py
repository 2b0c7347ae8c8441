"""`quantspec`: QuantSpec (Tiwari et al. 2025). The draft is the target's own layers
reading the shared hierarchical KV cache at 4 bits (upper nibbles) with quantised weights
(`weight_bits`: the paper's 4-bit MLP by default, or our variant with every matmul at 8
bits, the cheaper on both backends measured); verification reads the same cache at 8 bits. With a `base` layer
drafter the two compose: QuantSpec × KnapSpec drafts with KnapSpec's sub-layers at 4-bit
precision.

The cache itself is chosen here (`kv_cache`), so `speculative_generate(..., drafter)`
builds a `QuantKVCache`. Losslessness is with respect to the target as it runs on that
cache (8-bit KV): greedy SSD equals greedy AR on the same `QuantKV` cache.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.drafters.base import Drafter
from specjax.drafters.overlay import OverlayDrafter
from specjax.plan import DraftPlan, PlanError
from specjax.quant import DraftWeights, quantize_mlp_weights, quantize_weights_int8, with_kernel
from specjax.quant_kv_cache import QuantKV


def default_weight_bits() -> int:
  """4, the paper's: the MLP matrices in groups of 128 rows. `weight_bits=8` is our
  variant, every matmul and the LM head at 8 bits per output channel: wherever measured it
  was the cheaper and the more agreeing draft (on a CPU it reads half the bytes of the
  4-bit MLP draft, which leaves attention and the head at full precision: docs/results/quantspec.md;
  on a GPU in bf16 the 4-bit MLP made a full draft step
  dearer than an AR step: docs/GPU.md)."""
  return 4


@dataclasses.dataclass(frozen=True)
class QuantSpecDrafter(OverlayDrafter):
  name = "quantspec"
  fields = ("kv_bits", "weights")
  early_stop: ClassVar[float] = 0.0  # QuantSpec drafts a fixed γ: its drafts are close
  weights: DraftWeights | None = None  # 4- or 8-bit (`for_model`); None: the target's
  base: Drafter | None = None
  kv_cache: QuantKV = QuantKV()
  # "pallas": the Pallas kernels for the draft's weights (`quant.with_kernel`) and for
  # attention over the cache's codes (`QuantKV.kernel`); interpreted on a CPU. None: the
  # backend's choice (`--option quantspec.kernel=pallas`).
  kernel: str | None = None

  def __post_init__(self):
    if self.kernel is None:
      return
    if self.weights is not None:
      object.__setattr__(self, "weights", with_kernel(self.weights, self.kernel))
    if self.kernel == "pallas":
      object.__setattr__(self, "kv_cache", dataclasses.replace(self.kv_cache, kernel=True))

  @classmethod
  def for_model(cls, model, *, base: Drafter | None = None, weight_bits: int | None = None,
                weight_group: int = 128, kv_cache: QuantKV = QuantKV(),
                kernel: str | None = None) -> QuantSpecDrafter:
    """Quantise the draft's weights once. `weight_bits`: 4 (the paper's: MLP matrices in
    groups of `weight_group` rows), 8 (every matmul and the LM head, per output channel)
    or 16 (the target's own). None: `default_weight_bits`."""
    bits = default_weight_bits() if weight_bits is None else weight_bits
    L = model.config.num_layers
    if bits == 4:
      weights = quantize_mlp_weights(model.state, L, weight_group)
    elif bits == 8:
      weights = quantize_weights_int8(model.state, L)
    elif bits == 16:
      weights = None
    else:
      raise PlanError(f"QuantSpec's draft weights are 4, 8 or 16 bits, got {weight_bits}")
    return cls(weights=weights, base=base, kv_cache=kv_cache, kernel=kernel)

  def overlay_plan(self, session) -> DraftPlan:
    L = session.config.num_layers
    return DraftPlan.full(L).replace(kv_bits=4, weights=self.weights).check(L)
