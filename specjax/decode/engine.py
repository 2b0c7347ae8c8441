"""The self-speculative round: draft up to γ tokens with a plan, verify them with the
full model in one forward, accept — a draft executable and a verify executable.

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

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ModelConfig
from specjax.decode.generate import Prefilled, check_prompt, positions_for, start_decoding
from specjax.errors import ConfigError
from specjax.jit_cache import CompileClock, compiled
from specjax.kv_cache import DraftBuffer, KVCache
from specjax.model import apply
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams, argmax, argmax_and_top_probability, probs


@flax.struct.dataclass
class RoundOut:
  """What one round produced (B = 1; arrays stay on device until the host reads them)."""

  tokens: jax.Array  # int32[γ+1]: committed tokens; the first n_commit are valid
  n_commit: jax.Array  # int32: accepted drafts + 1 (the target's correction / bonus token)
  n_drafted: jax.Array  # int32: drafts produced before early stop (1..γ)
  drafts: jax.Array  # int32[γ]: draft tokens (first n_drafted valid)
  target_top1: jax.Array  # int32[γ+1]: the target's argmax at each verified position
  residuals: jax.Array | None  # [2L, γ+1, D] verify-pass residual stream, on request


def _draft(state, cache, last, plan, key, limit, *, graphdef, vocab, gamma, threshold,
           sampling):
  """Up to min(γ, limit) draft steps under `plan` (`limit` None: γ); stop after a token
  whose top-1 prob < threshold. The cache is only read; the drafted tokens' K/V live in a
  `DraftBuffer`.

  With no early stop and no traced limit the loop runs exactly γ steps, and says so: XLA
  then knows its trip count. On a GPU a while loop whose condition depends on data copies
  the predicate to the host and waits for it before every step, so a fixed-length draft
  (8bit, 4bit, quantspec) would pay γ + 1 host round trips a round for nothing."""
  drafts = jnp.zeros((gamma,), jnp.int32)
  conf = jnp.zeros((gamma,), jnp.float32)
  q_rows = None if sampling.greedy else jnp.zeros((gamma + 1, vocab), jnp.float32)

  def cond(carry):
    i, *_, go, _ = carry
    return (i < (gamma if limit is None else jnp.minimum(gamma, limit))) & go

  def body(carry):
    i, buffer, token, drafts, conf, q_rows, _, key = carry
    pos = jnp.reshape(cache.length + i, (1, 1))
    routed = plan.router is not None
    out, buffer = apply(state, cache, token[None, None], pos, plan, graphdef=graphdef,
                        logits="none" if routed else "last", buffer=buffer)
    key, sub = jax.random.split(key)
    h = out.hidden[0, -1].astype(jnp.float32)
    if routed:
      nxt, confidence, q = _routed_choice(state, graphdef, plan, h, i, sub, vocab, sampling)
    else:
      nxt, confidence, q = _choose(out.logits[0, 0], plan.vocab, sub, vocab, sampling)
    if q is not None:
      q_rows = q_rows.at[i].set(q)
    drafts = drafts.at[i].set(nxt)
    conf = conf.at[i].set(confidence.astype(jnp.float32))
    return i + 1, buffer, nxt, drafts, conf, q_rows, confidence >= threshold, key

  init = (jnp.int32(0), DraftBuffer.like(cache, gamma), last, drafts, conf, q_rows,
          jnp.bool_(True), key)
  if limit is None and threshold <= 0.0:  # every draft's confidence is >= 0: no early stop
    final = jax.lax.fori_loop(0, gamma, lambda _, carry: body(carry), init)
  else:
    final = jax.lax.while_loop(cond, body, init)
  n, _, _, drafts, conf, q_rows, _, _ = final
  return n, drafts, conf, q_rows


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


def _routed_choice(state, graphdef, plan, h, i, key, vocab, sampling):
  """DynaSpec: the router picks k(i) clusters from the draft's final hidden state h; the
  head scores their tokens only, beside the plan's static core (`plan.vocab`, rows held)
  when it has one. One `lax.switch` branch per distinct k, so each draft position gathers
  a shortlist of its own static size."""
  model = nnx.merge(graphdef, state)
  router = plan.router
  sizes = sorted(set(router.ks), reverse=True)
  branch_of = jnp.asarray([sizes.index(k) for k in router.ks], jnp.int32)
  core = None if plan.vocab is None else (
      plan.vocab, model.head_shortlist(h[None, None], plan.vocab, plan.weights,
                                       plan.head_rows)[0, 0])

  def branch(k):
    def run(h, key):
      ids = router.shortlist(h, k)
      logits = model.head_shortlist(h[None, None], ids, plan.weights,
                                    head_rows=router.head_rows)[0, 0]
      if core is not None:  # the router's table leaves the core's ids out: no duplicates
        ids, logits = jnp.concatenate([core[0], ids]), jnp.concatenate([core[1], logits])
      nxt, conf, q = _choose(logits, ids, key, vocab, sampling)
      return nxt, conf, (jnp.zeros((0,), jnp.float32) if q is None else q)
    return run

  b = branch_of[jnp.minimum(i, len(router.ks) - 1)]
  nxt, conf, q = jax.lax.switch(b, [branch(k) for k in sizes], h, key)
  return nxt, conf, (None if sampling.greedy else q)


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


def draft_fn(state, cache, last, plan, key, limit=None, *, graphdef, vocab, gamma, threshold,
             sampling) -> Draft:
  """Draft up to min(γ, limit) tokens under `plan`, reading the verified cache (never
  writing it). `limit` is traced: drafters that choose the draft length per round (KnapSpec)
  share one executable. None drafts γ, a length XLA then knows when nothing stops early."""
  n, drafts, conf, q_rows = _draft(state, cache, last, plan, key, limit,
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
  return RoundOut(tokens=tokens, n_commit=a + 1, n_drafted=draft.n, drafts=draft.tokens,
                  target_top1=target, residuals=res), cache


def round_fn(state, cache, last, plan, key, *, graphdef, vocab, gamma, threshold, sampling,
             residuals=False) -> tuple[RoundOut, KVCache]:
  """A whole round as one pure function (the tests vmap it over keys)."""
  k_draft, k_accept = jax.random.split(key)
  draft = draft_fn(state, cache, last, plan, k_draft, graphdef=graphdef, vocab=vocab,
                   gamma=gamma, threshold=threshold, sampling=sampling)
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


# The static shortlists' head rows gathered last, newest first, kept from one generation to
# the next: FR-Spec's shortlist and the model stay the same from prompt to prompt, and
# gathering the rows again cost 30-35 ms a prompt on SmolLM2 on the CPU (32k rows, 75 MB);
# an H200 run booked a fifth of FR-Spec's decode time to selection, where this gather is.
# More than one: a bench run alternates drafters prompt by prompt, and `self_sd+frspec`
# beside `8bit+frspec` (float32 rows, then int8 rows) re-gathered at every prompt when one
# set was held, 6 % of self_sd+frspec's decode time on Qwen2.5-0.5B. Entries are (weakref
# to the state, vocab, weights, rows).
_HEAD_ROWS: list[tuple] = []
_HEAD_ROWS_HELD = 4  # Qwen2.5-0.5B's 32k float32 rows are 117 MB, its untied head 545
_UNTIED_HEAD = "untied head"  # the key of a router's head rows (`RouterPlan.head_rows`)


@dataclasses.dataclass
class Session:
  """Read-only view of a generation in progress, handed to drafters."""

  graphdef: nnx.GraphDef
  state: nnx.State
  config: ModelConfig
  cache: KVCache  # the verified cache; context[-1] is not in it yet
  context: list[int]  # prompt + committed tokens
  prompt_embedding: jax.Array | None = None  # float32[D], `generate.pooled_prompt`
  # The generation's compilations: drafters compile through `compiled(..., clock=` this)
  # so that the engine books the time as compilation, not selection or decoding.
  clock: CompileClock = dataclasses.field(default_factory=CompileClock)
  _scorers: dict = dataclasses.field(default_factory=dict, repr=False)

  def with_head_rows(self, plan: DraftPlan) -> DraftPlan:
    """`plan` with its static shortlist's head rows gathered (`DraftPlan.head_rows`), and a
    router's untied float head as rows (`RouterPlan.head_rows`), once while the model, the
    shortlist and the draft weights stay the same objects: across generations too
    (`_HEAD_ROWS`). Gathering 16k of a 1.5B's tied-embedding rows in every draft step cost
    more than the full head's matmul on a CPU."""
    router = plan.router
    if (router is not None and router.head_rows is None and not self.config.tie_embeddings
        and (plan.weights is None or plan.weights.head is None)):
      rows = self._held(_UNTIED_HEAD, None, untied_head_rows)
      plan = plan.replace(router=router.replace(head_rows=rows))
    if plan.vocab is None or plan.head_rows is not None:
      return plan
    return plan.replace(head_rows=self._held(plan.vocab, plan.weights, shortlist_rows,
                                             plan.vocab, plan.weights))

  def _held(self, vocab, weights, gather, *args):
    """`gather(state, *args)`'s rows, held under (this state, `vocab`, `weights`) and
    computed once while they stay in `_HEAD_ROWS`."""
    for model, held_vocab, held_weights, rows in _HEAD_ROWS:
      if model() is self.state and held_vocab is vocab and held_weights is weights:
        return rows
    args = (self.state, *args)
    rows = compiled(gather, *args, graphdef=self.graphdef, clock=self.clock)(*args)
    jax.block_until_ready(rows)  # its time is the caller's (selection), not a round's
    # dropped with the model: the rows would otherwise outlive its weights
    model = weakref.ref(self.state, lambda _: _HEAD_ROWS.clear())
    _HEAD_ROWS.insert(0, (model, vocab, weights, rows))
    del _HEAD_ROWS[_HEAD_ROWS_HELD:]
    return rows

  def dense_cache(self) -> KVCache:
    """The verified cache as a full-precision `KVCache` (itself, or an 8-bit view of a
    quantised one) for code that indexes slots by position, like the layer probes."""
    if isinstance(self.cache, KVCache):
      return self.cache
    from specjax.quant_kv_cache import dense_view

    return compiled(dense_view, self.cache, bits=8, clock=self.clock)(self.cache)

  def score(self, plan: DraftPlan, window: int = 32) -> float | None:
    """Top-1 agreement of `plan` over the last `window` committed tokens (None if fewer)."""
    end = len(self.context) - 1  # == cache.length
    if end < window + 1:
      return None
    start = end - window
    toks = jnp.asarray(self.context[start:end], jnp.int32)
    targets = jnp.asarray(self.context[start + 1 : end + 1], jnp.int32)
    sig = (window, jax.tree.structure(plan), tuple(x.shape for x in jax.tree.leaves(plan)))
    if sig not in self._scorers:  # `compiled`'s own lookup walks every parameter
      self._scorers[sig] = compiled(agreement, self.state, self.cache, toks, targets,
                                    jnp.int32(start), plan, graphdef=self.graphdef,
                                    clock=self.clock)
    return float(self._scorers[sig](self.state, self.cache, toks, targets, jnp.int32(start),
                                    plan))


