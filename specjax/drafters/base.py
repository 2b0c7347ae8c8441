"""The drafter contract: a drafter is hyper-parameters plus pure functions over its state.

    state = drafter.init(session, prior)    # once, after prefill
    plan = drafter.plan(state)              # before each round
    state = drafter.update(state, out, session)   # after each round
    state = drafter.resume(state, window, drafted, accepted, session)
                            # after rounds on the device (`chunked` drafters)

No hidden state lives in the drafter object, and any randomness is a `jax.random` key in
the state, so strategies compose and a run can be replayed. `session` gives read-only
access to the model, the verified cache and the committed tokens, e.g. to score
candidate plans by agreement (`session.score`).

What a drafter needs (a plan, a profile, a library, a shortlist, quantised weights) is a
constructor argument, or comes from one documented factory (`for_model`). What composes
— `threshold`, `draft_length` / `own_gamma`, `wants_residuals`, `kv_cache`, `adaptive`,
`chunked` and the plan fields an overlay sets — an overlay passes through from its base
(`overlay.py`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from specjax.plan import DraftPlan


@dataclasses.dataclass(frozen=True)
class Drafter(abc.ABC):
  name: ClassVar[str]
  wants_residuals: ClassVar[bool] = False  # ask the engine for verify-pass residuals
  # Its draft early stop: a draft step whose top-1 probability falls below this ends the
  # round (Self-SD's 0.8). Read it as `threshold`, which overlays take from their base.
  early_stop: ClassVar[float] = 0.8
  kv_cache: ClassVar = None  # the KV cache it needs: None (full precision) or a QuantKV
  # Its plan or draft length changes between rounds (`update` does work): the engine
  # then runs rounds from the host. A drafter whose plan is fixed once `init` has run
  # sets False, and its rounds run inside one jitted loop on the device.
  adaptive: ClassVar[bool] = True
  # It chooses each round's draft length itself (`draft_length`, KnapSpec): callers that
  # pick γ from measured costs (`specjax bench --auto-gamma`) leave it alone.
  own_gamma: ClassVar[bool] = False
  # An adaptive drafter whose plan and draft length hold for runs of rounds, and whose
  # `update` within a run needs no more than each round's verified rows (folded into a
  # `layer_probe.Window`) and its draft and acceptance counts (CLaSp, SWIFT, KnapSpec).
  # The device loop then runs each run as one call, carrying the window, and the host
  # folds the run in between calls (`carried_window`, `rounds_left`, `resume`).
  chunked: ClassVar[bool] = False

  @property
  def threshold(self) -> float:
    """The draft early-stop threshold the engine uses unless the caller sets one."""
    return self.early_stop

  @abc.abstractmethod
  def init(self, session, prior: Any = None) -> Any:
    """Initial state, given the session right after prefill and, optionally, the final
    state of a previous generation (drafters that learn across prompts, like SWIFT,
    continue from it)."""

  @abc.abstractmethod
  def plan(self, state: Any) -> DraftPlan:
    """The plan for the next round."""

  def draft_length(self, state: Any) -> int | None:
    """The next round's draft length γ (capped by the engine's); None: the engine's γ."""
    return None

  def round_length(self, state: Any, gamma: int) -> int:
    """The draft length the next round runs at, in either loop: `draft_length` within
    [1, gamma], or the engine's `gamma`."""
    return min(max(self.draft_length(state) or gamma, 1), gamma)

  def update(self, state: Any, out, session) -> Any:
    """Fold one round's outcome (`round.RoundOut`, on host) into the state."""
    return state

  def selections(self, state: Any) -> int | None:
    """How many times this generation chose a new plan (a per-round selector's DP runs);
    None for a drafter that selects nothing as it decodes."""
    return None

  # --- `chunked` drafters only ----------------------------------------------------------
  def carried_window(self, state: Any) -> Any:
    """The window of verified rows that the device loop carries and extends each round."""
    raise NotImplementedError(f"{self.name} does not run its rounds in chunks")

  def rounds_left(self, state: Any, session) -> int | None:
    """Rounds the plan and draft length surely hold for (no selection can fall due
    before the last of them): the device loop's next call runs no more. None: they hold
    for the rest of the generation."""
    raise NotImplementedError(f"{self.name} does not run its rounds in chunks")

  def resume(self, state: Any, window: Any, drafted: Sequence[int], accepted: Sequence[int],
             session) -> Any:
    """`update` for rounds that ran on the device (each one's drafts and accepted drafts),
    whose verified rows `window` already holds: selects when one is due."""
    raise NotImplementedError(f"{self.name} does not run its rounds in chunks")
