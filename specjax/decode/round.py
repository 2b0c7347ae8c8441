"""The self-speculative round as pure jitted functions: draft up to γ tokens with a plan,
verify them with the full model in one forward, accept. The host loop (`host_loop`) calls
the draft and verify executables in turn; the device loop (`round_loop`) runs them inside
one `while_loop`; `engine.speculative_generate` chooses between them.

Cache protocol. At a round's start the cache holds every committed token except the
last one (`last`), whose K/V is not written yet; its length is L0. The draft feeds
`last`, d1, d2, ... at positions L0, L0+1, ... reading the cache and keeping its own
K/V (for the attention layers the plan runs) in a small `DraftBuffer`: it never writes
the cache. Verification feeds [last, d1..dγ] with the full plan and writes every layer
for those γ+1 slots. After accepting a drafts, slots
L0..L0+a hold verified K/V and the length becomes L0+a+1: rejection is a length, not a
copy. Acceptance is greedy (longest prefix matching the target's argmax, plus the
target's next token) or rejection sampling with the residual distribution (Leviathan et
al. 2023; Chen et al. 2023), which keeps the target distribution exactly.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from specjax.decode.generate import positions_for
from specjax.kv_cache import DraftBuffer, KVCache
from specjax.model import apply
from specjax.plan import DraftPlan, PlanError
from specjax.sampling import argmax, argmax_and_top_probability, probs


@flax.struct.dataclass
class RoundOut:
  """What one round produced (B = 1; arrays stay on device until the host reads them)."""

  tokens: jax.Array  # int32[γ+1]: committed tokens; the first n_commit are valid
  n_commit: jax.Array  # int32: accepted drafts + 1 (the target's correction / bonus token)
  # float32[D]: the target's final hidden state (before the final norm) that gave the last
  # committed token: the next round's h̃_{t−1} for a router reading [E(x_t), h̃_{t−1}]
  hidden: jax.Array
  n_drafted: jax.Array  # int32: drafts produced before early stop (1..γ)
  drafts: jax.Array  # int32[γ]: draft tokens (first n_drafted valid)
  target_top1: jax.Array  # int32[γ+1]: the target's argmax at each verified position
  residuals: jax.Array | None  # [2L, γ+1, D] verify-pass residual stream, on request


def _draft(state, cache, last, plan, key, limit, hidden, *, graphdef, vocab, gamma,
           threshold, sampling):
  """Up to min(γ, limit) draft steps under `plan` (`limit` None: γ); stop after a token
  whose top-1 prob < threshold (`plan.stop` instead, when the drafter sets it). The cache
  is only read; the drafted tokens' K/V live in a `DraftBuffer`. `hidden`: the target's
  final hidden state at the position before `last` (`RoundOut.hidden`), what a router
  reading [E(x_t), h̃_{t−1}] needs at the first step; later steps read the draft's own.

  With no early stop and no traced limit the loop runs exactly γ steps, and says so: XLA
  then knows its trip count. On a GPU a while loop whose condition depends on data copies
  the predicate to the host and waits for it before every step, so a fixed-length draft
  (8bit, 4bit, quantspec) would pay γ + 1 host round trips a round for nothing."""
  drafts = jnp.zeros((gamma,), jnp.int32)
  conf = jnp.zeros((gamma,), jnp.float32)
  q_rows = None if sampling.greedy else jnp.zeros((gamma + 1, vocab), jnp.float32)
  stop = threshold if plan.stop is None else plan.stop
  routed = plan.router is not None
  prev = check_router_input(plan, hidden, nnx.merge(graphdef, state).config.embed_dim)

  def cond(carry):
    i, *_, go, _, _ = carry
    return (i < (gamma if limit is None else jnp.minimum(gamma, limit))) & go

  def body(carry):
    i, buffer, token, drafts, conf, q_rows, _, key, prev = carry
    pos = jnp.reshape(cache.length + i, (1, 1))
    out, buffer = apply(state, cache, token[None, None], pos, plan, graphdef=graphdef,
                        logits="none" if routed else "last", buffer=buffer)
    key, sub = jax.random.split(key)
    h = out.hidden[0, -1].astype(jnp.float32)
    if routed:  # DynaSpec: a shortlist chosen per step by the router
      model = nnx.merge(graphdef, state)
      x = plan.router.features(h, model.embed(token[None, None])[0, 0], prev)
      ids, logits = model.routed_head(h, x, i, plan)
      nxt, confidence, q = _choose(logits, ids, sub, vocab, sampling)
      prev = h
    else:
      nxt, confidence, q = _choose(out.logits[0, 0], plan.vocab, sub, vocab, sampling)
    if q is not None:
      q_rows = q_rows.at[i].set(q)
    drafts = drafts.at[i].set(nxt)
    conf = conf.at[i].set(confidence.astype(jnp.float32))
    return i + 1, buffer, nxt, drafts, conf, q_rows, confidence >= stop, key, prev

  init = (jnp.int32(0), DraftBuffer.like(cache, gamma), last, drafts, conf, q_rows,
          jnp.bool_(True), key, prev)
  if limit is None and plan.stop is None and threshold <= 0.0:  # no early stop: γ steps
    final = jax.lax.fori_loop(0, gamma, lambda _, carry: body(carry), init)
  else:
    final = jax.lax.while_loop(cond, body, init)
  n, _, _, drafts, conf, q_rows, *_ = final
  return n, drafts, conf, q_rows


def check_router_input(plan: DraftPlan, hidden, dim: int) -> jax.Array | None:
  """The h̃_{t−1} a routed draft starts from, as float32[D]: `hidden`, which a router
  reading [E(x_t), h̃_{t−1}] cannot do without; None for a plan with no router."""
  if plan.router is None:
    return None
  if hidden is None:
    if plan.router.inputs == "embed_prev":
      raise PlanError("this router reads [E(x_t), h_{t-1}]: the draft needs `hidden`, the "
                      "target's final hidden state before `last` (RoundOut.hidden)")
    return jnp.zeros((dim,), jnp.float32)  # a router reading h_t never reads it
  if jnp.shape(hidden) != (dim,):
    raise PlanError(f"`hidden` must be the final hidden state [{dim}], got {jnp.shape(hidden)}")
  return jnp.asarray(hidden, jnp.float32)


def _choose(logits, ids, key, vocab, sampling):
  """The draft's token from logits over the vocabulary, or over shortlist `ids` (-1 padded)
  mapped back to vocabulary ids; its top-1 probability; and (sampling) its distribution
  over the whole vocabulary."""
  back = (lambda j: j) if ids is None else (lambda j: ids[j])
  if sampling.greedy:
    token, confidence = argmax_and_top_probability(logits)
    return back(token), confidence, None
  q = probs(logits, sampling)
  nxt = back(jax.random.categorical(key, jnp.log(q)).astype(jnp.int32))
  if ids is not None:
    q = jnp.zeros((vocab,), q.dtype).at[jnp.maximum(ids, 0)].add(q)
  return nxt, jnp.max(q), q


@functools.partial(jax.jit, static_argnames=("graphdef",))
def shortlist_rows(state, vocab, weights, *, graphdef):
  """The LM head's rows for shortlist `vocab` (`Transformer.shortlist_rows`)."""
  return nnx.merge(graphdef, state).shortlist_rows(vocab, weights)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def untied_head_rows(state, *, graphdef):
  """An untied LM head as rows [V, D] (`Transformer.untied_head_rows`)."""
  return nnx.merge(graphdef, state).untied_head_rows()