@dataclasses.dataclass
class SSDGeneration:
  prompt_tokens: list[int]
  tokens: list[int]
  rounds: int
  drafted: int
  accepted: int
  committed: int  # tokens kept from verification rounds (bonus included, EOS-truncated)
  compile_s: float
  prefill_s: float
  draft_s: float  # inside the jitted draft calls (host loop)
  verify_s: float  # inside the jitted verify + accept calls (host loop)
  selection_s: float  # drafter.plan / drafter.update on the host
  other_s: float  # the rest of the decode loop (bookkeeping, streaming, host reads)
  stopped_on_eos: bool
  rounds_s: float = 0.0  # inside the device round loop (draft + verify, not split)
  loop: str = "host"  # "host": a draft and a verify call per round; "device": `round_loop`
  plans: list[DraftPlan] = dataclasses.field(default_factory=list)
  round_drafted: list[int] = dataclasses.field(default_factory=list)  # per round
  round_accepted: list[int] = dataclasses.field(default_factory=list)  # per round
  # per round, each draft's top-1 probability (host loop with record_rounds: draft-length fits)
  round_confidence: list[list[float]] = dataclasses.field(default_factory=list)
  # per round, its draft call's and verify call's seconds (host loop with record_rounds):
  # the distribution behind draft_s and verify_s (first calls, outliers, per draft length)
  round_seconds: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  drafter_state: object = None  # final state: the `prior` of the next generation
  compiles: int = 0  # executables compiled for this run (prefill included): 0 when cached

  @property
  def decode_s(self) -> float:
    return self.draft_s + self.verify_s + self.rounds_s + self.selection_s + self.other_s

  @property
  def mean_accepted(self) -> float:
    """M: tokens committed per verification round, bonus token included."""
    return self.committed / self.rounds if self.rounds else 0.0

  @property
  def acceptance_rate(self) -> float:
    """α: accepted draft tokens / drafted tokens."""
    return self.accepted / self.drafted if self.drafted else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    n = len(self.tokens) - 1  # the first token comes from prefill
    return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


