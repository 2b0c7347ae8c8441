"""`4bit`: any drafter's plan, its matmuls reading Q4_0 copies of the target's weights.

Every matrix the draft multiplies by — the q/k/v and output projections, the MLP and the
LM head — is read as GGUF Q4_0 blocks (32 weights, one half-float scale: 0.56 bytes a
weight). Where the CPU has AVX-512 VNNI a step's x is quantised to 8 bits per 32 inputs
and each block's products are summed as integers (`ops.q4_0_int8_matmul`, as
llama.cpp multiplies Q4_0 by Q8_0); elsewhere `ops.gguf_matmul` dequantises the
blocks in registers and meets x as floats. The point
is a target that reads its own GGUF blocks (`--dtype gguf`): its Q5_0-Q8_0 blocks take
0.69-1.06 bytes a weight, so `8bit`'s copies (1 byte) read about as much as the target
does, while Q4_0 reads less and is the kernel's fastest type. Verification reads the
target's own weights, so the output is unchanged. CPU only, as the kernel is.

With no base drafter the draft is the whole model at 4 bits; an FR-Spec or DynaSpec head
on top reads its shortlist's rows as Q4_0 blocks too. Over a searched layer drafter
(`self_sd+4bit`, `knapspec+4bit`) the search scores and prices its plans with these copies
(`DraftWeights.kind` "q4_0"), as it does under `8bit`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.drafters.base import Drafter
from specjax.drafters.overlay import OverlayDrafter
from specjax.plan import DraftPlan, PlanError
from specjax.quant import DraftWeights, q4_0_draft_weights


@dataclasses.dataclass(frozen=True)
class Q4WeightsDrafter(OverlayDrafter):
  name = "4bit"
  fields = ("weights",)
  # Alone, its drafts agree with the target on most tokens: draft a fixed γ.
  early_stop: ClassVar[float] = 0.0
  weights: DraftWeights  # Q4_0 copies of the target's matrices: `for_model`
  base: Drafter | None = None

  def __post_init__(self):
    if self.weights is None or self.weights.kind != "q4_0":
      raise PlanError("Q4WeightsDrafter needs Q4_0 copies of the target's weights: build it "
                      "with Q4WeightsDrafter.for_model(model, base=...)")

  @classmethod
  def for_model(cls, model, *, base: Drafter | None = None,
                int8_inputs: bool | None = None) -> Q4WeightsDrafter:
    """Quantise the model's matrices once (gguf-py; seconds), held beside the target's;
    `int8_inputs`: whether a step's x meets them at 8 bits (`quant.quantize_weights_q4_0`;
    None: where that is the faster path)."""
    return cls(weights=q4_0_draft_weights(model.state, model.config.num_layers,
                                          int8_inputs=int8_inputs), base=base)

  def overlay_plan(self, session) -> DraftPlan:
    L = session.config.num_layers
    return DraftPlan.full(L).replace(weights=self.weights).check(L)