def to_vocab(plan: DraftPlan, idx: jax.Array) -> jax.Array:
  """An index into the draft's logits -> a vocabulary id (identity without a shortlist)."""
  return idx if plan.vocab is None else plan.vocab[idx]


def _accept_greedy(drafts, n, logits):
  target = argmax(logits)  # [γ+1]
  gamma = drafts.shape[0]
  match = (drafts == target[:gamma]) & (jnp.arange(gamma) < n)
  a = jnp.sum(jnp.cumprod(match.astype(jnp.int32)))
  tokens = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]).at[a].set(target[a])
  return a, tokens, target


def _accept_sampling(drafts, n, logits, q_rows, key, sampling):
  gamma = drafts.shape[0]
  p = probs(logits, sampling)  # [γ+1, V] target distribution at each position
  idx = jnp.arange(gamma)
  p_d = p[idx, drafts]
  q_d = q_rows[idx, drafts]
  k_accept, k_fix = jax.random.split(key)
  u = jax.random.uniform(k_accept, (gamma,))
  ok = (u * q_d < p_d) & (idx < n)  # accept with probability min(1, p/q)
  a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
  # Row a of q is the draft's distribution at the first rejection; when every draft was
  # accepted (a == n) it is all zeros (rows >= n are never written), so the residual
  # below is p itself: the bonus token.
  resid = jnp.maximum(p[a] - q_rows[a], 0.0)
  total = jnp.sum(resid)
  resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p[a])
  fix = jax.random.categorical(k_fix, jnp.log(resid)).astype(jnp.int32)
  tokens = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]).at[a].set(fix)
  return a, tokens, argmax(logits)


@flax.struct.dataclass
class Draft:
  n: jax.Array  # int32: tokens drafted (1..γ)
  tokens: jax.Array  # int32[γ]
  confidence: jax.Array  # float32[γ]: each draft's top-1 probability (what early stop reads)
  q_rows: jax.Array | None  # [γ+1, V] the draft's distributions (sampling only)


