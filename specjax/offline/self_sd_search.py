"""The Self-SD search (Draft & Verify, Zhang et al. 2024): Bayesian optimisation over
skip sets, run once per model before decoding; `drafters.self_sd` then uses the result.

Two objectives score a candidate skip set:

- "measured" (the paper's, the default): decode each search prompt with the candidate as
  a Self-SD draft and time it, the score being AR's time per verified token over the
  draft's (a measured speedup), the draft stopping as Self-SD's does (adaptive
  draft-exiting, `drafters.self_sd`). It ranks candidates by what decoding pays on this
  machine, host reads and all, and is noisy: each candidate decodes once, AR is the
  median of three.
- "predicted" (our variant, for searches that must be quick): `expected_speedup(α, γ,
  cost)` at the γ ≤ `gamma` that suits it best, α the candidate's top-1 agreement with
  the target on the target's own greedy continuations (teacher-forced against the full
  model's cache: one forward per candidate and prompt), cost its draft-step cost in
  bytes read. Deterministic, and a few forwards a candidate where the measured one
  decodes every prompt.

Plans are saved as JSON with the model name and the search record.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from specjax.decode.engine import speculative_generate
from specjax.decode.generate import Prefilled, generate, pad_prompt, positions_for, prefill_prompt
from specjax.decode.round import agreement
from specjax.errors import ConfigError
from specjax.jit_cache import compiled
from specjax.kv_cache import KVCache, cache_size_for
from specjax.model import apply
from specjax.plan import DraftPlan
from specjax.selection.bayes import BitSearch
from specjax.selection.cost import draft_cost, expected_speedup

OBJECTIVES = ("measured", "predicted")


def check_objective(objective: str, drafter_of, name: str = "the search objective") -> None:
  """Raise unless `objective` is one of `OBJECTIVES` and, for "measured", a draft maker is
  at hand (`search`'s `drafter_of`): before any work a search or a build would do."""
  if objective not in OBJECTIVES:
    raise ConfigError(f"{name} must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
  if objective == "measured" and drafter_of is None:
    raise ConfigError("the measured objective decodes with each candidate: pass "
                      "drafter_of=specjax.drafters.SelfSDDrafter (or objective='predicted')")


@dataclasses.dataclass
class SearchResult:
  plan: DraftPlan
  objective: float  # the best candidate's score: a measured or a predicted speedup
  alpha: float
  cost: float
  history: list[dict]
  kind: str = "measured"  # which objective scored it (`OBJECTIVES`)

  @property
  def rank_agreement(self) -> float | None:
    """Spearman's ρ between the measured and the predicted speedups of the candidates a
    measured search scored with `rank_check` (None without): how far the quick objective
    would have ranked the candidates as timing them did."""
    pairs = [(h["objective"], h["predicted"]) for h in self.history if "predicted" in h]
    if self.kind != "measured" or len(pairs) < 3:
      return None
    return spearman(*np.asarray(pairs, np.float64).T)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
  """Spearman's rank correlation (ties take their mean rank); 0 when either is constant."""
  def ranks(v):
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v), dtype=np.float64)
    for u in np.unique(v):  # mean rank for ties
      r[v == u] = r[v == u].mean()
    return r

  rx, ry = ranks(np.asarray(x)), ranks(np.asarray(y))
  if rx.std() == 0 or ry.std() == 0:
    return 0.0
  return float(np.corrcoef(rx, ry)[0, 1])


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(state, cache, tokens, plan, *, graphdef):
  return apply(state, cache, tokens, positions_for(cache, tokens.shape[1], 1), plan,
               graphdef=graphdef, logits="none")


def _reference_sequences(graphdef, state, config, prompts, new_tokens, continuations=None):
  """The target's greedy continuation of each prompt (`continuations` when already
  decoded), with a full-model cache of it."""
  seqs = []
  for i, ids in enumerate(prompts):
    if continuations is None:
      tokens = generate(graphdef, state, config, ids, max_new_tokens=new_tokens,
                        eos_ids=()).tokens
    else:
      tokens = continuations[i]
    seq = list(ids) + list(tokens)
    size = cache_size_for(len(seq), config.max_context)
    toks = pad_prompt(seq[:-1], size)  # bucketed: one executable for all search prompts
    cache = KVCache.create(config, 1, size)
    _, cache = _prefill(state, cache, toks, DraftPlan.full(config.num_layers),
                        graphdef=graphdef)
    seqs.append((len(ids), seq, cache.with_length(len(seq) - 1)))
  return seqs


