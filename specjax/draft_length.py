"""The draft length γ from the measured trade-off.

A round drafts γ tokens at `d` AR steps each and verifies them in one forward of
`v(γ)` AR steps; with a per-token acceptance α it commits E(γ) = (1 − α^{γ+1}) / (1 − α)
tokens (Leviathan et al. 2023). Its throughput relative to AR decoding is

    TPT(γ) = E(γ) / (γ·d + v(γ)),

and the best γ maximises it: a cheap, agreeable draft wants a long γ (8-bit drafts at
α ≈ 0.97, d ≈ 0.36), a costly or poor one a short γ. `d` and `v(γ)` are measured here, on
this device, in one process, as ratios to the AR step; α is measured from a pilot
generation.

The early-stop threshold is not derived here. The rule it suggests (draft one more token
of top-1 probability p while p > d·TPT(γ)) takes p for the chance that the token is
accepted, which holds for a layer-skipping draft but not for a near-exact one: an 8-bit
draft whose top-1 probability is 0.5 still names the target's argmax almost every time,
and that rule would stop it early at a loss.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kv_cache import KVCache
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams

@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Costs in AR steps: one draft step, and verification of γ + 1 tokens at measured γs."""

  draft: float
  verify: dict[int, float]

  def verify_at(self, gamma: int) -> float:
    """v(γ), linear between the measured γs (and beyond them, from the nearest two)."""
    gs = sorted(self.verify)
    if len(gs) == 1:
      return self.verify[gs[0]]
    lo, hi = (gs[0], gs[1]) if gamma <= gs[0] else (gs[-2], gs[-1]) if gamma >= gs[-1] else \
        next((a, b) for a, b in zip(gs, gs[1:]) if a <= gamma <= b)
    t = (gamma - lo) / (hi - lo)
    return (1 - t) * self.verify[lo] + t * self.verify[hi]


def acceptance(round_drafted: Sequence[int], round_accepted: Sequence[int]) -> float:
  """Per-token acceptance α from a run's rounds (maximum likelihood under the geometric
  model): accepted tokens over accepted tokens plus rejections."""
  accepted = int(np.sum(round_accepted))
  rejections = int(sum(a < d for d, a in zip(round_drafted, round_accepted)))
  if accepted + rejections == 0:
    raise ValueError("no drafted token to measure acceptance on")
  return accepted / (accepted + rejections)


def tokens_per_time(alpha: float, gamma: int, costs: StepCosts) -> float:
  """TPT(γ): committed tokens per AR-step of time (the speedup over AR, ignoring overhead)."""
  alpha = min(max(alpha, 0.0), 1.0 - 1e-9)
  expected = (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
  return expected / (gamma * costs.draft + costs.verify_at(gamma))


def best_gamma(alpha: float, costs: StepCosts, gamma_max: int) -> int:
  """The γ in 1..gamma_max of highest predicted TPT (the shortest among equals)."""
  if gamma_max < 1:
    raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
  return max(range(1, gamma_max + 1), key=lambda g: (tokens_per_time(alpha, g, costs), -g))


def measure_step_costs(graphdef, state, config, plan: DraftPlan, *,
                       gammas: Sequence[int] = (1, 4, 8), context: int = 256,
                       repeats: int = 7) -> StepCosts:
  """Median times of the AR step, one draft step under `plan` and verification at each γ
  in `gammas`, interleaved so machine noise hits them alike; ratios to the AR step."""
  from specjax.engine import Draft, draft_step, verify_step
  from specjax.generate import decode_step
  from specjax.jit_cache import compiled

  full, greedy = DraftPlan.full(config.num_layers), SamplingParams()
  cache = KVCache.create(config, 1, context + max(gammas) + 2).with_length(context)
  tok, last, key, one = jnp.ones((1,), jnp.int32), jnp.int32(1), jax.random.key(0), jnp.int32(1)
  step = compiled(decode_step, state, cache, tok, full, key, graphdef=graphdef, sampling=greedy)
  draft = compiled(draft_step, state, cache, last, plan, key, one, graphdef=graphdef,
                   vocab=config.vocab_size, gamma=1, threshold=0.0, sampling=greedy)
  protos = {g: Draft(n=jnp.int32(g), tokens=jnp.ones((g,), jnp.int32), q_rows=None)
            for g in gammas}
  verifiers = {g: compiled(verify_step, state, cache, last, protos[g], full, key,
                           graphdef=graphdef, sampling=greedy) for g in gammas}
  holder = {"cache": cache}

  def timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t

  def writes(fn):  # the cache is donated: keep the returned one, at the same length
    def run():
      out, c = fn(holder["cache"])
      holder["cache"] = c.with_length(context)
      return out
    return run

  calls = {"ar": writes(lambda c: step(state, c, tok, full, key)),
           "draft": lambda: draft(state, holder["cache"], last, plan, key, one).n}
  calls |= {g: writes(lambda c, g=g: verifiers[g](state, c, last, protos[g], full, key))
            for g in gammas}
  for fn in calls.values():  # warm up
    timed(fn)
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, fn in calls.items():
      times[name].append(timed(fn))
  ms = {name: statistics.median(v) for name, v in times.items()}
  return StepCosts(draft=ms["draft"] / ms["ar"], verify={g: ms[g] / ms["ar"] for g in gammas})
