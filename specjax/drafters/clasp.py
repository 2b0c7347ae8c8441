"""`clasp`: per-round whole-layer selection by dynamic programming (CLaSp, Chen et al. 2025).

Skip exactly `skip` layers. g[l][m] is the best residual state after l layers with m of
them skipped, best meaning closest (cosine) to the full model's residual after layer l
for the last verified token(s); g[l+1][m] comes from running layer l on g[l][m] or
skipping it from g[l][m−1]. All m-branches of a layer run as one batched call against the
verified KV cache (`layer_dp` with run cost 0, skip cost 1); the plan at m = `skip` is
backtracked. As in the paper, selection reruns after every verification (`interval` = 1)
on the newest verified tokens. `interval` = k > 1 is our variant for a CPU, where a DP
costs several draft steps: between selections the plan is fixed, so the device loop
runs those rounds as one call (`chunked`), extending the window on the device.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np

from specjax.drafters.base import Drafter
from specjax.errors import ConfigError
from specjax.plan import DraftPlan, PlanError
from specjax.selection.layer_dp import run_dp
from specjax.selection.layer_probe import Window, prompt_window, push_round


@dataclasses.dataclass
class ClaspState:
  window: Window
  plan: DraftPlan
  rounds: int  # since the last selection
  plans: list[np.ndarray]  # bits chosen at each selection (for reports)


@dataclasses.dataclass(frozen=True)
class ClaspDrafter(Drafter):
  name = "clasp"
  wants_residuals: ClassVar[bool] = True
  chunked: ClassVar[bool] = True  # the device loop runs the rounds between selections
  skip: int | None = None  # layers skipped; default half of them
  window: int = 1  # verified tokens compared (CLaSp: the last one)
  interval: int = 1  # rounds between selections (the paper: every verification)

  def __post_init__(self):
    if self.skip is not None and self.skip < 0:
      raise PlanError(f"clasp: cannot skip {self.skip} layers")
    if self.window < 1 or self.interval < 1:
      raise ConfigError("window and interval must be >= 1")

  def skip_for(self, num_layers: int) -> int:
    skip = num_layers // 2 if self.skip is None else self.skip
    if skip > num_layers:
      raise PlanError(f"clasp: cannot skip {skip} layers of a {num_layers}-layer model")
    return skip

  def init(self, session, prior=None) -> ClaspState:
    self.skip_for(session.config.num_layers)
    state = ClaspState(prompt_window(session, self.window),
                       DraftPlan.full(session.config.num_layers), 0, [])
    return self._select(state, session)

  def plan(self, state: ClaspState) -> DraftPlan:
    return state.plan

  def update(self, state: ClaspState, out, session) -> ClaspState:
    return self._after(state, push_round(state.window, out, session), 1, session)

  def selections(self, state: ClaspState) -> int:
    return len(state.plans)

  def carried_window(self, state: ClaspState):
    return state.window

  def rounds_left(self, state: ClaspState, session) -> int:
    return self.interval - state.rounds

  def resume(self, state: ClaspState, window, drafted, accepted, session) -> ClaspState:
    return self._after(state, window, len(drafted), session)

  def _after(self, state: ClaspState, window, rounds: int, session) -> ClaspState:
    """The state after `rounds` rounds whose rows `window` holds: a selection if due."""
    state = dataclasses.replace(state, window=window, rounds=state.rounds + rounds)
    return self._select(state, session) if state.rounds >= self.interval else state

  def _select(self, state: ClaspState, session) -> ClaspState:
    L = session.config.num_layers
    skip = self.skip_for(L)
    cands = run_dp(session.state, session.dense_cache(), state.window, np.zeros(L, np.int32),
                   np.ones(L, np.int32), -1.0, graphdef=session.graphdef,
                   coupled=True, slots=skip + 1, agreement=False,
                   clock=session.clock)
    bits = np.asarray(jax.device_get(cands.bits[skip]))
    return dataclasses.replace(state, plan=DraftPlan.from_bits(bits), rounds=0,
                               plans=state.plans + [bits])
