"""The draft length γ and early-stop threshold τ from the measured trade-off.

A round drafts γ tokens at `d` AR steps each and verifies them in one forward of
`v(γ)` AR steps; with a per-token acceptance α it commits E(γ) = (1 − α^{γ+1}) / (1 − α)
tokens (Leviathan et al. 2023). Its throughput relative to AR decoding is

    TPT(γ) = E(γ) / (γ·d + v(γ)),

so a cheap, agreeable draft wants a long γ (8-bit drafts at α ≈ 0.97, d ≈ 0.36), a costly
or poor one a short γ. `d` and `v(γ)` are measured here, on this device, in one process,
as ratios to the AR step, timed as the decode loop that runs the drafter pays them
(`step_times`: host calls, or steps chained in one jitted loop).

The early-stop threshold τ (stop after a draft of top-1 probability below τ) is not priced
by a formula: the rule TPT suggests (draft one more token of top-1 probability p while
p > d·TPT(γ)) takes p for the chance that the token is accepted, which holds for a
layer-skipping draft but not for a near-exact one: an 8-bit draft whose top-1 probability
is 0.5 still names the target's argmax almost every time, and that rule would stop it early
at a loss. So (γ, τ) are chosen together by replaying a pilot run (drafted at the largest
γ, no early stop, each draft's probability and acceptance recorded) position by position
(`PilotTrack`): under (γ, τ) a round starting at position t drafts n tokens, up to γ or the
first below τ, commits its accepted drafts and one token more, and costs n·d + v(γ)
(verification runs at the executable's γ, whatever early stop cut); the next round starts
where it stopped. Replaying the pilot's rounds one for one instead would let a round cut
short skip the rest of the pilot's round for free, and so pick an early stop that loses
in a real decode. Drafts past a rejection, which no later round repeats, take the probabilities the pilot recorded after
its own rejection there.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import ConfigError
from specjax.kv_cache import KVCache
from specjax.plan import DraftPlan, conditionals_skip_cheaply
from specjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Costs in AR steps: one draft step, and verification of γ + 1 tokens at measured γs.

  A draft with an early stop (τ > 0) loops until a traced condition, a draft without one
  a known γ times, and the first costs more per step (on a GPU, XLA copies each
  predicate to the host and waits; docs/GPU.md has the figures). `draft_early_stop` is
  that step where it was measured (else `draft` stands for both), so a fit weighs τ > 0
  at what it costs."""

  draft: float
  verify: dict[int, float]
  draft_early_stop: float | None = None

  def draft_at(self, threshold: float) -> float:
    """d: a draft step's cost in the loop a draft of early-stop threshold τ runs."""
    if threshold > 0 and self.draft_early_stop is not None:
      return self.draft_early_stop
    return self.draft

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


# Early-stop thresholds a fit considers (0: never stop early).
THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclasses.dataclass(frozen=True)
class PilotRound:
  """One round of a pilot run: each draft's top-1 probability, and how many of the drafts
  (a prefix) the target accepted."""

  confidence: tuple[float, ...]
  accepted: int


def pilot_rounds(generation) -> list[PilotRound]:
  """The rounds of an `SSDGeneration` run with `record_rounds=True` on the host loop."""
  if len(generation.round_confidence) != generation.rounds:
    raise ConfigError("the pilot kept no draft probabilities: run it with record_rounds=True "
                      "and loop='host'")
  return [PilotRound(tuple(c), a) for c, a in zip(generation.round_confidence,
                                                   generation.round_accepted)]


@dataclasses.dataclass(frozen=True)
class PilotTrack:
  """A pilot's text position by position, as its rounds saw it: the draft's top-1
  probability at each position and whether its token was the target's; at a rejected
  position, also the probabilities of the drafts that followed it in that round (drafted
  on a wrong token). A position no draft reached (the token a round adds after all its
  drafts were accepted) counts as a sure, accepted draft."""

  confidence: tuple[float, ...]
  correct: tuple[bool, ...]
  after_rejection: tuple[tuple[float, ...], ...]  # () where the draft was correct

  @classmethod
  def from_rounds(cls, rounds: Sequence[PilotRound]) -> PilotTrack:
    conf, correct, after = [], [], []
    for r in rounds:
      a = min(r.accepted, len(r.confidence))
      conf += r.confidence[:a]
      correct += [True] * a
      after += [()] * a
      if a < len(r.confidence):  # rejected at a: the target's token takes that position
        conf.append(r.confidence[a])
        correct.append(False)
        after.append(tuple(r.confidence[a + 1:]))
      else:  # every draft accepted: the target adds one more
        conf.append(1.0)
        correct.append(True)
        after.append(())
    return cls(tuple(conf), tuple(correct), tuple(after))

  def __len__(self) -> int:
    return len(self.confidence)


