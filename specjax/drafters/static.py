"""`static`: one fixed plan for the whole generation (from a file, `plan.load_plan`, the CLI
or a search)."""

from __future__ import annotations

import dataclasses

from specjax.drafters.base import Drafter
from specjax.plan import DraftPlan


@dataclasses.dataclass(frozen=True)
class StaticDrafter(Drafter):
  name = "static"
  adaptive = False
  fixed: DraftPlan

  def init(self, session, prior=None) -> DraftPlan:
    return self.fixed.check(session.config.num_layers)

  def plan(self, state: DraftPlan) -> DraftPlan:
    return state
