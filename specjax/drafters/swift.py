"""`swift`: on-the-fly layer-skip search during generation (SWIFT, Xia et al. 2024).

While optimising, each round proposes a candidate skip set — random, with a Bayesian-
optimisation proposal every `bo_every`-th time — and scores it by top-1 agreement with
the target over the last `window` committed tokens (teacher-forced against the verified
cache, no writes). The best plan so far drafts. The first and last layers are never
skipped. After `trials` candidates the plan is frozen. As in SWIFT, the search spans a
stream of prompts: pass a generation's final state as the next one's `prior`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.drafters.base import Drafter
from specjax.plan import DraftPlan


@dataclasses.dataclass
class SwiftState:
  best: DraftPlan
  best_score: float
  trials: int
  xs: list  # candidate bit vectors (for BO)
  ys: list  # their scores
  rng: np.random.Generator


@dataclasses.dataclass(frozen=True)
class SwiftDrafter(Drafter):
  name = "swift"
  skip_ratio: float = 0.45  # share of the skippable sub-layers a candidate skips
  trials: int = 40  # candidates evaluated before the plan is frozen
  bo_every: int = 25
  window: int = 32
  seed: int = 0

  def _skippable(self, L: int) -> np.ndarray:
    """Sub-layer indices (attention 0..L-1, MLP L..2L-1) that may be skipped."""
    idx = np.arange(2 * L)
    layer = idx % L
    return idx[(layer != 0) & (layer != L - 1)]

  def _bits_to_plan(self, bits: np.ndarray) -> DraftPlan:
    L = bits.size // 2
    return DraftPlan.from_masks(~bits[:L], ~bits[L:])

  def _random_bits(self, L: int, rng: np.random.Generator) -> np.ndarray:
    cand = self._skippable(L)
    bits = np.zeros(2 * L, bool)
    bits[rng.choice(cand, int(round(self.skip_ratio * cand.size)), replace=False)] = True
    return bits

  def init(self, session, prior: SwiftState | None = None) -> SwiftState:
    if prior is not None:  # keep optimising where the previous prompt stopped
      return dataclasses.replace(prior, best_score=-1.0 if prior.trials < self.trials else
                                 prior.best_score)
    rng = np.random.default_rng(self.seed)
    bits = self._random_bits(session.config.num_layers, rng)
    return SwiftState(self._bits_to_plan(bits), -1.0, 0, [], [], rng)

  def plan(self, state: SwiftState) -> DraftPlan:
    return state.best

  def update(self, state: SwiftState, out, session) -> SwiftState:
    if state.trials >= self.trials:
      return state
    L = session.config.num_layers
    if state.best_score < 0:  # score the starting plan once there is enough context
      score = session.score(state.best, self.window)
      if score is None:
        return state
      best_bits = np.concatenate([~np.asarray(state.best.attn), ~np.asarray(state.best.mlp)])
      state = dataclasses.replace(state, best_score=score, xs=[best_bits], ys=[score])
    if state.trials > 0 and state.trials % self.bo_every == 0:
      bits = self._bo_proposal(state, L)
    else:
      bits = self._random_bits(L, state.rng)
    cand = self._bits_to_plan(bits)
    score = session.score(cand, self.window)
    xs, ys = state.xs + [bits], state.ys + [score]
    best, best_score = state.best, state.best_score
    if score > best_score:
      best, best_score = cand, score
    return dataclasses.replace(state, best=best, best_score=best_score,
                               trials=state.trials + 1, xs=xs, ys=ys)

  def _bo_proposal(self, state: SwiftState, L: int) -> np.ndarray:
    """Gaussian-process UCB over the scored skip sets, with the same skip budget."""
    from specjax.selection.bayes import suggest_bits

    return suggest_bits(np.asarray(state.xs), np.asarray(state.ys), self._skippable(L),
                        int(round(self.skip_ratio * self._skippable(L).size)),
                        seed=int(state.rng.integers(1 << 31)))
