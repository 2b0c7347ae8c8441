"""Drafters that change only the draft's LM head (FR-Spec, DynaSpec), on top of any
layer drafter.

The head drafter contributes one field of the plan (`vocab` or `router`) and leaves the
layers, the draft length and the per-round updates to its `base` drafter (the full
model when there is none): KnapSpec × DynaSpec is `DynaSpecDrafter(bundle,
KnapSpecDrafter(...))`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from specjax.drafters.base import Drafter
from specjax.plan import DraftPlan


@dataclasses.dataclass
class HeadState:
  base: Any  # the base drafter's state
  plan: DraftPlan  # the full model with this drafter's head field set


class HeadDrafter(Drafter):
  """Subclasses declare `base: Drafter | None` and implement `head_plan`."""

  base: Drafter | None

  @abc.abstractmethod
  def head_plan(self, session) -> DraftPlan:
    """The full-model plan carrying this drafter's head field (checked here)."""

  @property
  def wants_residuals(self) -> bool:  # type: ignore[override]
    return bool(self.base and self.base.wants_residuals)

  @property
  def threshold(self) -> float:  # type: ignore[override]
    return self.base.threshold if self.base else Drafter.threshold

  def init(self, session, prior=None) -> HeadState:
    plan = self.head_plan(session)
    return HeadState(self.base.init(session, prior) if self.base else None, plan)

  def plan(self, state: HeadState) -> DraftPlan:
    if self.base is None:
      return state.plan
    own = state.plan
    return self.base.plan(state.base).replace(vocab=own.vocab, router=own.router)

  def draft_length(self, state: HeadState) -> int | None:
    return self.base.draft_length(state.base) if self.base else None

  def update(self, state: HeadState, out, session) -> HeadState:
    if self.base is None:
      return state
    return dataclasses.replace(state, base=self.base.update(state.base, out, session))
