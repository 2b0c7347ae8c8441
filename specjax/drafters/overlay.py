"""Drafters that set some fields of the plan on top of any layer drafter.

An overlay contributes fields of the plan (a shortlist, a router, a KV precision,
quantised weights) and passes everything else through from its `base` drafter (the full
model when there is none): the layers, the draft length, the early-stop threshold, the
residuals it asks for, the KV cache it needs and the updates after each round (or chunk
of rounds). So KnapSpec × DynaSpec is `DynaSpecDrafter(bundle, KnapSpecDrafter(...))`,
and KnapSpec × QuantSpec `QuantSpecDrafter.for_model(model, base=KnapSpecDrafter(...))`.
Over another overlay that sets the same field, the outer one's value is the draft's
(8-bit weights over QuantSpec: its cache, 8-bit matmuls); the drafter factory refuses
such names as ambiguous.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

from specjax.drafters.base import Drafter
from specjax.plan import DraftPlan


@dataclasses.dataclass
class OverlayState:
  base: Any  # the base drafter's state
  plan: DraftPlan  # the full model with this drafter's fields set


class OverlayDrafter(Drafter):
  """Subclasses declare `base: Drafter | None`, the plan `fields` they own, and
  implement `overlay_plan`."""

  base: Drafter | None
  fields: ClassVar[tuple[str, ...]] = ()

  @abc.abstractmethod
  def overlay_plan(self, session) -> DraftPlan:
    """The full-model plan carrying this drafter's fields (checked here)."""

  @property
  def wants_residuals(self) -> bool:  # type: ignore[override]
    return bool(self.base and self.base.wants_residuals)

  @property
  def adaptive(self) -> bool:  # type: ignore[override]
    return bool(self.base and self.base.adaptive)

  @property
  def own_gamma(self) -> bool:  # type: ignore[override]
    return bool(self.base and self.base.own_gamma)

  @property
  def chunked(self) -> bool:  # type: ignore[override]
    return bool(self.base and self.base.chunked)

  @property
  def kv_cache(self):  # type: ignore[override]
    """The base's cache (QuantSpec's, under FR-Spec or 8-bit weights); an overlay that
    needs its own (QuantSpec) declares it as a field, which overrides this."""
    return self.base.kv_cache if self.base else None

  @property
  def threshold(self) -> float:
    """The base's; this overlay's own `early_stop` only when it drafts alone."""
    return self.base.threshold if self.base else self.early_stop

  def init(self, session, prior=None) -> OverlayState:
    """`prior`: this overlay's state after an earlier generation; its base's part is the
    base's prior (SWIFT and budgeted KnapSpec keep learning across prompts under it)."""
    plan = self.overlay_plan(session)
    base_prior = prior.base if isinstance(prior, OverlayState) else prior
    return OverlayState(self.base.init(session, base_prior) if self.base else None, plan)

  def plan(self, state: OverlayState) -> DraftPlan:
    if self.base is None:
      return state.plan
    own = state.plan
    return self.base.plan(state.base).replace(**{f: getattr(own, f) for f in self.fields})

  def draft_length(self, state: OverlayState) -> int | None:
    return self.base.draft_length(state.base) if self.base else None

  def update(self, state: OverlayState, out, session) -> OverlayState:
    if self.base is None:
      return state
    return dataclasses.replace(state, base=self.base.update(state.base, out, session))

  def selections(self, state: OverlayState) -> int | None:
    return self.base.selections(state.base) if self.base else None

  def carried_window(self, state: OverlayState) -> Any:
    return self.base.carried_window(state.base)

  def rounds_left(self, state: OverlayState, session) -> int | None:
    return self.base.rounds_left(state.base, session)

  def resume(self, state: OverlayState, window, drafted, accepted, session) -> OverlayState:
    return dataclasses.replace(state, base=self.base.resume(state.base, window, drafted,
                                                            accepted, session))