def plan_agreement(graphdef, state, seqs, plan: DraftPlan) -> float:
  """Mean top-1 agreement of `plan` over the generated part of every reference sequence."""
  scores = []
  for P, seq, cache in seqs:
    toks = jnp.asarray(seq[P - 1 : -1], jnp.int32)
    targets = jnp.asarray(seq[P:], jnp.int32)
    args = (state, cache, toks, targets, jnp.int32(P - 1), plan)
    scores.append(float(compiled(agreement, *args, graphdef=graphdef)(*args)))
  return float(np.mean(scores))


@dataclasses.dataclass(frozen=True)
class TimedPrompt:
  """A search prompt for the measured objective: prefilled once (each decode starts from a
  copy), with AR's continuation and the median seconds AR took to decode it."""

  prompt: list[int]
  prefilled: Prefilled
  tokens: list[int]
  ar_s: float


def timed_prompts(graphdef, state, config, prompts, new_tokens: int, gamma: int,
                  repeats: int = 3, verbose: bool = False) -> list[TimedPrompt]:
  """Each prompt prefilled with room for a Self-SD draft's rounds, and AR timed on it
  `repeats` times (the first run compiles outside its timing; the median damps the rest).
  On a large model this takes minutes before the first candidate is scored: hence
  its own progress bar."""
  out = []
  for ids in tqdm(prompts, desc="self_sd search: timing AR", unit="prompt",
                  disable=not verbose):
    pre = prefill_prompt(graphdef, state, config, ids, max_new_tokens=new_tokens + gamma + 1)
    runs = [generate(graphdef, state, config, ids, max_new_tokens=new_tokens, eos_ids=(),
                     prefilled=pre) for _ in range(repeats)]
    out.append(TimedPrompt(list(ids), pre, runs[0].tokens,
                           float(np.median([r.decode_s for r in runs]))))
  return out


def measured_speedup(graphdef, state, config, timed: Sequence[TimedPrompt], drafter,
                     gamma: int) -> tuple[float, float]:
  """(AR's time per verified token over `drafter`'s, its acceptance rate) on the timed
  prompts: each decodes exactly AR's token count (no EOS), so the ratio of the summed
  decode times is the ratio of times per token. Each candidate decodes as it would once
  chosen: on an accelerator with its plan compiled in (a compile per candidate, outside
  the timing), on a CPU traced (one executable for all)."""
  ssd_s = drafted = accepted = 0
  for t in timed:
    out = speculative_generate(graphdef, state, config, t.prompt, drafter,
                               max_new_tokens=len(t.tokens), gamma=gamma, eos_ids=(),
                               prefilled=t.prefilled)
    ssd_s += out.decode_s
    drafted += out.drafted
    accepted += out.accepted
  return sum(t.ar_s for t in timed) / ssd_s, accepted / drafted if drafted else 0.0


# Bumped when `objective` changes what a search finds: saved plans and KNN libraries carry
# it, and those made under an older objective are searched again, not reused.
# 2: each candidate scored at its best γ (1: at the fixed γ; chose α = 0.01 plans).
# 3: the measured objective, the paper's, by default (2 and before: the predicted one).
OBJECTIVE_VERSION = 3


def predicted_speedup(alpha: float, cost: float, gamma: int) -> tuple[float, int]:
  """(expected speedup, γ) at the best draft length γ ≤ `gamma`.

  At a fixed γ the model charges every candidate γ draft steps per round, so among
  candidates that all lose to AR a draft that never agrees but costs little scores best:
  a search on SmolLM2 chose a plan that almost never agreed when decoding over one that
  agreed half the time. The engine's early
  stop ends a round once the draft is unsure, so a disagreeing draft really drafts about
  one token a round: scoring each candidate at its best γ models that, and ranks the
  agreeing plan first."""
  return max((expected_speedup(alpha, g, cost), g) for g in range(1, gamma + 1))


