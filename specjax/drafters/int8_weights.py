"""`8bit`: any drafter's plan, its matmuls reading 8-bit copies of the target's weights.

Every matrix the draft multiplies by — the q/k/v and output projections, the MLP and the
LM head — is read as int8 with one float32 scale per output channel (`quant.Int8Matrix`),
a quarter of the bytes of float32. Decoding one token is a pass over the weights, so the
draft step costs about what its bytes do: on a CPU the C++ int8 kernel (`ops.int8_matmul`) makes
that real (XLA:CPU would widen the matrix in memory first and cost more than float32).
Per-channel 8-bit weights barely move the logits, so the draft keeps nearly every token
of the target; verification reads the target's own weights, so the output is unchanged.

With no base drafter the draft is the whole model at 8 bits; on top of a layer drafter
(`Int8WeightsDrafter.for_model(model, base=SelfSDDrafter(plan))`) the two savings multiply.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.drafters.base import Drafter
from specjax.drafters.overlay import OverlayDrafter
from specjax.plan import DraftPlan, PlanError
from specjax.quant import DraftWeights, quantize_weights_int8, with_kernel


@dataclasses.dataclass(frozen=True)
class Int8WeightsDrafter(OverlayDrafter):
  name = "8bit"
  fields = ("weights",)
  # Alone, its drafts agree with the target on nearly every token: draft a fixed γ.
  early_stop: ClassVar[float] = 0.0
  weights: DraftWeights  # 8-bit copies of the target's matrices: `for_model`
  base: Drafter | None = None
  # Who multiplies them (`quant.with_kernel`): None, the backend's choice; "pallas", the
  # Pallas few-row kernel (`--option 8bit.kernel=pallas`); "xla".
  kernel: str | None = None

  def __post_init__(self):
    if self.weights is None or self.weights.kind != "int8":
      raise PlanError("Int8WeightsDrafter needs 8-bit weights of the target: build it with "
                      "Int8WeightsDrafter.for_model(model, base=...)")
    if self.kernel is not None:
      object.__setattr__(self, "weights", with_kernel(self.weights, self.kernel))

  @classmethod
  def for_model(cls, model, *, base: Drafter | None = None,
                kernel: str | None = None) -> Int8WeightsDrafter:
    """Quantise the model's matrices once (a few seconds; held beside the target's)."""
    return cls(weights=quantize_weights_int8(model.state, model.config.num_layers), base=base,
               kernel=kernel)

  def overlay_plan(self, session) -> DraftPlan:
    L = session.config.num_layers
    return DraftPlan.full(L).replace(weights=self.weights).check(L)
