"""The Self-SD search (Draft & Verify, Zhang et al. 2024): Bayesian optimisation over
skip sets, run once per model before decoding; `drafters.self_sd` then uses the result.

The search scores a candidate by the expected speedup it would give,
`expected_speedup(α, γ, cost)` at the γ ≤ `gamma` that suits it best, where α is its
top-1 agreement with the target on the
target's own greedy continuations of a few search prompts (teacher-forced against the
full model's cache; one forward per candidate and prompt) and cost is the candidate's
draft-step cost. Plans are saved as JSON with the model name and the search record.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from specjax.decode.generate import generate, pad_prompt, positions_for
from specjax.decode.round import agreement
from specjax.errors import ConfigError
from specjax.jit_cache import compiled
from specjax.kv_cache import KVCache, cache_size_for
from specjax.model import apply
from specjax.plan import DraftPlan
from specjax.selection.bayes import BitSearch
from specjax.selection.cost import draft_cost, expected_speedup


@dataclasses.dataclass
class SearchResult:
  plan: DraftPlan
  objective: float
  alpha: float
  cost: float
  history: list[dict]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(state, cache, tokens, plan, *, graphdef):
  return apply(state, cache, tokens, positions_for(cache, tokens.shape[1], 1), plan,
               graphdef=graphdef, logits="none")


def _reference_sequences(graphdef, state, config, prompts, new_tokens):
  """The target's greedy continuation of each prompt, with a full-model cache of it."""
  seqs = []
  for ids in prompts:
    gen = generate(graphdef, state, config, ids, max_new_tokens=new_tokens, eos_ids=())
    seq = list(ids) + gen.tokens
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


# Bumped when `objective` changes what a search finds: saved plans and KNN libraries carry
# it, and those made under an older objective are searched again, not reused.
# 2: each candidate scored at its best γ (1: at the fixed γ; chose α = 0.01 plans).
OBJECTIVE_VERSION = 2


def objective(alpha: float, cost: float, gamma: int) -> tuple[float, int]:
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
    verbose: bool = True,
) -> SearchResult:
  """BO over the 2L plan bits (`plan.py`); random skip sets first, then GP-UCB proposals.

  Candidates skipping fewer than `min_skip` of the sub-layers are scored for the GP but
  never chosen: with a verification that costs about one full step, the full model
  scores as well as any draft and the search would return a draft that saves nothing.

  With `weights` (a draft's quantised matrices, `quant.DraftWeights`: the 8-bit overlay's)
  every candidate is scored as the draft it will be: its agreement with those weights and
  its cost in their bytes (`cost.draft_cost`), so the search picks the skip set for the
  quantised draft, which can afford more layers.
  """
  if not prompts:
    raise ConfigError("self_sd search needs at least one search prompt")
  L = config.num_layers
  seqs = _reference_sequences(graphdef, state, config, prompts, new_tokens)
  bo = BitSearch(2 * L, seed)
  rng = np.random.default_rng(seed)
  best = SearchResult(DraftPlan.first_layers(L, L // 2), -1.0, 0.0, 1.0, [])
  for it in tqdm(range(iterations), desc="self_sd search", disable=not verbose):
    if it < init_points:
      bits = rng.random(2 * L) >= rng.uniform(0.2, 0.6)  # runs: skips each with p
    else:
      bits = bo.ask()
    plan = DraftPlan.from_bits(bits)
    draft = plan if weights is None else plan.replace(weights=weights)
    alpha = plan_agreement(graphdef, state, seqs, draft)
    cost = draft_cost(config, draft, target_bits)
    value, best_gamma = objective(alpha, cost, gamma)
    bo.tell(bits, value)
    best.history.append({"iteration": it, "alpha": alpha, "cost": cost, "objective": value,
                         "gamma": best_gamma, "skipped": int((~bits).sum())})
    if (~bits).mean() >= min_skip and value > best.objective:
      best = SearchResult(plan, value, alpha, cost, best.history)
  return best
