"""`dynaspec`: the draft head scores a shortlist picked per draft step by a router
(DynaSpec), optionally on top of any layer-skipping drafter.

The router (`specjax.router`) scores token clusters (`specjax.vocab_clusters`) from
[embedding(x_t), h_{t−1}] inside the jitted draft step; the union of the top-k(t)
clusters is the shortlist, k shrinking with the draft position. Verification keeps the
full vocabulary, so the output is exactly the target's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.drafters.base import Drafter
from specjax.plan import DraftPlan
from specjax.router import RouterBundle, RouterMismatchError


@dataclasses.dataclass
class DynaSpecState:
  base: Any
  plan: DraftPlan  # the full model with the router (its `router` goes on every plan)


@dataclasses.dataclass(frozen=True, eq=False)
class DynaSpecDrafter(Drafter):
  name = "dynaspec"
  bundle: RouterBundle | None = None
  base: Drafter | None = None
  positions: int = 8  # draft positions with their own k (later ones reuse the last)

  def __post_init__(self):
    if self.bundle is None:
      raise ValueError("dynaspec needs a trained router: `specjax router train`, then "
                       "specjax.router.load_bundle")
    M = self.bundle.clusters.num_clusters
    if not 1 <= self.bundle.k_max <= M:
      raise ValueError(f"k_max = {self.bundle.k_max} clusters, but there are only {M}")

  @property
  def wants_residuals(self) -> bool:  # type: ignore[override]
    return bool(self.base and self.base.wants_residuals)

  @property
  def threshold(self) -> float:  # type: ignore[override]
    return self.base.threshold if self.base else Drafter.threshold

  def init(self, session, prior=None) -> DynaSpecState:
    cfg, c = session.config, self.bundle.clusters
    if c.assignment.size != cfg.vocab_size or c.centroids.shape[1] != cfg.embed_dim:
      raise RouterMismatchError(
          f"the router of {self.bundle.model} covers {c.assignment.size} tokens of width "
          f"{c.centroids.shape[1]}; this model has {cfg.vocab_size} of width {cfg.embed_dim}")
    plan = DraftPlan.full(cfg.num_layers).replace(router=self.bundle.plan_field(self.positions))
    base = self.base.init(session, prior) if self.base else None
    return DynaSpecState(base, plan)

  def plan(self, state: DynaSpecState) -> DraftPlan:
    if self.base is None:
      return state.plan
    return self.base.plan(state.base).replace(router=state.plan.router)

  def draft_length(self, state: DynaSpecState) -> int | None:
    return self.base.draft_length(state.base) if self.base else None

  def update(self, state: DynaSpecState, out, session) -> DynaSpecState:
    if self.base is None:
      return state
    return dataclasses.replace(state, base=self.base.update(state.base, out, session))
