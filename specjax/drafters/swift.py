"""`swift`: on-the-fly layer-skip search during generation (SWIFT, Xia et al. 2024).

While optimising, each round proposes a candidate skip set — random, with a Bayesian-
optimisation proposal every `bo_every`-th time — and scores it by top-1 agreement with
the target over the last `window` committed tokens (teacher-forced against the verified
cache, no writes). The best plan so far drafts. The first and last layers are never
skipped. The search ends, and the plan is frozen, as SWIFT's public code ends it: once
the best plan scores `max_score`, after `tolerance` candidates without a better one, or
after `trials` candidates (1,000). As in SWIFT, the search spans a stream of prompts:
pass a generation's final state as the next one's `prior`. Its constants are the paper's
(`eval_llama.sh` of github.com/hemingkx/SWIFT: skip ratio 0.45, a BO proposal every 25th,
a 32-token window); `trials=40` is the short search our CPU benchmarks used.

Its update reads the session, not the round (`chunked`): while it optimises, the device
loop runs one round a call and the host scores a candidate between calls; once the plan
is frozen, the device loop runs every remaining round in one call.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np

from specjax.drafters.base import Drafter
from specjax.plan import DraftPlan


@dataclasses.dataclass(frozen=True)
class SwiftState:
  best: DraftPlan
  best_score: float
  trials: int
  xs: tuple[np.ndarray, ...]  # candidate plan bits (for BO)
  ys: tuple[float, ...]  # their scores
  key: jax.Array  # trial t draws from fold_in(key, t): a state replays exactly
  best_trial: int = 0  # the trial count when the best plan was found (`tolerance`)


@dataclasses.dataclass(frozen=True)
class SwiftDrafter(Drafter):
  name = "swift"
  chunked: ClassVar[bool] = True
  skip_ratio: float = 0.45  # share of the skippable sub-layers a candidate skips
  trials: int = 1000  # candidates evaluated at most before the plan is frozen
  tolerance: int = 300  # candidates without a better plan before it is frozen
  max_score: float = 0.9  # a plan scoring this ends the search
  bo_every: int = 25
  window: int = 32
  seed: int = 0

  def searching(self, state: SwiftState) -> bool:
    """Whether the search goes on: no stopping rule has fired."""
    return (state.trials < self.trials and state.best_score < self.max_score
            and state.trials - state.best_trial < self.tolerance)

  def _skippable(self, L: int) -> np.ndarray:
    """Plan-bit indices (sub-layer order, `plan.py`) that may be skipped: all but the
    first and the last layer's."""
    layer = np.arange(2 * L) // 2
    return np.flatnonzero((layer != 0) & (layer != L - 1))

  def _budget(self, L: int) -> int:
    return int(round(self.skip_ratio * self._skippable(L).size))

  def _random_bits(self, L: int, key: jax.Array) -> np.ndarray:
    """Plan bits skipping a random `skip_ratio` of the skippable sub-layers."""
    cand = self._skippable(L)
    bits = np.ones(2 * L, bool)
    bits[np.asarray(jax.random.permutation(key, cand))[: self._budget(L)]] = False
    return bits

  def init(self, session, prior: SwiftState | None = None) -> SwiftState:
    if prior is not None:  # keep optimising where the previous prompt stopped
      return dataclasses.replace(prior, best_score=-1.0 if self.searching(prior) else
                                 prior.best_score)
    key = jax.random.key(self.seed)
    start = jax.random.fold_in(key, 1 << 30)  # a stream apart from the trials'
    bits = self._random_bits(session.config.num_layers, start)
    return SwiftState(DraftPlan.from_bits(bits), -1.0, 0, (), (), key, 0)

  def plan(self, state: SwiftState) -> DraftPlan:
    return state.best

  def carried_window(self, state: SwiftState) -> None:
    return None  # its candidates are scored on the session's committed tokens

  def rounds_left(self, state: SwiftState, session) -> int | None:
    """One while it optimises (a candidate after every round), then all of them."""
    return 1 if self.searching(state) else None

  def resume(self, state: SwiftState, window, drafted, accepted, session) -> SwiftState:
    return self.update(state, None, session)  # one round while it optimises

  def update(self, state: SwiftState, out, session) -> SwiftState:
    if not self.searching(state):
      return state
    L = session.config.num_layers
    if state.best_score < 0:  # score the starting plan once there is enough context
      score = session.score(state.best, self.window)
      if score is None:
        return state
      state = dataclasses.replace(state, best_score=score, xs=(state.best.to_bits(),),
                                  ys=(score,))
    key = jax.random.fold_in(state.key, state.trials)
    if state.trials > 0 and state.trials % self.bo_every == 0:
      bits = self._bo_proposal(state, L, key)
    else:
      bits = self._random_bits(L, key)
    cand = DraftPlan.from_bits(bits)
    score = session.score(cand, self.window)
    best, best_score, best_trial = state.best, state.best_score, state.best_trial
    if score > best_score:
      best, best_score, best_trial = cand, score, state.trials + 1
    return dataclasses.replace(state, best=best, best_score=best_score,
                               trials=state.trials + 1, xs=state.xs + (bits,),
                               ys=state.ys + (score,), best_trial=best_trial)

  def _bo_proposal(self, state: SwiftState, L: int, key: jax.Array) -> np.ndarray:
    """Gaussian-process UCB over the scored plans, with the same skip budget."""
    from specjax.selection.bayes import suggest_bits

    seed = int(jax.random.randint(key, (), 0, 1 << 30))
    return suggest_bits(np.asarray(state.xs), np.asarray(state.ys), self._skippable(L),
                        self._budget(L), seed=seed)