@dataclasses.dataclass
class _Run:
  """What both round drivers share: the request, the prefill and the drafter's state."""

  graphdef: nnx.GraphDef
  state: nnx.State
  config: ModelConfig
  prompt_tokens: list[int]
  drafter: object
  dstate: object
  session: Session
  cache: object
  first: int
  key: jax.Array
  max_new_tokens: int
  gamma: int
  threshold: float
  sampling: SamplingParams
  eos: set[int]
  on_token: Callable[[int], None] | None
  kv_cache: object

  @property
  def draft_static(self) -> dict:
    return dict(graphdef=self.graphdef, vocab=self.config.vocab_size, gamma=self.gamma,
                threshold=self.threshold, sampling=self.sampling)


def speculative_generate(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    config: ModelConfig,
    prompt_tokens: Sequence[int],
    drafter,
    *,
    max_new_tokens: int = 64,
    gamma: int = 4,
    threshold: float | None = None,
    sampling: SamplingParams = SamplingParams(),
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    on_token: Callable[[int], None] | None = None,
    record_rounds: bool = False,
    drafter_state=None,
    kv_cache=None,
    prefilled: Prefilled | None = None,
    loop: str = "auto",
    rounds_per_call: int | None = None,
    static_plan: bool | None = None,
) -> SSDGeneration:
  """Self-speculative decoding of one prompt: prefill, then rounds of draft and verify.

  `gamma` is the longest draft; a drafter may choose a shorter one per round
  (`Drafter.draft_length`). `threshold` (draft early stop on top-1 probability) defaults
  to the drafter's own (0.8, Self-SD; 0.7, KnapSpec). `kv_cache` (default: the drafter's,
  full precision for all but QuantSpec) is None or a `quant_kv_cache.QuantKV`: one
  quantised cache that verification reads at 8 bits and a `kv_bits=4` plan at 4.
  `prefilled`: this prompt's `generate.prefill_prompt` (same cache type, sampling and seed,
  room for max_new_tokens + gamma + 1) to start from instead of prefilling again.
  `loop`: "device" runs the rounds inside one jitted loop (`round_loop`; drafters whose
  plan is fixed for the generation, and `chunked` ones between their selections), "host"
  a draft and a verify call per round with their times apart (the other adaptive
  drafters; profiling), "auto" the device loop where it can.
  `rounds_per_call` (device loop): rounds between host reads (default: all of them, or
  4 when streaming to `on_token`). `static_plan` (device loop): compile the drafter's
  plan into the executable (`DraftPlan.freeze`: no per-layer conditional, one compile
  per plan) rather than trace it (one executable for every plan). None: the backend's
  choice (`round_loop.freezes`): on accelerators, where each conditional is a host round
  trip, a plan that holds for the rest of the generation is frozen (a fixed plan; SWIFT's
  once its search ends); a CPU, and plans that change at selections, stay traced.
  `record_rounds` keeps each round's plan and, on the host loop, its drafts' top-1
  probabilities (what `draft_length.best_length_and_threshold` replays) and its draft and
  verify calls' seconds: a diagnostic, one more host read per round.
  """
  threshold = drafter.threshold if threshold is None else threshold
  kv_cache = drafter.kv_cache if kv_cache is None else kv_cache
  if gamma < 1:
    raise ConfigError(f"gamma (draft length) must be >= 1, got {gamma}")
  if not 0.0 <= threshold <= 1.0:
    raise ConfigError(f"threshold must be in [0, 1], got {threshold}")
  if loop not in ("auto", "host", "device"):
    raise ConfigError(f"loop must be 'auto', 'host' or 'device', got {loop!r}")
  on_host = drafter.adaptive and not drafter.chunked  # its update needs every round
  if loop == "device" and on_host:
    raise ConfigError(f"the {drafter.name} drafter changes its plan between rounds on the host: "
                     f"it runs with loop='host' (or 'auto')")
  size = check_prompt(prompt_tokens, max_new_tokens + gamma + 1, config.max_context)
  if kv_cache is not None and kv_cache.max_step < gamma + 1:
    raise ConfigError(f"a round appends gamma + 1 = {gamma + 1} tokens to the quantised cache, "
                     f"which keeps room for {kv_cache.max_step}: raise QuantKV.headroom "
                     f"(<= R = {kv_cache.residual}) or lower gamma")
  pre, first, cache = start_decoding(prefilled, graphdef, state, config, prompt_tokens,
                                     size=size, kv_cache=kv_cache, sampling=sampling, seed=seed)
  first = int(first[0])
  if on_token:
    on_token(first)
  t1 = time.perf_counter()
  session = Session(graphdef, state, config, cache, list(prompt_tokens) + [first], pre.pooled)
  clock = session.clock
  c0 = clock.seconds
  dstate = drafter.init(session, drafter_state)
  init_compile_s = clock.seconds - c0  # a drafter's first DP compiles here
  init_s = time.perf_counter() - t1 - init_compile_s
  run = _Run(graphdef, state, config, list(prompt_tokens), drafter, dstate, session, cache,
             first, pre.key, max_new_tokens, gamma, threshold, sampling,
             set(config.eos_ids if eos_ids is None else eos_ids), on_token, kv_cache)
  if loop == "host" or (loop == "auto" and on_host):
    gen = _host_rounds(run, record_rounds)
  else:
    from specjax.decode.round_loop import device_rounds

    gen = device_rounds(run, record_rounds, rounds_per_call, static_plan)
  gen.compile_s += pre.compile_s + init_compile_s
  gen.compiles = pre.compiles + clock.count
  gen.prefill_s = pre.prefill_s
  gen.selection_s += init_s
  return gen


