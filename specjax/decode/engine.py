"""`speculative_generate`: self-speculative decoding of one prompt. It checks the request,
prefills, lets the drafter start, and hands the rounds to one of two drivers: the device
loop (`round_loop`), or the host loop (`host_loop`) for drafters that re-plan after every
round and for timing drafting and verification apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from flax import nnx

from specjax import ops, sharding
from specjax.config import ModelConfig
from specjax.decode.generate import Prefilled, check_prompt, start_decoding
from specjax.decode.host_loop import host_rounds
from specjax.decode.round_loop import device_rounds
from specjax.decode.session import Run, Session, SSDGeneration
from specjax.errors import ConfigError
from specjax.sampling import SamplingParams


@sharding.on_the_models_mesh
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
    plan_path: str | None = None,
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
  `plan_path` (host loop): how the draft runs its plan, "cond" (one executable, a
  conditional per sub-layer) or "dispatch" (an executable per sub-layer the plan runs,
  called from the host: `dispatched_draft`); None: the backend's, `ops.plan_path`.
  "dispatch" drafts on the host loop, so `loop` must not be "device".
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
  plan_path = ops.plan_path() if plan_path is None else plan_path
  if plan_path not in ops.PLAN_PATHS:
    raise ConfigError(f"plan_path (or SPECJAX_PLAN_PATH) must be one of "
                      f"{', '.join(ops.PLAN_PATHS)}, got {plan_path!r}")
  if plan_path == "dispatch" and loop == "device":
    raise ConfigError("plan_path='dispatch' calls a program per sub-layer from the host: it "
                      "runs with loop='host' (or 'auto')")
  # an adaptive drafter's update needs every round; a dispatched plan is run from the host
  on_host = (drafter.adaptive and not drafter.chunked) or plan_path == "dispatch"
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
  session = Session(graphdef, state, config, cache, list(prompt_tokens) + [first], pre.pooled,
                    threshold=threshold)
  clock = session.clock
  c0 = clock.seconds
  dstate = drafter.init(session, drafter_state)
  init_compile_s = clock.seconds - c0  # a drafter's first DP compiles here
  init_s = time.perf_counter() - t1 - init_compile_s
  run = Run(graphdef, state, config, list(prompt_tokens), drafter, dstate, session, cache,
             first, pre.hidden, pre.key, max_new_tokens, gamma, threshold, sampling,
             set(config.eos_ids if eos_ids is None else eos_ids), on_token, kv_cache,
             plan_path)
  if loop == "host" or (loop == "auto" and on_host):
    gen = host_rounds(run, record_rounds)
  else:
    gen = device_rounds(run, record_rounds, rounds_per_call, static_plan)
  gen.compile_s += pre.compile_s + init_compile_s
  gen.compiles = pre.compiles + clock.count
  gen.prefill_s = pre.prefill_s
  gen.selection_s += init_s
  return gen