def round_at(track: PilotTrack, t: int, gamma: int, threshold: float) -> tuple[int, int]:
  """(drafts, committed tokens) of a round starting at position t under (γ, τ): drafts up
  to γ, stopping after the first below τ; commits the drafts before the first wrong one
  and one token more (the target's correction, or its next token). Drafts after a wrong
  one take the probabilities the pilot drafted after it, and past those count as sure."""
  n = accepted = 0
  while n < gamma and t + n < len(track):
    p, ok = track.confidence[t + n], track.correct[t + n]
    n += 1
    if not ok:  # drafting goes on, unaware, until γ or an unsure draft
      tail = iter(track.after_rejection[t + n - 1])
      while p >= threshold and n < gamma:
        p = next(tail, 1.0)
        n += 1
      return n, accepted + 1
    accepted += 1
    if p < threshold:
      break
  return n, min(accepted + 1, len(track) - t)


def replay_tpt(tracks: Sequence[PilotTrack], gamma: int, threshold: float,
               costs: StepCosts) -> float:
  """Committed tokens per AR step of time had the pilots' texts been decoded under (γ, τ)."""
  committed = spent = 0.0
  for track in tracks:
    t = 0
    while t < len(track):
      n, c = round_at(track, t, gamma, threshold)
      committed += c
      spent += n * costs.draft_at(threshold) + costs.verify_at(gamma)
      t += c
  return committed / spent if spent else 0.0


def best_length_and_threshold(tracks: Sequence[PilotTrack], costs: StepCosts, gamma_max: int,
                              thresholds: Sequence[float] = THRESHOLDS, *,
                              fixed_gamma: bool = False) -> tuple[int, float]:
  """(γ ≤ gamma_max, τ in `thresholds`) of highest replayed TPT; among equals the shorter γ
  and the lower τ. `fixed_gamma`: τ alone, at γ = gamma_max, for a drafter that picks its
  own γ (KnapSpec) but inherits an early stop fitted to another draft (its 0.7 cuts the
  near-exact drafts of KnapSpec × 8-bit)."""
  if gamma_max < 1:
    raise ConfigError(f"gamma_max must be >= 1, got {gamma_max}")
  if not any(len(t) for t in tracks):
    raise ConfigError("the pilot run has no rounds to replay")
  lengths = (gamma_max,) if fixed_gamma else range(1, gamma_max + 1)
  grid = [(g, t) for g in lengths for t in thresholds]
  return max(grid, key=lambda gt: (replay_tpt(tracks, *gt, costs), -gt[0], -gt[1]))


@dataclasses.dataclass(frozen=True)
class Pilot:
  """What a (γ, τ) fit replays: the pilots' texts, their rounds and acceptance, and the step
  costs measured under the first pilot's plan."""

  tracks: list[PilotTrack]
  rounds: int
  alpha: float
  costs: StepCosts


