"""Self-speculative rounds on the device: draft, verify, accept and commit, repeated inside
one jitted `lax.while_loop`, for drafters whose plan is fixed for the generation, and for
`chunked` ones (CLaSp, SWIFT, KnapSpec) between their selections: the loop then also
extends their window of verified rows and records each round's counts, and the host
selects between calls.

The host loop (`host_loop`, `speculative_generate(loop="host")`) reads the device five times a
round (the draft's length, the accepted count, the committed tokens, ...) and dispatches
two programs; here the committed tokens, the EOS / length stop and the counters live in
the loop's carry, and the host reads them once per call of `rounds_per_call` rounds.
Each round splits the key exactly as the host loop does, so both commit the same tokens,
sampled or greedy (the tests check).
"""

from __future__ import annotations

import functools
import time

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from specjax.decode.generate import eos_array
from specjax.decode.round import draft_fn, verify_fn
from specjax.decode.session import SSDGeneration
from specjax.decode.verified_window import Window, push_step
from specjax.errors import ConfigError
from specjax.jit_cache import compiled
from specjax.kv_cache import KVCache
from specjax.plan import DraftPlan, conditionals_skip_cheaply
from specjax.sampling import SamplingParams

ALL_ROUNDS = 1 << 30  # rounds per call when nothing streams: until done
TOKEN_BUCKET = 256  # the committed-token buffer grows in these steps


@flax.struct.dataclass
class Decoding:
  """The device loop's state between calls (B = 1)."""

  cache: KVCache  # or QuantKVCache: every committed token but `last`
  last: jax.Array  # int32: the newest committed token (its K/V not yet in the cache)
  # float32[D]: the final hidden state that gave `last` (`RoundOut.hidden`); None when the
  # caller gives none (only a router reading [E(x_t), h̃_{t−1}] needs it)
  hidden: jax.Array | None
  key: jax.Array
  tokens: jax.Array  # int32[C]: committed tokens, the prefill's first one included
  count: jax.Array  # int32: valid entries of `tokens`
  done: jax.Array  # bool: EOS committed or the budget reached
  rounds: jax.Array  # int32
  drafted: jax.Array  # int32[C]: per round (the first `rounds` entries are valid)
  accepted: jax.Array  # int32[C]: per round, drafts accepted (before EOS truncation)
  # A `chunked` drafter's window: each round's verified rows are pushed into it, as its
  # `update` would on the host. None: the loop asks verification for no residuals.
  window: Window | None = None

  @classmethod
  def start(cls, cache, first: jax.Array, key: jax.Array, capacity: int,
            window: Window | None = None, hidden: jax.Array | None = None) -> Decoding:
    zeros = lambda: jnp.zeros((capacity,), jnp.int32)  # one buffer each: all are donated
    # The key is copied: a shared prefill (`Prefilled`) keeps its own.
    return cls(cache=cache, last=first[0].astype(jnp.int32), hidden=_own(hidden),
               key=jnp.copy(key),
               tokens=zeros().at[0].set(first[0]),
               count=jnp.int32(1), done=jnp.bool_(False), rounds=jnp.int32(0),
               drafted=zeros(), accepted=zeros(), window=_own(window))


def _own(tree):
  """A copy for the carry, which each call donates: the drafter's state (or the prefill)
  keeps its own."""
  return None if tree is None else jax.tree.map(jnp.copy, tree)


def _commit(tokens: jax.Array, n_commit: jax.Array, count: jax.Array, budget: jax.Array,
            eos: jax.Array) -> tuple[jax.Array, jax.Array]:
  """How many of a round's committed tokens[γ+1] to keep (up to and including the first
  EOS, and no more than the budget leaves) and whether the generation ends with them."""
  j = jnp.arange(tokens.shape[0])
  is_eos = jnp.isin(tokens, eos) & (j < n_commit)
  first_eos = jnp.min(jnp.where(is_eos, j, tokens.shape[0]))
  keep = jnp.minimum(jnp.minimum(n_commit, first_eos + 1), budget - count)
  return keep, (first_eos < keep) | (count + keep >= budget)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "vocab", "gamma", "threshold", "sampling"),
    donate_argnames=("carry",))
