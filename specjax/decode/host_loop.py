"""The host loop: a draft call and a verify call per round, the drafter consulted between
them. It times drafting and verification apart and follows a plan that changes every
round (SWIFT, CLaSp, KnapSpec as published); `round_loop` is the faster driver where
the plan holds for several rounds.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from specjax.decode.dispatched_draft import DispatchedDraft
from specjax.decode.round import Draft, draft_fn, draft_step, verify_step
from specjax.decode.session import Run, SSDGeneration
from specjax.jit_cache import compiled
from specjax.plan import DraftPlan


@dataclasses.dataclass
class _HostPrograms:
  """The host loop's executables, compiled on first use (booked on the session's clock):
  a draft executable per plan structure (a shortlist adds a field) and a verify executable
  per draft length. Kept here, since `compiled`'s own lookup hashes the graphdef and walks
  every parameter."""

  run: Run
  proto: Draft  # the Draft's shapes: a verifier compiles before the first draft exists
  drafts: dict = dataclasses.field(default_factory=dict)
  verifiers: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, run: Run) -> _HostPrograms:
    proto = jax.eval_shape(functools.partial(draft_fn, **run.draft_static), run.state,
                           run.cache, jnp.int32(run.first),
                           DraftPlan.full(run.config.num_layers), run.key,
                           jnp.int32(run.gamma), run.hidden)
    return cls(run, proto)

  def draft(self, plan: DraftPlan, cache):
    run = self.run
    if run.plan_path == "dispatch":  # one program per sub-layer shape, for every plan
      if "dispatch" not in self.drafts:
        self.drafts["dispatch"] = DispatchedDraft(state=run.state, clock=run.session.clock,
                                                **run.draft_static)
      return self.drafts["dispatch"]
    sig = (jax.tree.structure(plan), tuple(x.shape for x in jax.tree.leaves(plan)))
    if sig not in self.drafts:
      self.drafts[sig] = compiled(draft_step, run.state, cache, jnp.int32(run.first), plan,
                                  run.key, jnp.int32(run.gamma), run.hidden,
                                  clock=run.session.clock, **run.draft_static)
    return self.drafts[sig]

  def verify(self, length: int, cache):
    run = self.run
    if length not in self.verifiers:
      self.verifiers[length] = compiled(
          verify_step, run.state, cache, jnp.int32(run.first), self.proto,
          DraftPlan.full(run.config.num_layers), run.key,
          length=None if length >= run.gamma else length, clock=run.session.clock,
          graphdef=run.graphdef, sampling=run.sampling,
          residuals=run.drafter.wants_residuals)
    return self.verifiers[length]


def _commit(tokens: list[int], new: list[int], run: Run) -> tuple[int, bool]:
  """Append a round's committed tokens up to the first EOS or the token budget, streaming
  each to `run.on_token`: (how many were kept, whether the generation ends with them)."""
  for i, t in enumerate(new):
    tokens.append(t)
    if run.on_token:
      run.on_token(t)
    if t in run.eos or len(tokens) >= run.max_new_tokens:
      return i + 1, True
  return len(new), False


def host_rounds(run: Run, record_rounds: bool) -> SSDGeneration:
  """A draft call and a verify call per round, the drafter consulted between them: exact
  draft / verify times, and plans that change every round (SWIFT, CLaSp, KnapSpec)."""
  state, drafter, gamma = run.state, run.drafter, run.gamma
  cache, key, dstate, session = run.cache, run.key, run.dstate, run.session
  hidden = run.hidden  # the final hidden state that gave `last` (`RoundOut.hidden`)
  clock = session.clock
  full = DraftPlan.full(run.config.num_layers)
  t_compile = time.perf_counter()
  programs = _HostPrograms.of(run)
  programs.verify(gamma, cache)
  compile_s = time.perf_counter() - t_compile
  tokens = [run.first]
  t1 = time.perf_counter()
  stats = dict(rounds=0, drafted=0, accepted=0, committed=0)
  draft_s = verify_s = selection_s = late_compile_s = 0.0
  plans, round_drafted, round_accepted, round_confidence, round_seconds = [], [], [], [], []
  done = tokens[0] in run.eos or len(tokens) >= run.max_new_tokens
  while not done:
    t_a = time.perf_counter()
    c0 = clock.seconds
    plan = session.with_head_rows(drafter.plan(dstate))
    length = drafter.round_length(dstate, gamma)
    if record_rounds:
      plans.append(plan)
    key, k_draft, k_accept = jax.random.split(key, 3)
    last = jnp.asarray(tokens[-1], jnp.int32)
    t_b, c1 = time.perf_counter(), clock.seconds
    draft_exe = programs.draft(plan, cache)  # compiled here (timed apart) at a new structure
    verify = programs.verify(length, cache)  # a dict lookup, or a compile (timed apart)
    t_c, c2 = time.perf_counter(), clock.seconds
    draft = draft_exe(state, cache, last, plan, k_draft,
                      length if run.plan_path == "dispatch" else jnp.int32(length), hidden)
    jax.block_until_ready(draft)
    t_v = time.perf_counter()
    t_c += clock.seconds - c2  # a dispatched draft compiles its sub-layers on first use
    out, cache = verify(state, cache, last, draft, full, k_accept)
    hidden = out.hidden
    n_commit, n_drafted, round_tokens = jax.device_get((out.n_commit, out.n_drafted, out.tokens))
    if run.kv_cache is not None:
      cache.check_finite()
    t_d = time.perf_counter()
    n_commit, n_drafted = int(n_commit), int(n_drafted)
    committed = round_tokens[:n_commit].tolist()
    round_drafted.append(n_drafted)
    round_accepted.append(n_commit - 1)
    if record_rounds:  # a diagnostic read, off the timed path's usual work
      round_confidence.append(jax.device_get(draft.confidence)[:n_drafted].tolist())
      round_seconds.append((t_v - t_c, t_d - t_v))
    stats["rounds"] += 1
    stats["drafted"] += n_drafted
    stats["accepted"] += n_commit - 1
    kept, done = _commit(tokens, committed, run)
    stats["committed"] += kept
    session.cache, session.context = cache, run.prompt_tokens + tokens
    t_e, c3 = time.perf_counter(), clock.seconds
    if not done:
      dstate = drafter.update(dstate, out, session)
    t_f, c4 = time.perf_counter(), clock.seconds
    # Compilation (a new draft length's verifier, a drafter's new shapes) is not decoding.
    late_compile_s += (c1 - c0) + (c3 - c1) + (c4 - c3)  # c3 - c1 holds the draft's
    draft_s += t_v - t_c
    verify_s += t_d - t_v
    selection_s += (t_b - t_a) - (c1 - c0) + (t_f - t_e) - (c4 - c3)
  t2 = time.perf_counter()
  return SSDGeneration(
      prompt_tokens=run.prompt_tokens,
      tokens=tokens,
      compile_s=compile_s + late_compile_s,
      prefill_s=0.0,
      draft_s=draft_s,
      verify_s=verify_s,
      selection_s=selection_s,
      other_s=(t2 - t1) - draft_s - verify_s - selection_s - late_compile_s,
      stopped_on_eos=tokens[-1] in run.eos,
      loop="host",
      plans=plans,
      round_drafted=round_drafted,
      round_accepted=round_accepted,
      round_confidence=round_confidence,
      round_seconds=round_seconds,
      drafter_state=dstate,
      **stats,
  )