def draft_fn(state, cache, last, plan, key, limit=None, hidden=None, *, graphdef, vocab,
             gamma, threshold, sampling) -> Draft:
  """Draft up to min(γ, limit) tokens under `plan`, reading the verified cache (never
  writing it). `limit` is traced: drafters that choose the draft length per round (KnapSpec)
  share one executable. None drafts γ, a length XLA then knows when nothing stops early.
  `hidden` (float32[D]): the target's final hidden state before `last`, for a routed plan
  (`RoundOut.hidden`; the prefill's for the first round)."""
  n, drafts, conf, q_rows = _draft(state, cache, last, plan, key, limit, hidden,
                                   graphdef=graphdef, vocab=vocab, gamma=gamma,
                                   threshold=threshold, sampling=sampling)
  return Draft(n, drafts, conf, q_rows)


def verify_fn(state, cache, last, draft: Draft, full: DraftPlan, key, *, graphdef, sampling,
              residuals=False, length=None) -> tuple[RoundOut, KVCache]:
  """Verify [last, drafts[:length]] with the full model in one forward and accept.

  `length` (static, default all) is the round's draft length when a drafter chose one
  below the draft executable's γ: verification then costs length + 1 positions, not γ + 1.
  `full` is the all-true plan, passed in rather than built here: as a compile-time
  constant it let XLA fold the conditionals away, and the folded program copied the
  cache (HLO checked by the tests)."""
  L0 = cache.length
  if length is not None and length < draft.tokens.shape[0]:
    q_rows = None if draft.q_rows is None else draft.q_rows[: length + 1]
    draft = Draft(jnp.minimum(draft.n, length), draft.tokens[:length],
                  draft.confidence[:length], q_rows)
  gamma = draft.tokens.shape[0]
  seq = jnp.concatenate([last[None], draft.tokens])[None]  # [1, γ+1]
  out, cache = apply(state, cache, seq, positions_for(cache, gamma + 1, 1), full,
                     graphdef=graphdef, logits="all", return_residuals=residuals)
  logits = out.logits[0]
  if sampling.greedy:
    a, tokens, target = _accept_greedy(draft.tokens, draft.n, logits)
  else:
    a, tokens, target = _accept_sampling(draft.tokens, draft.n, logits, draft.q_rows, key,
                                         sampling)
  cache = cache.with_length(L0 + a + 1)
  res = out.residuals[:, 0] if residuals else None
  return RoundOut(tokens=tokens, n_commit=a + 1, hidden=out.hidden[0, a].astype(jnp.float32),
                  n_drafted=draft.n, drafts=draft.tokens, target_top1=target,
                  residuals=res), cache


def round_fn(state, cache, last, plan, key, hidden=None, *, graphdef, vocab, gamma, threshold,
             sampling, residuals=False) -> tuple[RoundOut, KVCache]:
  """A whole round as one pure function (the tests vmap it over keys)."""
  k_draft, k_accept = jax.random.split(key)
  draft = draft_fn(state, cache, last, plan, k_draft, hidden=hidden, graphdef=graphdef,
                   vocab=vocab, gamma=gamma, threshold=threshold, sampling=sampling)
  return verify_fn(state, cache, last, draft, DraftPlan.full(plan.num_layers), k_accept,
                   graphdef=graphdef, sampling=sampling, residuals=residuals)


# Two executables per round. Fused into one, XLA:CPU copied every cache layer on every
# round (the draft's conditionals read the cache that verification then updates in
# place); split, neither copies (the tests check the compiled HLO). The extra dispatch
# is well under 1 % of a round, and it times drafting and verification exactly.
draft_step = jax.jit(
    draft_fn, static_argnames=("graphdef", "vocab", "gamma", "threshold", "sampling"))
verify_step = jax.jit(verify_fn,
                      static_argnames=("graphdef", "sampling", "residuals", "length"),
                      donate_argnames=("cache",))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def agreement(
    state: nnx.State,
    cache: KVCache,
    tokens: jax.Array,
    targets: jax.Array,
    start: jax.Array,
    plan: DraftPlan,
    *,
    graphdef: nnx.GraphDef,
) -> jax.Array:
  """Top-1 agreement of `plan` with the target, teacher-forced.

  Feeds tokens[W] at positions start.. reading the verified cache slots < start (never
  writing them: no copy, no damage) and compares the plan's argmax with targets[W], the
  tokens that actually followed. This is the SWIFT / Self-SD matchness score.
  """
  W = tokens.shape[0]
  view = cache.with_length(start)
  out, _ = apply(state, view, tokens[None], positions_for(view, W, 1), plan,
                 graphdef=graphdef, logits="all", write_cache=False)
  return jnp.mean(to_vocab(plan, jnp.argmax(out.logits[0], axis=-1)) == targets)