def decode_rounds(state: nnx.State, carry: Decoding, plan: DraftPlan, budget: jax.Array,
                  eos: jax.Array, rounds: jax.Array, *, graphdef: nnx.GraphDef, vocab: int,
                  gamma: int, threshold: float, sampling: SamplingParams) -> Decoding:
  """Up to `rounds` rounds under `plan`, stopping at an EOS or once `budget` tokens are
  committed. `eos` is int32[E] (-1 for none); the token buffer must hold budget + γ
  entries. `rounds` is traced: a chunked drafter's runs between selections vary in length
  (CLaSp's up to its interval, KnapSpec's with its budget), and each length would
  otherwise compile the loop again."""
  full = DraftPlan.full(plan.num_layers)
  end = carry.rounds + rounds

  def cond(c: Decoding):
    return ~c.done & (c.rounds < end)

  def body(c: Decoding) -> Decoding:
    key, k_draft, k_accept = jax.random.split(c.key, 3)
    draft = draft_fn(state, c.cache, c.last, plan, k_draft, hidden=c.hidden, graphdef=graphdef,
                     vocab=vocab, gamma=gamma, threshold=threshold, sampling=sampling)
    out, cache = verify_fn(state, c.cache, c.last, draft, full, k_accept, graphdef=graphdef,
                           sampling=sampling, residuals=c.window is not None)
    keep, done = _commit(out.tokens, out.n_commit, c.count, budget, eos)
    tokens = jax.lax.dynamic_update_slice_in_dim(c.tokens, out.tokens, c.count, axis=0)
    window = c.window
    if window is not None:  # `last` sits at the verified length: the round's first position
      window = push_step(window, out.residuals, c.last, out.tokens, c.cache.length,
                         out.n_commit)
    return c.replace(
        cache=cache, last=out.tokens[out.n_commit - 1], key=key,
        hidden=None if c.hidden is None else out.hidden,
        tokens=tokens, count=c.count + keep, done=done, rounds=c.rounds + 1,
        drafted=c.drafted.at[c.rounds].set(out.n_drafted),
        accepted=c.accepted.at[c.rounds].set(out.n_commit - 1), window=window)

  return jax.lax.while_loop(cond, body, carry)


def freezes(static_plan: bool | None, chunked: bool, rounds_left: int | None) -> bool:
  """Whether the device loop compiles a plan into its executable (`DraftPlan.freeze`).
  `static_plan` True / False decides; None takes the backend's default: on an accelerator,
  where each traced sub-layer's `lax.cond` is a host round trip (a traced half-depth draft
  step cost more than a full AR step; docs/GPU.md), freeze a plan that holds for the rest
  of the generation: a fixed plan, or a chunked drafter's once it says so (`rounds_left`
  None: SWIFT after its search), one compile each. Plans that change at selections stay
  traced there (a compile per selection), and everything stays traced on a CPU, where a
  conditional really skips its sub-layer and one executable serves every plan."""
  if static_plan is not None:
    return static_plan
  return not conditionals_skip_cheaply() and (not chunked or rounds_left is None)


