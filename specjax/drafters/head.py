"""Drafters that change only the draft's LM head (FR-Spec, DynaSpec), on top of any
layer drafter: overlays (`overlay.py`) owning the plan's `vocab` and `router` fields."""

from __future__ import annotations

import abc

from specjax.drafters.overlay import OverlayDrafter
from specjax.plan import DraftPlan


class HeadDrafter(OverlayDrafter):
  """Subclasses declare `base: Drafter | None` and implement `head_plan`."""

  fields = ("vocab", "router")

  @abc.abstractmethod
  def head_plan(self, session) -> DraftPlan:
    """The full-model plan carrying this drafter's head field (checked here)."""

  def overlay_plan(self, session) -> DraftPlan:
    return self.head_plan(session)