def run_pilot(graphdef, state, config, drafter, prompts: Sequence[Sequence[int]], *,
              gamma: int, max_new_tokens: int, early_stop: bool = True) -> Pilot:
  """Decode each of `prompts` (token ids) with `drafter` at `gamma`, no early stop, rounds
  recorded; then time its steps as its decode loop will pay them (`measure_step_costs`;
  `early_stop`: the draft step with an early stop too, for a fit that may choose τ > 0)."""
  from specjax.decode.engine import speculative_generate

  gens = [speculative_generate(graphdef, state, config, ids, drafter,
                               max_new_tokens=max_new_tokens, gamma=gamma, threshold=0.0,
                               record_rounds=True, loop="host", eos_ids=())
          for ids in prompts]
  rounds = [pilot_rounds(g) for g in gens]
  alpha = acceptance([n for g in gens for n in g.round_drafted],
                     [n for g in gens for n in g.round_accepted])
  on_device = not drafter.adaptive or drafter.chunked  # the loop its rounds will run in
  costs = measure_step_costs(graphdef, state, config, gens[0].plans[0],
                             gammas=sorted({1, max(1, gamma // 2), gamma}),
                             device_loop=on_device, static_plan=not drafter.adaptive,
                             early_stop=early_stop)
  return Pilot([PilotTrack.from_rounds(r) for r in rounds], sum(map(len, rounds)), alpha,
               costs)


@dataclasses.dataclass(frozen=True)
class StepTimes:
  """Median seconds: the AR step, verification of γ + 1 tokens per γ, and one draft step
  per group of plans (the median over all the group's plans)."""

  ar: float
  verify: dict[int, float]
  drafts: dict


def step_times(graphdef, state, config, plans: dict, *, gammas: Sequence[int] = (4,),
               context: int = 256, repeats: int = 7, chain: int = 1, loop: int = 0,
               early_stop: Collection[str] = (), dispatched: Collection[str] = ()
               ) -> StepTimes:
  """Time the AR step, verification at each γ in `gammas` and a draft step under every plan
  of `plans` ({key: [DraftPlan, ...]}) at `context`, round-robin so that machine noise hits
  them alike. Compiled ahead (one draft executable per plan structure, one per plan when
  plans are frozen), so nothing timed compiles.

  Two ways, as the two decode loops pay: each step a call from the host (`chain` calls
  dispatched back to back per sample, one wait at the end: the host loop's cost, dispatch
  included), or with `loop` = n, n steps chained inside one jitted `fori_loop`, each
  step's output feeding the next (the device loop's cost: device time alone). On a GPU the
  two differ by the launch and the wait of a call, which for a small model is as much as
  the step itself. A draft step is a draft of γ = 1 without early stop,
  a loop of known length (as 8bit, 4bit and quantspec draft): on a GPU an early-stopping
  draft pays one host round trip more per step, for its loop's predicate: the plans named
  in `early_stop` are timed in such a loop (of length 1, its limit traced). The plans
  named in `dispatched` draft through `dispatched_draft` (a program per sub-layer called
  from the host), which only the calls from the host can time."""
  from specjax.decode.generate import compute_dtype

  cache = KVCache.create(config, 1, context + max(gammas) + 2 + loop,
                         compute_dtype(config, state)).with_length(context)
  if loop and set(dispatched) & set(plans):
    raise ValueError(f"a dispatched draft ({sorted(set(dispatched) & set(plans))[0]}) calls "
                     f"its sub-layers from the host: it cannot run inside a jitted loop")
  steps = _Steps(graphdef, config, cache, context, tuple(gammas), frozenset(early_stop),
                 frozenset(dispatched))
  calls = steps.looped(state, plans, loop) if loop else steps.from_host(state, plans)
  times: dict = {}
  per_sample = loop or chain
  for _ in range(repeats + 1):  # the first pass warms up and is dropped
    for name, fn in calls:
      t = time.perf_counter()
      jax.block_until_ready([fn() for _ in range(1 if loop else chain)])
      times.setdefault(name, []).append((time.perf_counter() - t) / per_sample)
  med = {name: statistics.median(v[1:]) for name, v in times.items()}
  return StepTimes(ar=med["ar"], verify={g: med[("verify", g)] for g in gammas},
                   drafts={name: med[("draft", name)] for name in plans})


@dataclasses.dataclass(frozen=True)
class _Steps:
  """The three steps `step_times` measures, at one context, as calls to time."""

  graphdef: object
  config: object
  cache: KVCache  # at `context`, with room for what the steps write
  context: int
  gammas: tuple[int, ...]
  early_stop: frozenset[str] = frozenset()  # plans drafted in a loop of unknown length
  dispatched: frozenset[str] = frozenset()  # plans drafted a sub-layer call at a time
  greedy: SamplingParams = SamplingParams()

  def limit(self, name: str) -> jax.Array | None:
    """The draft's limit: traced for an early-stopping draft, None (γ) otherwise."""
    return jnp.int32(1) if name in self.early_stop else None

  @property
  def full(self) -> DraftPlan:
    return DraftPlan.full(self.config.num_layers)

  def proto(self, gamma: int):
    """A draft of γ tokens for verification to check (its values do not bear on time)."""
    from specjax.decode.round import Draft

    return Draft(n=jnp.int32(gamma), tokens=jnp.ones((gamma,), jnp.int32),
                 confidence=jnp.ones((gamma,), jnp.float32), q_rows=None)

  def from_host(self, state, plans: dict) -> list:
    """[(name, call)]: each call one step, compiled ahead."""
    from specjax.decode.generate import decode_step
    from specjax.decode.round import draft_step, verify_step
    from specjax.jit_cache import compiled

    gd, full, greedy, context = self.graphdef, self.full, self.greedy, self.context
    key = jax.random.key(0)
    tok, last = jnp.ones((1,), jnp.int32), jnp.int32(1)
    holder = {"cache": self.cache}
    step = compiled(decode_step, state, self.cache, tok, full, key, graphdef=gd,
                    sampling=greedy)
    protos = {g: self.proto(g) for g in self.gammas}
    verifiers = {g: compiled(verify_step, state, self.cache, last, protos[g], full, key,
                             graphdef=gd, sampling=greedy) for g in self.gammas}

    def writes(fn):  # the cache is donated: keep the returned one, at the same length
      def run():
        out, c = fn(holder["cache"])
        holder["cache"] = c.with_length(context)
        return out
      return run

    def drafting(name, plan):
      limit = self.limit(name)
      if name in self.dispatched:  # its programs compile in the dropped first pass
        from specjax.decode.dispatched_draft import DispatchedDraft

        d = DispatchedDraft(gd, state, self.config.vocab_size, 1, 0.0, greedy)
        return lambda: d(state, holder["cache"], last, plan, key).tokens
      exe = compiled(draft_step, state, self.cache, last, plan, key, limit, graphdef=gd,
                     vocab=self.config.vocab_size, gamma=1, threshold=0.0, sampling=greedy)
      return lambda: exe(state, holder["cache"], last, plan, key, limit).n

    calls = [("ar", writes(lambda c: step(state, c, tok, full, key)))]
    calls += [(("verify", g), writes(lambda c, g=g: verifiers[g](state, c, last, protos[g],
                                                                   full, key)))
              for g in self.gammas]
    return calls + [(("draft", name), drafting(name, plan)) for name, group in plans.items()
                    for plan in group]

  def looped(self, state, plans: dict, n: int) -> list:
    """[(name, call)]: each call `n` steps inside one jitted loop, compiled ahead. AR steps
    extend the cache (it has room for n more); verification rewrites the same γ + 1
    positions; every draft step reads the cache at `context`."""
    from specjax.decode.generate import decode_step
    from specjax.decode.round import draft_step, verify_step

    gd, full, greedy, cache, context = (self.graphdef, self.full, self.greedy, self.cache,
                                        self.context)
    key = jax.random.key(0)

    def ar(state, cache):
      def body(_, carry):
        return decode_step(state, carry[1], carry[0], full, key, graphdef=gd, sampling=greedy)
      return jax.lax.fori_loop(0, n, body, (jnp.ones((1,), jnp.int32), cache))[0]

    def verify(state, cache, proto):
      def body(_, carry):
        out, c = verify_step(state, carry[1], carry[0], proto, full, key, graphdef=gd,
                             sampling=greedy)
        return out.tokens[0], c.with_length(context)
      return jax.lax.fori_loop(0, n, body, (jnp.int32(1), cache))[0]

    def draft(state, cache, plan, limit):
      def body(_, last):
        return draft_step(state, cache, last, plan, key, limit, graphdef=gd,
                          vocab=self.config.vocab_size, gamma=1, threshold=0.0,
                          sampling=greedy).tokens[0]
      return jax.lax.fori_loop(0, n, body, jnp.int32(1))

    exes = {}

    def ahead(fn, *args):  # compiled before timing, called with the same arguments
      sig = (fn, jax.tree.structure(args), tuple(jax.typeof(x) for x in jax.tree.leaves(args)))
      if sig not in exes:  # traced plans share one executable (a frozen plan's is its own)
        exes[sig] = jax.jit(fn).lower(*args).compile()
      return lambda: exes[sig](*args)

    calls = [("ar", ahead(ar, state, cache))]
    calls += [(("verify", g), ahead(verify, state, cache, self.proto(g))) for g in self.gammas]
    return calls + [(("draft", name), ahead(draft, state, cache, plan, self.limit(name)))
                    for name, group in plans.items() for plan in group]


LOOP_STEPS = 16  # steps per timed loop where costs are measured inside one


def measure_step_costs(graphdef, state, config, plan: DraftPlan, *,
                       gammas: Sequence[int] = (1, 4, 8), context: int = 256,
                       repeats: int = 7, device_loop: bool = False,
                       static_plan: bool = True, early_stop: bool = True) -> StepCosts:
  """One draft step under `plan` and verification at each γ in `gammas`, as ratios to the
  AR step, measured together (`step_times`). `device_loop`: the drafter's rounds will run
  in the device loop, which pays no call per step, so the steps are timed that way
  (`LOOP_STEPS` chained in a jitted loop; on an accelerator with the plan frozen into the
  executable, as that loop does for a fixed plan, unless `static_plan` is False: a
  chunked drafter's plans stay traced). For the host loop each step is a call. On a CPU the
  difference is not small either: timed as calls, a draft step looked dear enough that
  the fit chose a shorter γ than the one that ran fastest (`python -m
  experiments.replay_vs_real` measures it).

  `early_stop`: also time the draft step in the loop of unknown length that a draft with
  τ > 0 runs (`StepCosts.draft_early_stop`). The host loop passes each round's length as
  a traced limit, so its drafts run such a loop whatever τ: there it is the only draft
  step timed."""
  loop = LOOP_STEPS if device_loop else 0
  if device_loop and static_plan and not conditionals_skip_cheaply():
    plan = plan.freeze()
  plans = {"early stop": [plan]} if early_stop or not device_loop else {}
  if device_loop:
    plans["plan"] = [plan]
  t = step_times(graphdef, state, config, plans, gammas=gammas, context=context,
                 repeats=repeats, loop=loop, early_stop=("early stop",))
  stopping = t.drafts["early stop"] / t.ar if "early stop" in plans else None
  return StepCosts(draft=t.drafts["plan"] / t.ar if device_loop else stopping,
                   verify={g: v / t.ar for g, v in t.verify.items()},
                   draft_early_stop=stopping)
