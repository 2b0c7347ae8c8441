"""What a generation in progress is, for the drafters and the two round drivers.

`Session` is the drafters' read-only view (the model, the verified cache, the context,
the compile clock), with the head rows of a shortlisted draft head held across
generations. `Run` is what both drivers (`host_loop`, `round_loop`) share: the request,
the prefill and the drafter's state. `SSDGeneration` is what either returns.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ModelConfig
from specjax.decode.round import agreement, shortlist_rows, untied_head_rows
from specjax.jit_cache import CompileClock, compiled
from specjax.kv_cache import KVCache
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams

# The static shortlists' head rows gathered last, newest first, kept from one generation to
# the next: FR-Spec's shortlist and the model stay the same from prompt to prompt, and
# gathering the rows again (tens of MB for a 32k shortlist) is a real share of a short
# prompt's decode time, booked to selection. More than one: a bench run alternates drafters
# prompt by prompt, and `self_sd+frspec` beside `8bit+frspec` (float32 rows, then int8
# rows) would re-gather at every prompt if one set were held. Entries are (weakref
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
  # The generation's draft early stop (the caller's, or the drafter's own): where a
  # drafter that adapts it between rounds (`DraftPlan.stop`) starts. None: not known.
  threshold: float | None = None
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
class Run:
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
  hidden: jax.Array  # float32[D] the prefill's final hidden state that gave `first`
  key: jax.Array
  max_new_tokens: int
  gamma: int
  threshold: float
  sampling: SamplingParams
  eos: set[int]
  on_token: Callable[[int], None] | None
  kv_cache: object
  plan_path: str = "cond"  # `ops.plan_path`: how the host loop's draft runs its plan

  @property
  def draft_static(self) -> dict:
    return dict(graphdef=self.graphdef, vocab=self.config.vocab_size, gamma=self.gamma,
                threshold=self.threshold, sampling=self.sampling)