@dataclasses.dataclass
class _HostPrograms:
  """The host loop's executables, compiled on first use (booked on the session's clock):
  a draft executable per plan structure (a shortlist adds a field) and a verify executable
  per draft length. Kept here, since `compiled`'s own lookup hashes the graphdef and walks
  every parameter."""

  run: _Run
  proto: Draft  # the Draft's shapes: a verifier compiles before the first draft exists
  drafts: dict = dataclasses.field(default_factory=dict)
  verifiers: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, run: _Run) -> _HostPrograms:
    proto = jax.eval_shape(functools.partial(draft_fn, **run.draft_static), run.state,
                           run.cache, jnp.int32(run.first),
                           DraftPlan.full(run.config.num_layers), run.key,
                           jnp.int32(run.gamma))
    return cls(run, proto)

  def draft(self, plan: DraftPlan, cache):
    run = self.run
    sig = (jax.tree.structure(plan), tuple(x.shape for x in jax.tree.leaves(plan)))
    if sig not in self.drafts:
      self.drafts[sig] = compiled(draft_step, run.state, cache, jnp.int32(run.first), plan,
                                  run.key, jnp.int32(run.gamma), clock=run.session.clock,
                                  **run.draft_static)
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


def _commit(tokens: list[int], new: list[int], run: _Run) -> tuple[int, bool]:
  """Append a round's committed tokens up to the first EOS or the token budget, streaming
  each to `run.on_token`: (how many were kept, whether the generation ends with them)."""
  for i, t in enumerate(new):
    tokens.append(t)
    if run.on_token:
      run.on_token(t)
    if t in run.eos or len(tokens) >= run.max_new_tokens:
      return i + 1, True
  return len(new), False


def _host_rounds(run: _Run, record_rounds: bool) -> SSDGeneration:
  """A draft call and a verify call per round, the drafter consulted between them: exact
  draft / verify times, and plans that change every round (SWIFT, CLaSp, KnapSpec)."""
  state, drafter, gamma = run.state, run.drafter, run.gamma
  cache, key, dstate, session = run.cache, run.key, run.dstate, run.session
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
    t_c = time.perf_counter()
    draft = draft_exe(state, cache, last, plan, k_draft, jnp.int32(length))
    draft.n.block_until_ready()
    t_v = time.perf_counter()
    out, cache = verify(state, cache, last, draft, full, k_accept)
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
    late_compile_s += (c1 - c0) + (c3 - c1) + (c4 - c3)
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