def device_rounds(run, record_rounds: bool, rounds_per_call: int | None,
                  static_plan: bool | None):
  """`engine.speculative_generate`'s device driver: the drafter's plan (frozen into the
  executable as `freezes` says), then calls of `decode_rounds` until done, one host read
  each (`session.Run` in, `SSDGeneration` out). A `chunked` drafter's call runs no more
  rounds than its plan surely holds for, at its draft length; between calls the host
  hands it the window the loop extended and the rounds' counts (`Drafter.resume`, timed
  as selection) and takes its next plan."""
  session, drafter, clock = run.session, run.drafter, run.session.clock
  chunked = drafter.adaptive  # the engine sends an adaptive drafter here only if chunked
  dstate = run.dstate

  def next_plan():
    """The plan for the next call, and the rounds it surely holds for (None: all)."""
    plan = session.with_head_rows(drafter.plan(dstate))
    left = drafter.rounds_left(dstate, session) if chunked else None
    return (plan.freeze() if freezes(static_plan, chunked, left) else plan), left

  t0, c0 = time.perf_counter(), clock.seconds
  plan, left = next_plan()
  compile_s = clock.seconds - c0  # a static shortlist's row gather
  selection_s = time.perf_counter() - t0 - compile_s
  budget = run.max_new_tokens
  # Static sizes that do not follow the budget, so every max_new_tokens shares one compile.
  per_call = rounds_per_call or (4 if run.on_token else ALL_ROUNDS)
  if per_call < 1:
    raise ConfigError(f"rounds_per_call must be >= 1, got {per_call}")
  capacity = -(-(budget + run.gamma + 1) // TOKEN_BUCKET) * TOKEN_BUCKET
  window = drafter.carried_window(dstate) if chunked else None
  carry = Decoding.start(run.cache, jnp.asarray([run.first], jnp.int32), run.key,
                         capacity=capacity, window=window, hidden=run.hidden)
  eos = eos_array(run.eos)
  exes: dict = {}

  def executable(plan: DraftPlan, gamma: int):
    """One per plan structure (per plan when frozen) and draft length, compiled ahead;
    kept here, since `compiled`'s lookup walks every parameter."""
    sig = (gamma, jax.tree.structure(plan), tuple(x.shape for x in jax.tree.leaves(plan)))
    if sig not in exes:
      exes[sig] = compiled(decode_rounds, run.state, carry, plan, jnp.int32(budget), eos,
                           jnp.int32(1), clock=clock, **{**run.draft_static, "gamma": gamma})
    return exes[sig]

  tokens, plans = [run.first], []
  done = run.first in run.eos or budget <= 1
  rounds_s = loop_compile_s = loop_selection_s = 0.0  # inside the loop below
  n_done = 0
  t1 = time.perf_counter()
  while not done:
    rounds = per_call if left is None else min(per_call, max(left, 1))
    gamma = drafter.round_length(dstate, run.gamma)  # as the host loop's
    t_c = time.perf_counter()
    exe = executable(plan, gamma)
    t_a = time.perf_counter()
    loop_compile_s += t_a - t_c
    carry = exe(run.state, carry, plan, jnp.int32(budget), eos, jnp.int32(rounds))
    count, done, new, n, drafted, accepted = jax.device_get(  # one read
        (carry.count, carry.done, carry.tokens, carry.rounds, carry.drafted, carry.accepted))
    rounds_s += time.perf_counter() - t_a
    for t in new[len(tokens):count].tolist():
      tokens.append(t)
      if run.on_token:
        run.on_token(t)
    if record_rounds:
      plans += [plan] * (int(n) - n_done)
    # The host loop updates the drafter after every round but the last: so does this.
    ran = slice(n_done, int(n) if not done else int(n) - 1)
    if chunked and ran.stop > ran.start:
      t_s, c_s = time.perf_counter(), clock.seconds
      session.cache, session.context = carry.cache, run.prompt_tokens + tokens
      dstate = drafter.resume(dstate, carry.window, drafted[ran].tolist(),
                              accepted[ran].tolist(), session)
      if not done:  # the last fold leaves the state a later prompt starts from
        plan, left = next_plan()
        carry = carry.replace(window=_own(drafter.carried_window(dstate)))
      late_compile_s = clock.seconds - c_s  # a selection's first DP compiles
      loop_compile_s += late_compile_s
      loop_selection_s += time.perf_counter() - t_s - late_compile_s
    n_done = int(n)
  if run.kv_cache is not None:
    carry.cache.check_finite()
  n, drafted, accepted = jax.device_get((carry.rounds, carry.drafted, carry.accepted))
  t2 = time.perf_counter()
  return SSDGeneration(
      prompt_tokens=run.prompt_tokens, tokens=tokens, rounds=int(n),
      drafted=int(drafted[:n].sum()), accepted=int(accepted[:n].sum()),
      committed=len(tokens) - 1, compile_s=compile_s + loop_compile_s, prefill_s=0.0,
      draft_s=0.0, verify_s=0.0, selection_s=selection_s + loop_selection_s,
      other_s=(t2 - t1) - rounds_s - loop_compile_s - loop_selection_s,
      stopped_on_eos=tokens[-1] in run.eos, rounds_s=rounds_s, loop="device",
      plans=plans, round_drafted=drafted[:n].tolist(), round_accepted=accepted[:n].tolist(),
      drafter_state=dstate)
