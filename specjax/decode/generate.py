"""Autoregressive generation: one jitted prefill, then decoding in chunks on the device.

A chunk is one jitted `lax.while_loop` over decode steps that stops at `chunk` tokens,
an EOS or the token budget, so the host reads the device once per chunk, not once per
token; smaller chunks stream text sooner. The cache is donated and written in place;
sampling is fused into the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import sharding
from specjax.errors import ConfigError
from specjax.gguf_matrix import GGUFMatrix
from specjax.jit_cache import CompileClock, compiled
from specjax.kv_cache import ContextOverflowError, KVCache, cache_size_for
from specjax.model import apply
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams, sample


def positions_for(cache: KVCache, T: int, B: int) -> jax.Array:
  """Absolute positions of T new tokens appended at cache.length."""
  return jnp.broadcast_to(cache.length + jnp.arange(T, dtype=jnp.int32), (B, T))


PROMPT_BUCKET = 64


def pad_prompt(prompt_tokens: Sequence[int], limit: int, bucket: int = PROMPT_BUCKET) -> jax.Array:
  """Prompt ids right-padded to a multiple of `bucket` (at most `limit`, the cache size):
  prompts of nearby lengths share one prefill executable. The padding's K/V lands past
  the cache length and is dead."""
  n = len(prompt_tokens)
  padded = min(-(-n // bucket) * bucket, limit)
  return jnp.asarray([list(prompt_tokens) + [0] * (padded - n)], jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "return_pooled"),
                   donate_argnames=("cache",))
def prefill_step(
    state: nnx.State,
    cache: KVCache,
    tokens: jax.Array,
    n: jax.Array,
    plan: DraftPlan,
    key: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    sampling: SamplingParams,
    return_pooled: bool = False,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array, jax.Array]:
  """Process a padded prompt tokens[B, T] of which the first n are real; return the first
  new token [B] and the cache holding exactly the n prompt tokens. On request (B = 1) also
  the prompt embedding [D] (KNN-SSD's key, `pooled_prompt`) and the final hidden state
  that gave the first token, float32[D] (the first round's h̃_{t−1}, `round.draft_fn`)."""
  B, T = tokens.shape
  start = cache.length
  out, cache = apply(state, cache, tokens, positions_for(cache, T, B), plan, graphdef=graphdef,
                     logits="none", valid=n)
  model = nnx.merge(graphdef, state)
  last = jax.lax.dynamic_slice_in_dim(out.hidden, n - 1, 1, axis=1)
  logits = model.head(last)[:, 0]
  if return_pooled:
    return (sample(key, logits, sampling), cache.with_length(start + n),
            pooled_prompt(model, out.hidden[0], n), last[0, 0].astype(jnp.float32))
  return sample(key, logits, sampling), cache.with_length(start + n)


PREFILL_CHUNK = 2048


@dataclasses.dataclass(frozen=True)
class Prefill:
  """A prompt's prefill as compiled calls of at most `chunk` tokens each.

  One call over a T-token prompt materialises [N, T, S] attention scores: 15 GB per layer
  for Qwen2.5-0.5B at 16k. Chunk by chunk, each chunk attending to the cache written by
  the ones before, it needs [N, chunk, S] and gives the same cache, token and hidden
  states (the tests check). On a quantised cache later chunks read the earlier ones at
  8 bits, as decoding does, rather than in full precision. Prompts within one chunk take
  a single call, as before.
  Compiled at construction, so that calling it times prefilling only.
  """

  calls: tuple[tuple[object, jax.Array, jax.Array], ...]  # (executable, tokens[1, C], n)
  return_pooled: bool
  length: int  # prompt tokens, for the pooled mean without a device read

  @classmethod
  def build(cls, state: nnx.State, cache, prompt_tokens: Sequence[int], plan: DraftPlan,
            key: jax.Array, *, graphdef: nnx.GraphDef, sampling: SamplingParams,
            return_pooled: bool = False, chunk: int | None = None,
            clock: CompileClock | None = None) -> Prefill:
    chunk = chunk or PREFILL_CHUNK
    if chunk % PROMPT_BUCKET:
      raise ConfigError(f"the prefill chunk must be a multiple of {PROMPT_BUCKET}, got {chunk}")
    ids, size, calls = list(prompt_tokens), cache.size, []
    for start in range(0, len(ids), chunk):
      piece = ids[start : start + chunk]
      tokens, n = pad_prompt(piece, size - start), jnp.int32(len(piece))
      exe = compiled(prefill_step, state, cache, tokens, n, plan, key, graphdef=graphdef,
                     sampling=sampling, return_pooled=return_pooled, clock=clock)
      calls.append((exe, tokens, n))
    return cls(tuple(calls), return_pooled, len(ids))

  def __call__(self, state: nnx.State, cache, plan: DraftPlan, key: jax.Array):
    """(token, cache) or (token, cache, pooled, hidden): the pooled prompt embedding is
    the token-weighted mean of the chunks' means (exact); the hidden state, the last
    chunk's."""
    pooled_sum = 0.0
    for exe, tokens, n in self.calls:
      out = exe(state, cache, tokens, n, plan, key)
      cache = out[1]
      if self.return_pooled:
        pooled_sum = pooled_sum + out[2] * n.astype(jnp.float32)
    if not self.return_pooled:
      return out
    return out[0], cache, pooled_sum / self.length, out[3]


@dataclasses.dataclass(frozen=True)
class Prefilled:
  """A prompt already prefilled: what a decode loop starts from.

  Runs over one prompt that read the same kind of cache (AR on the 8-bit cache and each
  QuantSpec drafter, say) can start from one prefill: at 16k tokens on a CPU a prefill
  costs minutes and decoding seconds. A run decodes on its own copy of the cache (`start`),
  since decoding donates it, so the prefill can be reused any number of times.
  """

  prompt_tokens: tuple[int, ...]
  first: jax.Array  # [1] the token after the prompt
  cache: object  # KVCache | QuantKVCache holding exactly the prompt
  pooled: jax.Array  # float32[D] prompt embedding (`pooled_prompt`)
  hidden: jax.Array  # float32[D] the final hidden state that gave `first`
  key: jax.Array  # the generation's key after the prefill took its split
  kv_cache: object  # QuantKV | None: the cache type
  sampling: SamplingParams
  seed: int
  compile_s: float
  prefill_s: float
  compiles: int = 0  # executables compiled for it (0 when all were cached)

  def start(self):
    """(first token, a copy of the cache to decode on)."""
    return self.first, jax.tree.map(jnp.copy, self.cache)

  def check_fits(self, prompt_tokens: Sequence[int], size: int, kv_cache, sampling, seed):
    """Raise unless a run with these arguments would have made this very prefill."""
    wanted = dict(prompt=tuple(prompt_tokens), kv_cache=kv_cache, sampling=sampling, seed=seed)
    have = dict(prompt=self.prompt_tokens, kv_cache=self.kv_cache, sampling=self.sampling,
                seed=self.seed)
    for name in wanted:
      if wanted[name] != have[name]:
        raise ConfigError(f"the prefilled prompt was made with another {name} than this run's")
    if self.cache.size < size:
      raise ConfigError(f"the prefilled cache holds {self.cache.size} tokens; this run needs "
                       f"{size}: prefill with a larger max_new_tokens")


def prefill_prompt(graphdef: nnx.GraphDef, state: nnx.State, config, prompt_tokens: Sequence[int],
                   *, max_new_tokens: int = 64, sampling: SamplingParams = SamplingParams(),
                   seed: int = 0, kv_cache=None, cache_dtype=None,
                   size: int | None = None) -> Prefilled:
  """Prefill one prompt (B = 1) into a new cache with room for `max_new_tokens` more (or
  `size` slots): the first step of `generate` and `speculative_generate`, which accept the
  result as `prefilled=` to share it."""
  from specjax.quant_kv_cache import create_cache

  size = size or check_prompt(prompt_tokens, max_new_tokens, config.max_context)
  cache = create_cache(config, size, kv_cache, cache_dtype or compute_dtype(config, state))
  full = DraftPlan.full(config.num_layers)
  key = jax.random.key(seed)
  t0, clock = time.perf_counter(), CompileClock()
  prefill = Prefill.build(state, cache, prompt_tokens, full, key, graphdef=graphdef,
                          sampling=sampling, return_pooled=True, clock=clock)
  t1 = time.perf_counter()
  key, sub = jax.random.split(key)
  first, cache, pooled, hidden = prefill(state, cache, full, sub)
  first.block_until_ready()
  if kv_cache is not None:
    cache.check_finite()
  t2 = time.perf_counter()
  return Prefilled(tuple(prompt_tokens), first, cache, pooled, hidden, key, kv_cache, sampling,
                   seed, compile_s=t1 - t0, prefill_s=t2 - t1, compiles=clock.count)


def start_decoding(prefilled: Prefilled | None, graphdef, state, config, prompt_tokens, *,
                   size: int, kv_cache, sampling: SamplingParams, seed: int,
                   cache_dtype=None):
  """(prefill, first token, cache to decode on): `prefilled` checked and copied, or a new
  prefill of `size` slots owned by this run (no copy)."""
  if prefilled is None:
    pre = prefill_prompt(graphdef, state, config, prompt_tokens, sampling=sampling, seed=seed,
                         kv_cache=kv_cache, cache_dtype=cache_dtype, size=size)
    return pre, pre.first, pre.cache
  prefilled.check_fits(prompt_tokens, size, kv_cache, sampling, seed)
  return (prefilled, *prefilled.start())


def weight_dtype(state: nnx.State):
  """The model's weight dtype."""
  return state["embedding"].get_value().dtype  # a `GGUFMatrix` computes in float32


def compute_dtype(config, state: nnx.State):
  """The dtype a forward computes activations in, and its KV cache's default: the
  config's `activation_dtype`, else the weights'."""
  return jnp.dtype(config.activation_dtype or weight_dtype(state))


def precision_name(config, state: nnx.State) -> str:
  """The `--dtype` a loaded model runs at: "float32", "bfloat16", "mixed" (bfloat16
  weights computed in float32) or "gguf" (its file's blocks). Saved measurements (latency
  profiles, Self-SD searches) are keyed by it."""
  if _block_matrices(state):
    return "gguf"
  weights, compute = jnp.dtype(weight_dtype(state)), compute_dtype(config, state)
  return weights.name if weights == compute else "mixed"


def weight_bits(state: nnx.State) -> float:
  """Bits a weight of the model's matrices takes on average: its dtype's, or under
  `--dtype gguf` its blocks' (scales included: 5 for SmolLM2's Q4_1, 8.5 for Q8_0). Draft
  costs priced in bytes read (`selection.cost`) scale the target by it."""
  blocks = _block_matrices(state)
  if not blocks:
    return 8.0 * jnp.dtype(weight_dtype(state)).itemsize
  return 8.0 * sum(m.nbytes for m in blocks) / sum(math.prod(m.shape) for m in blocks)


def _block_matrices(state: nnx.State) -> list[GGUFMatrix]:
  return [v.get_value() for _, v in nnx.to_flat_state(state)
          if isinstance(v.get_value(), GGUFMatrix)]


def pooled_prompt(model, hidden: jax.Array, n: jax.Array) -> jax.Array:
  """The mean over the n real prompt tokens of the last hidden state (after the final
  norm, as a model's `last_hidden_state` is): [T, D] -> float32[D]. Without the norm a
  few massive-activation channels of the residual stream dominate every cosine."""
  h = model.final_norm(hidden).astype(jnp.float32)
  real = (jnp.arange(h.shape[0]) < n)[:, None]
  return jnp.sum(jnp.where(real, h, 0.0), axis=0) / n.astype(jnp.float32)


def _step(
    state: nnx.State,
    cache: KVCache,
    token: jax.Array,
    plan: DraftPlan,
    key: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    sampling: SamplingParams,
) -> tuple[jax.Array, KVCache]:
  """Feed token[B] and pick the next one."""
  B = token.shape[0]
  out, cache = apply(
      state, cache, token[:, None], positions_for(cache, 1, B), plan, graphdef=graphdef,
      logits="last",
  )
  return sample(key, out.logits[:, -1], sampling), cache


# One AR step as its own executable (profiling, timing plans step by step).
decode_step = jax.jit(_step, static_argnames=("graphdef", "sampling"), donate_argnames=("cache",))


def eos_array(eos_ids) -> jax.Array:
  """EOS ids as a traced int32 vector (-1 when there are none): a new EOS set reuses the
  executable."""
  return jnp.asarray(sorted(eos_ids) or [-1], jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "chunk"),
                   donate_argnames=("cache",))
def decode_chunk(
    state: nnx.State,
    cache: KVCache,
    token: jax.Array,
    key: jax.Array,
    budget: jax.Array,
    eos: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    sampling: SamplingParams,
    chunk: int,
) -> tuple[jax.Array, jax.Array, jax.Array, KVCache, jax.Array]:
  """Up to min(chunk, budget) decode steps after token[1] (B = 1), stopping after an EOS.

  Returns (tokens int32[chunk] of which the first n are new, n, the last token [1], the
  cache, the key). Each step splits the key once, whatever the chunk, so a chunk size
  changes no token."""
  plan = DraftPlan.full(nnx.merge(graphdef, state).config.num_layers)
  limit = jnp.minimum(budget, chunk)

  def cond(carry):
    i, _, _, _, _, stop = carry
    return (i < limit) & ~stop

  def body(carry):
    i, out, token, cache, key, _ = carry
    key, sub = jax.random.split(key)
    token, cache = _step(state, cache, token, plan, sub, graphdef=graphdef, sampling=sampling)
    return i + 1, out.at[i].set(token[0]), token, cache, key, jnp.isin(token[0], eos)

  init = (jnp.int32(0), jnp.zeros((chunk,), jnp.int32), token, cache, key, jnp.bool_(False))
  n, out, token, cache, key, _ = jax.lax.while_loop(cond, body, init)
  return out, n, token, cache, key


@dataclasses.dataclass
class Generation:
  prompt_tokens: list[int]
  tokens: list[int]  # generated ids, EOS included if it was produced
  compile_s: float
  prefill_s: float
  decode_s: float
  stopped_on_eos: bool
  compiles: int = 0  # executables compiled for this run (prefill included): 0 when cached

  @property
  def decode_tokens_per_s(self) -> float:
    """Tokens after the first, over the decode loop time (prefill excluded)."""
    n = len(self.tokens) - 1
    return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


def check_prompt(prompt_tokens: Sequence[int], max_new_tokens: int, max_context: int) -> int:
  """Validate the request; return the cache size to allocate (room for the padded
  prompt included)."""
  if len(prompt_tokens) == 0:
    raise ConfigError("the prompt is empty: give at least one token")
  if max_new_tokens < 1:
    raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  needed = len(prompt_tokens) + max_new_tokens
  if needed > max_context:
    raise ContextOverflowError(
        f"prompt of {len(prompt_tokens)} tokens + {max_new_tokens} new tokens = {needed} "
        f"exceeds the model's context of {max_context} tokens"
    )
  padded = -(-len(prompt_tokens) // PROMPT_BUCKET) * PROMPT_BUCKET
  return cache_size_for(max(needed, min(padded, max_context)), max_context)


@sharding.on_the_models_mesh
def generate(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    config,
    prompt_tokens: Sequence[int],
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams = SamplingParams(),
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    on_token: Callable[[int], None] | None = None,
    cache_dtype=None,
    kv_cache=None,
    prefilled: Prefilled | None = None,
    chunk: int | None = None,
) -> Generation:
  """Greedy or sampled AR decoding of one prompt (B = 1). `kv_cache`: None for a
  full-precision cache, or a `quant_kv_cache.QuantKV` (the target reads it at 8 bits).
  `prefilled`: this prompt's `prefill_prompt` with the same cache type, sampling and seed,
  to decode from instead of prefilling again (the tokens are the same). `chunk`: tokens
  per device call (default: up to 256, or 16 when streaming to `on_token`)."""
  size = check_prompt(prompt_tokens, max_new_tokens, config.max_context)
  eos = set(config.eos_ids if eos_ids is None else eos_ids)
  # A chunk size that does not follow max_new_tokens exactly: budgets share a compile.
  chunk = chunk or (16 if on_token else min(256, -(-max(max_new_tokens - 1, 1) // 64) * 64))
  if chunk < 1:
    raise ConfigError(f"chunk must be >= 1, got {chunk}")
  tokens: list[int] = []

  def emit(tok: int) -> bool:
    tokens.append(tok)
    if on_token is not None:
      on_token(tok)
    return tok in eos or len(tokens) >= max_new_tokens

  pre, token, cache = start_decoding(prefilled, graphdef, state, config, prompt_tokens,
                                     size=size, kv_cache=kv_cache, sampling=sampling, seed=seed,
                                     cache_dtype=cache_dtype)
  key, eos_ids = pre.key, eos_array(eos)
  t_compile, clock = time.perf_counter(), CompileClock()
  # Compiled before the loop, so that the timing below measures decoding only.
  run = compiled(decode_chunk, state, cache, token, key, jnp.int32(0), eos_ids,
                 graphdef=graphdef, sampling=sampling, chunk=chunk, clock=clock)
  done = emit(int(token[0]))
  t1 = time.perf_counter()
  while not done:
    budget = jnp.int32(max_new_tokens - len(tokens))
    out, n, token, cache, key = run(state, cache, token, key, budget, eos_ids)
    out, n = jax.device_get((out, n))  # the chunk's one host read
    for tok in out[:n].tolist():
      done = emit(tok)
  t2 = time.perf_counter()
  if kv_cache is not None:
    cache.check_finite()
  return Generation(
      prompt_tokens=list(prompt_tokens),
      tokens=tokens,
      compile_s=pre.compile_s + (t1 - t_compile),
      prefill_s=pre.prefill_s,
      decode_s=t2 - t1,
      stopped_on_eos=bool(tokens) and tokens[-1] in eos,
      compiles=pre.compiles + clock.count,
  )


class TextStream:
  """Turns ids into text pieces as they arrive, holding back incomplete UTF-8 characters."""

  def __init__(self, decode: Callable[[list[int]], str]):
    self._decode = decode
    self._ids: list[int] = []
    self._printed = 0

  def push(self, token: int) -> str:
    self._ids.append(token)
    text = self._decode(self._ids)
    if text.endswith("\ufffd"):
      return ""
    piece, self._printed = text[self._printed :], len(text)
    return piece

