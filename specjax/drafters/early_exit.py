"""`early_exit`: run the first k layers, then the LM head (LayerSkip-style self-speculation
without any training)."""

from __future__ import annotations

import dataclasses

from specjax.drafters.base import Drafter
from specjax.plan import DraftPlan


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(Drafter):
  name = "early_exit"
  adaptive = False
  k: int | None = None  # layers kept; None = half the model

  def init(self, session, prior=None) -> DraftPlan:
    L = session.config.num_layers
    return DraftPlan.first_layers(L, L // 2 if self.k is None else self.k)

  def plan(self, state: DraftPlan) -> DraftPlan:
    return state