def search(
    graphdef,
    state,
    config,
    prompts: Sequence[Sequence[int]],
    *,
    iterations: int = 60,
    init_points: int = 15,
    gamma: int = 4,
    new_tokens: int = 48,
    min_skip: float = 0.2,
    seed: int = 0,
    weights=None,
    target_bits: int = 32,
    objective: str = "measured",
    drafter_of: Callable[[DraftPlan], object] | None = None,
    rank_check: bool = False,
    verbose: bool = True,
) -> SearchResult:
  """BO over the 2L plan bits (`plan.py`); random skip sets first, then GP-UCB proposals,
  each scored by `objective` (the module docstring's "measured" or "predicted").

  `drafter_of` makes the measured objective's draft from a candidate plan:
  `specjax.drafters.SelfSDDrafter`, which callers above the drafters hand in (the
  searches sit below them, `tests/test_import_graph.py`).

  Candidates skipping fewer than `min_skip` of the sub-layers are scored for the GP but
  never chosen: with a verification that costs about one full step, the full model
  scores as well as any draft and the search would return a draft that saves nothing.

  With `weights` (a draft's quantised matrices, `quant.DraftWeights`: the 8-bit overlay's)
  every candidate is scored as the draft it will be: its agreement with those weights and
  its cost in their bytes (`cost.draft_cost`), so the search picks the skip set for the
  quantised draft, which can afford more layers.

  `rank_check` (measured searches): also score every candidate by the predicted objective,
  outside the timing, so the result reports how the two rank them (`rank_agreement`).
  """
  if not prompts:
    raise ConfigError("self_sd search needs at least one search prompt")
  check_objective(objective, drafter_of)
  L = config.num_layers
  if objective == "measured":
    timed = timed_prompts(graphdef, state, config, prompts, new_tokens, gamma,
                          verbose=verbose)
    # One decode not scored: a first run after compiling pays for more than decoding,
    # which would sink the first candidate.
    warm = DraftPlan.first_layers(L, L // 2)
    measured_speedup(graphdef, state, config, timed,
                     drafter_of(warm if weights is None else warm.replace(weights=weights)),
                     gamma)
  if objective == "predicted" or rank_check:
    seqs = _reference_sequences(graphdef, state, config, prompts, new_tokens,
                                [t.tokens for t in timed] if objective == "measured" else None)
  bo = BitSearch(2 * L, seed)
  rng = np.random.default_rng(seed)
  best = SearchResult(DraftPlan.first_layers(L, L // 2), -1.0, 0.0, 1.0, [], objective)
  for it in tqdm(range(iterations), desc=f"self_sd search ({objective})",
                 disable=not verbose):
    if it < init_points:
      bits = rng.random(2 * L) >= rng.uniform(0.2, 0.6)  # runs: skips each with p
    else:
      bits = bo.ask()
    plan = DraftPlan.from_bits(bits)
    draft = plan if weights is None else plan.replace(weights=weights)
    cost = draft_cost(config, draft, target_bits)
    if objective == "measured":
      value, alpha = measured_speedup(graphdef, state, config, timed, drafter_of(draft),
                                      gamma)
      best_gamma = gamma
    else:
      alpha = plan_agreement(graphdef, state, seqs, draft)
      value, best_gamma = predicted_speedup(alpha, cost, gamma)
    bo.tell(bits, value)
    best.history.append({"iteration": it, "alpha": alpha, "cost": cost, "objective": value,
                         "gamma": best_gamma, "skipped": int((~bits).sum()),
                         "bits": bits.astype(int).tolist()})
    if objective == "measured" and rank_check:
      agreed = plan_agreement(graphdef, state, seqs, draft)
      best.history[-1].update(predicted=predicted_speedup(agreed, cost, gamma)[0],
                              predicted_alpha=agreed)
    if (~bits).mean() >= min_skip and value > best.objective:
      best = SearchResult(plan, value, alpha, cost, best.history, objective)
  return best
