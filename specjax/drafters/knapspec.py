"""`knapspec`: per-round sub-layer selection as a knapsack over latency (KnapSpec).

The 2L items are the attention and MLP sub-layers apart. Their integer weights come from
the latency profile at the current context length, taken again at every selection (w =
round(t / Δ), Δ = min(t_attn, t_mlp), capped), so attention grows heavier with context
while the MLP does not. One jitted DP
(`layer_dp`) fills the table over (item, used weight) for every budget at once, keeping
per cell the state closest (cosine) to the full model's residuals of the last verified
tokens (the paper's m = 5), and pruning cells below τ. Budgets run to half the full
model's weight (the paper's K/2; `max_budget_share`). Each budget's candidate then gets an
acceptance
estimate α̂ (top-1 agreement of its final state with the target over the window) and a
draft time from the profile, and the pair (candidate, γ) maximising tokens per time

    TPT = (1 − α^{γ+1}) / (1 − α) / (γ·t_draft(S) + t_target(n, γ+1))

is used — γ included, and every candidate, the empty one too (the public code neither
uses its best γ nor considers candidate 0).

When to select again. As in the paper, by default after every round (`interval` = 1,
`selection_budget` None) and at every prompt: on a GPU the batched DP costs about one
forward, on a 2-core CPU several draft steps. Our variant for a CPU, `selection_budget`
(e.g. 0.05, with `interval` 16): a selection reruns once the decode time since the last
one (predicted from the profile) is large enough that the DP's measured cost stays within
that share of it, and no sooner than `interval` rounds; the state carries across prompts
(pass the final state as the next generation's `prior`), so a stream of prompts does not
pay a DP at every prefill. Until that DP, the last one's candidates are priced again at
each new prompt's context (profile times only, no DP), so a long prompt can move to a
candidate that skips more attention.

Realised acceptance (`realised=True`, not in the paper). α̂ counts agreements over a
window of a few tokens, so cheap candidates can score α̂ = 1 and win on
cost, then accept far less when they draft (docs/results/spec-bench.md: the
`knapspec+8bit` rows with `knapspec.realised` on and off, Qwen2.5-Coder-1.5B). With `realised`, a candidate whose plan
drafted in earlier rounds is priced at the acceptance it realised there (maximum
likelihood under the geometric model), blended with its α̂ as `window` tokens of prior
evidence; plans never run keep their optimistic α̂, so each choice either exploits the
best plan measured or tries one whose estimate still promises more (a greedy bandit with
optimistic starts). The choice is remade after every round among the last DP's
candidates, which costs a few array operations: on a CPU the DP itself costs seconds on
the 1.5B, so the budget lets it run about once per stream, and a bandit that waited for
it would never act. The tallies and candidates carry across prompts with the state.

Ablations: `coupled` (whole layers as items), `objective="cosine"` (the most similar
candidate within a fixed share of the capacity, fixed γ), `prune=False`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import jax
import numpy as np

from specjax.drafters.base import Drafter
from specjax.errors import ConfigError
from specjax.plan import DraftPlan
from specjax.selection.cost import expected_tokens
from specjax.selection.layer_dp import run_dp
from specjax.selection.layer_probe import Window, prompt_window, push_round
from specjax.selection.profiler import LatencyProfile, ProfileMismatchError


@dataclasses.dataclass
class Selection:
  """One run of the selection: what was considered and what was chosen (for reports)."""

  round: int
  context: int  # committed context length at selection time
  chosen_bits: np.ndarray  # bool[2L]
  gamma: int
  predicted_tpt: float  # tokens per second predicted for the chosen pair
  candidates: list[dict]  # per alive candidate: budget, alpha, cosine, t_draft, gamma, tpt


@dataclasses.dataclass
class KnapSpecState:
  window: Window
  plan: DraftPlan
  bits: np.ndarray  # bool[2L] the plan on the host (for the per-round time estimate)
  gamma: int
  rounds: int  # rounds since the last selection
  total_rounds: int
  dp_seconds: float  # wall time of the last selection (compilation excluded)
  since_s: float  # predicted decode seconds since the last selection
  weights: np.ndarray  # int[2L] at the context of the last selection
  selections: list[Selection]
  # plan bits -> (accepted drafts, rejections) over the rounds it drafted (`realised`)
  tallies: dict[bytes, tuple[int, int]] = dataclasses.field(default_factory=dict)
  # the last DP's alive candidates: bits[C, 2L] and window α̂[C], chosen among again after
  # each round (`realised`) and at each new prompt's context (a carried state)
  candidates: tuple[np.ndarray, np.ndarray] | None = None
  context: int = 0  # the context `weights` and the predicted round times are taken at


def tokens_per_time(alpha: np.ndarray, gamma: np.ndarray, t_draft: np.ndarray,
                    t_target: np.ndarray) -> np.ndarray:
  """Expected committed tokens per second of a round (Leviathan et al. 2023, with the
  draft and verify times measured rather than in units of a step)."""
  return expected_tokens(alpha, gamma) / (gamma * t_draft + t_target)


def plan_key(bits: np.ndarray) -> bytes:
  return np.asarray(bits, bool).tobytes()


def tally(tallies: dict[bytes, tuple[int, int]], bits: np.ndarray, drafted: int,
          accepted: int) -> dict[bytes, tuple[int, int]]:
  """`tallies` with one round of the plan `bits` added: its accepted drafts, and a
  rejection when the target refused one (accepted < drafted)."""
  a, r = tallies.get(plan_key(bits), (0, 0))
  return {**tallies, plan_key(bits): (a + accepted, r + int(accepted < drafted))}


def blended_alpha(window_alpha: float, tallied: tuple[int, int] | None, prior: float
                  ) -> float:
  """A plan's acceptance: what it realised (accepted / (accepted + rejections)) with the
  window's estimate counted as `prior` observations; the estimate alone if it never
  drafted."""
  if tallied is None:
    return float(window_alpha)
  a, r = tallied
  return (a + prior * float(window_alpha)) / (a + r + prior)


def slots_for(weights: np.ndarray, share: float | None = None, bucket: int = 16) -> int:
  """Static DP table width: every budget up to `share` of the total weight (all of it for
  None), rounded up so nearby cache sizes share one executable. A path's weight only grows
  along the items, so the slots past the largest budget never feed one within it: cutting
  them leaves every candidate as it was (`test_batched_budgets_equal_each_budget_alone`)
  and the DP's work, linear in the slots, about halves at the paper's K/2."""
  total = int(np.sum(weights))
  top = total if share is None else min(total, int(share * total))
  return -(-(top + 1) // bucket) * bucket


@dataclasses.dataclass(frozen=True)
class KnapSpecDrafter(Drafter):
  name = "knapspec"
  wants_residuals: ClassVar[bool] = True
  early_stop: ClassVar[float] = 0.7  # KnapSpec's draft early exit
  own_gamma: ClassVar[bool] = True  # picks (plan, γ) by predicted tokens per second
  # Between selections the plan and γ hold (unless `realised` re-prices them each round),
  # and a round adds its rows to the window and its drafts to the predicted time.
  chunked: ClassVar[bool] = True
  profile: LatencyProfile  # `profiler.load_profile`, or `specjax profile`
  # Verified tokens scored, the newest: the paper's m = 5 (it counts the tokens of the last
  # 5 steps; a fixed count keeps one executable). The DP runs (budgets × window)
  # token-states through the model: cheap on a GPU, compute-bound on a CPU.
  window: int = 5
  tau: float = 0.5  # prune cells whose mean cosine falls below
  prune: bool = True
  cap: int = 5  # largest integer weight
  max_gamma: int = 6
  interval: int = 1  # rounds between selections (the minimum, with a budget)
  # share of decode time the DP may take (our CPU variant); None: select every `interval`
  selection_budget: float | None = None
  # the largest budget as a share of the full model's weight (the paper: K/2); None: all
  max_budget_share: float | None = 0.5
  objective: str = "tpt"  # or "cosine" (ablation)
  cosine_share: float = 0.5  # "cosine" objective: budget as a share of the capacity
  coupled: bool = False  # ablation: whole layers as items
  realised: bool = False  # price plans that drafted before at their realised acceptance

  def __post_init__(self):
    if self.profile is None:
      raise ConfigError("knapspec needs a latency profile: load one with "
                       "specjax.selection.profiler.load_profile or run `specjax profile`")
    if not 0.0 < self.tau <= 1.0:
      raise ConfigError(f"tau must be in (0, 1], got {self.tau}")
    if self.objective not in ("tpt", "cosine"):
      raise ConfigError(f"objective must be 'tpt' or 'cosine', got {self.objective!r}")
    if self.selection_budget is not None and not 0.0 < self.selection_budget < 1.0:
      raise ConfigError(f"selection_budget must be in (0, 1) or None, got "
                       f"{self.selection_budget}")
    if self.max_budget_share is not None and not 0.0 < self.max_budget_share <= 1.0:
      raise ConfigError(f"max_budget_share must be in (0, 1] or None, got "
                       f"{self.max_budget_share}")
    if self.window < 1 or self.interval < 1 or self.max_gamma < 1 or self.cap < 1:
      raise ConfigError("window, interval, max_gamma and cap must be >= 1")

  # --- protocol -------------------------------------------------------------------------
  def init(self, session, prior=None) -> KnapSpecState:
    cfg = session.config
    if self.profile.num_layers != cfg.num_layers:
      raise ProfileMismatchError(
          f"the latency profile is for {self.profile.model} ({self.profile.num_layers} "
          f"layers); this model has {cfg.num_layers}: run `specjax profile` for it")
    window = prompt_window(session, self.window)
    weights = self._weights(len(session.context))
    if (self.selection_budget is not None and isinstance(prior, KnapSpecState)
        and prior.weights.shape == weights.shape):
      # Keep drafting with the carried selection, at any context: every plan is
      # lossless, and the budget decides when a DP over this size's weights pays. (A
      # forced DP at each new size once took 61 % of a 48-token prompt's decode.) The
      # last DP's candidates are priced again at this size, which costs no DP: a long
      # prompt's attention weighs more, and a plan chosen at 52 tokens drafted whole
      # 1k-4k prompts on the 1.5B before this.
      state = dataclasses.replace(prior, window=window, weights=weights, selections=[],
                                  context=len(session.context))
      if self.objective == "tpt" and state.candidates is not None:
        state = self._rechoose(state, len(session.context))
      return state
    state = KnapSpecState(window, DraftPlan.full(cfg.num_layers),
                          np.ones(2 * cfg.num_layers, bool), self.max_gamma, 0, 0, 0.0, 0.0,
                          weights, [], context=len(session.context))
    return self._select(state, session)

  def plan(self, state: KnapSpecState) -> DraftPlan:
    return state.plan

  def draft_length(self, state: KnapSpecState) -> int:
    return state.gamma

  def update(self, state: KnapSpecState, out, session) -> KnapSpecState:
    return self.resume(state, push_round(state.window, out, session), [int(out.n_drafted)],
                       [int(out.n_commit) - 1], session)

  def selections(self, state: KnapSpecState) -> int:
    """The DP runs of this generation (a carried selection re-priced at a new prompt is
    not one)."""
    return len(state.selections)

  def carried_window(self, state: KnapSpecState) -> Window:
    return state.window

  def rounds_left(self, state: KnapSpecState, session) -> int:
    """One while `realised` re-prices the plan after every round. Else the rounds before
    a selection can fall due: `interval`, and with a budget, the rounds the predicted
    time needs to reach dp_seconds / budget if every round drafted γ tokens."""
    if self._repriced(state):
      return 1
    rounds = self.interval - state.rounds
    if self.selection_budget is not None:
      n = len(session.context)
      most = (state.gamma * float(self.profile.draft_time(state.bits, n))
              + self.profile.t_target(n, state.gamma + 1))  # the most a round adds
      short = state.dp_seconds / self.selection_budget - state.since_s
      rounds = max(rounds, int(short // most))
    return max(rounds, 1)

  def resume(self, state: KnapSpecState, window, drafted, accepted,
             session) -> KnapSpecState:
    """Each round's drafts priced by the profile at the context of the last selection
    (the same whether the rounds come one by one or in a chunk from the device loop), and,
    under `realised`, tallied for its plan; then a selection if one is due, else
    (`realised`) the best candidate again."""
    n = len(session.context)
    t_draft = float(self.profile.draft_time(state.bits, state.context))
    t_target = self.profile.t_target(state.context, state.gamma + 1)
    tallies, since_s = state.tallies, state.since_s
    for d, a in zip(drafted, accepted):
      if self.realised:
        tallies = tally(tallies, state.bits, int(d), int(a))
      since_s += int(d) * t_draft + t_target
    state = dataclasses.replace(state, window=window, tallies=tallies,
                                rounds=state.rounds + len(drafted),
                                total_rounds=state.total_rounds + len(drafted),
                                since_s=since_s)
    if self._due(state):
      return self._select(state, session)
    return self._rechoose(state, n) if self._repriced(state) else state

  def _repriced(self, state: KnapSpecState) -> bool:
    """Whether the plan is chosen again after every round (`realised` under "tpt")."""
    return self.realised and self.objective == "tpt" and state.candidates is not None

  def _rechoose(self, state: KnapSpecState, n: int) -> KnapSpecState:
    """The best (plan, γ) among the last DP's candidates at context n, priced by what
    they realised (`realised`) and by the profile's times at n."""
    bits, window_alpha = state.candidates[:2]  # a state pickled before kept t_draft too
    t_draft = self.profile.draft_time(bits, n)
    pick, gamma, _, _ = self._best(bits, window_alpha, t_draft, state.tallies, n)
    if gamma == state.gamma and np.array_equal(bits[pick], state.bits):
      return state
    return dataclasses.replace(state, plan=DraftPlan.from_bits(bits[pick]), bits=bits[pick],
                               gamma=gamma)

  def _best(self, bits, window_alpha, t_draft, tallies, n: int):
    """(index, γ, TPT[C, γ], α[C]) of the candidate pair of highest tokens per time; α
    blended with the realised acceptance under `realised`."""
    alpha = window_alpha
    if self.realised:
      alpha = np.asarray([blended_alpha(a, tallies.get(plan_key(b)), self.window)
                          for a, b in zip(window_alpha, bits)])
    gammas = np.arange(1, self.max_gamma + 1)
    t_target = np.asarray([self.profile.t_target(n, g + 1) for g in gammas])
    tpt = tokens_per_time(alpha[:, None], gammas[None], t_draft[:, None], t_target[None])
    best = np.unravel_index(np.argmax(tpt), tpt.shape)
    return int(best[0]), int(gammas[best[1]]), tpt, alpha

  def _due(self, state: KnapSpecState) -> bool:
    if state.rounds < self.interval:
      return False
    return (self.selection_budget is None
            or state.dp_seconds <= self.selection_budget * state.since_s)

  # --- selection ------------------------------------------------------------------------
  def _weights(self, n: int) -> np.ndarray:
    w = self.profile.weights(n, self.cap)
    if self.coupled:
      w = w[0::2] + w[1::2]
    return w

  def _select(self, state: KnapSpecState, session) -> KnapSpecState:
    n = len(session.context)
    weights = self._weights(n)  # at the context now: attention weighs more as it grows
    slots = slots_for(weights, self.max_budget_share)
    clock = session.clock  # the generation's: its compiles are booked as compilation
    t0, c0 = time.perf_counter(), clock.seconds
    cands = run_dp(session.state, session.dense_cache(), state.window, weights,
                   np.zeros_like(weights), self.tau if self.prune else -1.0,
                   graphdef=session.graphdef, coupled=self.coupled, slots=slots,
                   agreement=self.objective == "tpt", clock=clock)
    bits, alive, cosine, window_alpha = jax.device_get(
        (cands.bits, cands.alive, cands.cosine, cands.agreement))
    dp_seconds = time.perf_counter() - t0 - (clock.seconds - c0)
    budgets = np.flatnonzero(alive)
    if self.max_budget_share is not None and budgets.size:
      within = budgets[budgets <= self.max_budget_share * float(np.sum(weights))]
      budgets = within if within.size else budgets[:1]  # else the cheapest alive
    if budgets.size == 0:  # everything pruned: the path the largest budget's slot kept
      budgets = np.asarray([slots - 1]) if alive.size else np.asarray([0])
    t_draft = self.profile.draft_time(bits[budgets], n)
    best, gamma, tpt, alpha = self._best(bits[budgets], window_alpha[budgets], t_draft,
                                         state.tallies, n)  # tpt: [candidates, γ]
    if self.objective == "tpt":
      pick, best_tpt = budgets[best], float(np.max(tpt))
    else:
      limit = self.cosine_share * float(np.sum(weights))
      ok = budgets[budgets <= limit]
      ok = ok if ok.size else budgets[:1]
      pick, gamma = int(ok[np.argmax(cosine[ok])]), self.max_gamma
      tpt, best_tpt = None, float("nan")
    records = [dict(budget=int(b), bits=bits[b].tolist(), alpha=float(alpha[i]),
                    window_alpha=float(window_alpha[b]), cosine=float(cosine[b]),
                    t_draft=float(t_draft[i]),
                    gamma=int(np.argmax(tpt[i])) + 1 if tpt is not None else gamma,
                    tpt=float(np.max(tpt[i])) if tpt is not None else float("nan"))
               for i, b in enumerate(budgets)]
    chosen = bits[pick]
    sel = Selection(round=state.total_rounds, context=len(session.context),
                    chosen_bits=chosen, gamma=gamma, predicted_tpt=best_tpt,
                    candidates=records)
    return dataclasses.replace(state, plan=DraftPlan.from_bits(chosen), bits=chosen, gamma=gamma,
                               rounds=0, weights=weights, context=n,
                               selections=state.selections + [sel], dp_seconds=dp_seconds,
                               since_s=0.0,
                               candidates=(bits[budgets], window_alpha[budgets]))

