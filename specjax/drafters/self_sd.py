"""`self_sd`: a skip set found offline by Bayesian optimisation (Draft & Verify, Zhang et
al. 2024; `specjax.offline.self_sd_search`), then used for every prompt, with the paper's
adaptive draft-exiting: the early-stop threshold moves after every round towards the
acceptance rate the paper aims at.

The rule and its constants are the public code's (dilab-zju/self-speculative-decoding,
`decoding.py`, `auto_parameters`): a running average of the round's acceptance rate
(weight `beta` on its past, starting from 0); below `target` the threshold is raised by
`step` (drafts stop sooner), above it lowered (drafts run longer), unless the round
already drafted its full γ; the threshold then moves a `1 - smooth` share of the way.
The threshold starts at the generation's (`Session.threshold`: the caller's, or 0.8)
for every prompt, as the code starts each call at its `th_stop_draft`.

A threshold that changes every round is a plan field (`DraftPlan.stop`) the drafter sets
on the host, so `self_sd` decodes on the host loop; `adaptive_stop=False` keeps the
threshold fixed and the rounds on the device loop (our variant).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.drafters.static import StaticDrafter
from specjax.plan import DraftPlan, conditionals_skip_cheaply


@dataclasses.dataclass(frozen=True)
class StopState:
  """A Self-SD generation's plan and its adaptive early stop (host floats)."""

  plan: DraftPlan
  stop: float  # this round's threshold
  matchness: float  # the running average of the rounds' acceptance rates


@dataclasses.dataclass(frozen=True)
class SelfSDDrafter(StaticDrafter):
  name = "self_sd"
  adaptive_stop: bool = True  # the paper's adaptive draft-exiting; False: a fixed threshold
  beta: float = 0.5  # the average's weight on its past
  target: float = 0.9  # the acceptance rate the threshold steers to
  step: float = 0.01  # how far one round moves the threshold's goal
  smooth: float = 0.9  # the threshold's weight on its last value

  @property
  def adaptive(self) -> bool:  # type: ignore[override]
    return self.adaptive_stop

  def init(self, session, prior=None):
    plan = super().init(session, prior)
    if not self.adaptive_stop:
      return plan
    if not conditionals_skip_cheaply() and plan.frozen is None:
      # The host loop traces no plan into its executable: on an accelerator each skipped
      # sub-layer's conditional would be a host round trip, every draft step. The plan
      # holds for the generation, so it is compiled in (the threshold stays traced).
      plan = plan.freeze()
    start = self.threshold if session.threshold is None else session.threshold
    return StopState(plan, float(start), 0.0)

  def plan(self, state) -> DraftPlan:
    if not self.adaptive_stop:
      return state
    return state.plan.replace(stop=jnp.float32(state.stop))

  def update(self, state, out, session):
    if not self.adaptive_stop:
      return state
    drafted, accepted = int(out.n_drafted), int(out.n_commit) - 1
    matchness = self.beta * state.matchness + (1 - self.beta) * accepted / drafted
    if matchness < self.target:
      goal = state.stop + self.step
    elif drafted == out.drafts.shape[0]:  # it drafted its full γ: nothing to lengthen
      goal = state.stop
    else:
      goal = state.stop - self.step
    stop = self.smooth * state.stop + (1 - self.smooth) * goal
    return StopState(state.plan, stop, matchness)
