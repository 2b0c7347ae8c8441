"""The experiment loop every benchmark shares: one prompt → ids path (`data.prompt_ids`), and one per-prompt
runner that decodes it with AR and then with every method in the same process, checking
each method's tokens against AR's.

`specjax bench`, the `experiments/` scripts and `specjax sweep` are thin users of it (with
`drafters.factory` for the drafters and `results_store` for the results), so a speedup in
any of their tables is measured the same way: AR and the methods on the same prompt,
interleaved, with the same budgets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specjax.bench import metrics
from specjax.data import prompt_ids
from specjax.errors import ConfigError
from specjax.sampling import SamplingParams

# What an SSD generation reports, summed over a prompt's turns (metrics.summarize reads them).
COUNTERS = ("rounds", "drafted", "accepted", "committed", "draft_s", "verify_s", "rounds_s",
            "selection_s", "other_s")


def first_ids(model, prompt: Sequence[str] | Sequence[int]) -> list[int]:
  """The ids of a prompt's first turn: ready ids as they are (the model needs no
  tokenizer then), else its first user turn through the model's tokenizer."""
  if prompt and isinstance(prompt[0], int):
    return list(prompt)
  return prompt_ids(model.tokenizer, list(prompt)[:1])


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """What every method of a run shares; each field changes the numbers (fingerprinted)."""

  max_new_tokens: int = 64
  gamma: int = 4  # the longest draft (a drafter with its own policy may draft fewer)
  threshold: float | None = None  # draft early stop; None: each drafter's own
  temperature: float = 0.0
  top_p: float = 1.0
  seed: int = 0
  max_turns: int = 1  # MT-bench prompts have two

  def __post_init__(self):
    if self.gamma < 1:
      raise ConfigError(f"gamma must be >= 1, got {self.gamma}")
    if self.max_new_tokens < 1:
      raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

  @property
  def sampling(self) -> SamplingParams:
    return SamplingParams(self.temperature, self.top_p)


@dataclasses.dataclass(frozen=True)
class Reference:
  """An AR baseline: `kv_cache` None (full precision) or a QuantKV (the target a
  quantised-cache drafter must reproduce)."""

  name: str = metrics.AR
  kv_cache: Any = None


def references_for(drafters: Mapping[str, Any]) -> tuple[Reference, ...]:
  """AR on a full-precision cache, plus AR on each quantised cache a drafter reads (the
  target that drafter must reproduce): `ar_int8kv`, or `ar_int8kv_1`, … when several."""
  caches = list(dict.fromkeys(d.kv_cache for d in drafters.values() if d.kv_cache is not None))
  names = ["ar_int8kv"] if len(caches) == 1 else [f"ar_int8kv_{i}" for i in range(len(caches))]
  return (Reference(),) + tuple(Reference(n, kv) for n, kv in zip(names, caches))


def run_prompt(model, prompt: Sequence[str] | Sequence[int], drafters: Mapping[str, Any],
               settings: RunSettings, *, gammas: Mapping[str, int] | None = None,
               thresholds: Mapping[str, float] | None = None, carried: dict | None = None,
               tags: Mapping[str, Any] | None = None,
               references: Sequence[Reference] | None = None,
               extra: Callable[[str, Any], dict] | None = None) -> list[dict]:
  """One record per method: the references (AR) first, then every drafter.

  `prompt`: user turns (strings; the first `settings.max_turns` are decoded, each method
  answering with its own history) or ready token ids (one turn). `gammas` and
  `thresholds`: per-drafter draft lengths and early-stop thresholds (default
  settings.gamma and settings.threshold). `carried`: drafter states handed from prompt to
  prompt (SWIFT and budgeted KnapSpec learn across prompts); updated in place. A drafter is
  compared with the reference that reads the same KV cache (its tokens must equal that
  AR's); with sampling, `matches_ar` is None. `references` default to `references_for`
  the drafters. Runs reading the same kind of cache share one prefill of the prompt (it is
  not timed, and at 4k tokens on a CPU it costs more than the decoding).
  `extra(name, generation)` adds fields to a drafter's record.
  """
  from specjax.decode.engine import speculative_generate
  from specjax.decode.generate import generate, precision_name, prefill_prompt

  carried = {} if carried is None else carried
  references = references_for(drafters) if references is None else references
  if prompt and isinstance(prompt[0], int):
    turns: list = [list(prompt)]
  else:
    turns = list(prompt[: settings.max_turns])
  tags = dict(tags or {})
  sampling = settings.sampling
  g, s, c = model.graphdef, model.state, model.config
  by_cache = {ref.kv_cache: ref.name for ref in references}
  prefills: dict = {}  # (turn, QuantKV | None) -> Prefilled: one prefill per cache type
  room = settings.max_new_tokens + max([settings.gamma, *(gammas or {}).values()]) + 1
  tokens_of: dict[str, list[list[int]]] = {}
  # The first turn's ids are every method's (later turns carry each method's own answers).
  first = first_ids(model, prompt)

  def prefill(t: int, ids: list[int], kv) -> Any:
    if len(turns) > 1:  # later turns' histories differ per method
      return None
    if (t, kv) not in prefills:
      prefills[(t, kv)] = prefill_prompt(g, s, c, ids, max_new_tokens=room, kv_cache=kv,
                                         sampling=sampling, seed=settings.seed + t)
    return prefills[(t, kv)]

  recs = []
  methods = [(ref.name, None, ref.kv_cache) for ref in references]
  methods += [(name, d, d.kv_cache) for name, d in drafters.items()]
  for name, drafter, kv in methods:
    rec: dict[str, Any] = dict(tags, method=name, decode_tokens=0, decode_s=0.0, prefill_s=0.0,
                               compile_s=0.0, prompt_tokens=0, tokens=[],
                               turn_prefill_s=[], turn_decode_s=[], round_committed=[],
                               **{k: 0 for k in COUNTERS})
    answers: list[str] = []
    ids_of: list[list[int]] = []  # each turn's prompt ids
    for t, turn in enumerate(turns):
      ids = first if t == 0 else prompt_ids(model.tokenizer, turns[: t + 1], answers)
      kw = dict(max_new_tokens=settings.max_new_tokens, sampling=sampling,
                seed=settings.seed + t, prefilled=prefill(t, ids, kv))
      if drafter is None:
        out = generate(g, s, c, ids, kv_cache=kv, **kw)
        rec["verify_s"] += out.decode_s  # an AR step is a one-token verification
      else:
        rec["gamma"] = (gammas or {}).get(name, settings.gamma)
        rec["threshold"] = (thresholds or {}).get(name, settings.threshold)
        out = speculative_generate(g, s, c, ids, drafter, gamma=rec["gamma"],
                                   threshold=rec["threshold"],
                                   drafter_state=carried.get(name), **kw)
        carried[name] = out.drafter_state
        for k in COUNTERS:
          rec[k] += getattr(out, k)
        rec["round_committed"].append(round_committed(out))
      rec["prompt_tokens"] += len(ids)
      ids_of.append(ids)
      # Its own compiles: a shared prefill's are in every method's `compile_s`, but were
      # paid once (by whichever method came first).
      shared = kw["prefilled"].compile_s if kw["prefilled"] is not None else 0.0
      rec["compile_s"] += out.compile_s - shared
      rec["decode_tokens"] += len(out.tokens) - 1
      rec["decode_s"] += out.decode_s
      rec["prefill_s"] += out.prefill_s
      rec["turn_prefill_s"].append(out.prefill_s)
      rec["turn_decode_s"].append(out.decode_s)
      rec["tokens"].append(out.tokens)
      if not isinstance(turn, list):
        answers.append(model.tokenizer.decode(out.tokens, skip_special=True))
    tokens_of[name] = rec["tokens"]
    if drafter is None:
      rec["is_reference"] = True
    else:
      ref = by_cache.get(kv)
      if ref is None:
        raise ConfigError(f"{name} reads a {kv} cache: give a Reference with that kv_cache "
                         f"to compare it with")
      # sampled runs are not compared token for token (None, not a silent 0)
      rec["matches_ar"] = rec["tokens"] == tokens_of[ref] if sampling.greedy else None
      if rec["matches_ar"] is False and precision_name(c, s) == "bfloat16":
        rec["divergence"] = _divergence(model, ids_of, tokens_of[ref], rec["tokens"])
      rec["reference"] = ref
      if extra is not None:
        rec.update(extra(name, out))
    recs.append(rec)
  return recs


def round_committed(generation) -> list[int]:
  """The tokens each verification round committed (its accepted drafts and the bonus
  token), the last rounds cut where the generation stopped (EOS or the token budget): they
  add up to `generation.committed`."""
  left, out = generation.committed, []
  for accepted in generation.round_accepted:
    n = min(accepted + 1, left)
    out.append(n)
    left -= n
  return out


def _divergence(model, ids_of: list[list[int]], ar: list[list[int]],
                ssd: list[list[int]]) -> dict:
  """The first differing turn's divergence, accounted for (`decode.divergence`): a
  numerical tie or a mismatch."""
  from specjax.decode import divergence

  for ids, a, b in zip(ids_of, ar, ssd):
    if a != b:
      d = divergence.account(model.graphdef, model.state, model.config, ids, a, b)
      if d is not None:
        return d.to_json()
  return {"tie": False}


def warm_up(model, drafters: Mapping[str, Any], settings: RunSettings,
            gammas: Mapping[str, int] | None = None,
            thresholds: Mapping[str, float] | None = None) -> None:
  """Compile every executable a timed `run_prompt` uses, on a short prompt (the shape
  buckets are those of real prompts), so no timed run compiles."""
  run_prompt(model, model.tokenizer.encode_prompt("Warm up."), drafters, settings,
             gammas=gammas, thresholds=thresholds)


def median_passes(passes: Sequence[Sequence[dict]]) -> list[int]:
  """For each method (one record per method per pass, in the same order every pass), the
  pass in which it decoded at its median speed: a burst of load on a shared machine slows
  one method in one pass, and a single pass would carry it into that method's ratio."""
  def speed(rec: dict) -> float:
    return rec["decode_tokens"] / rec["decode_s"] if rec["decode_s"] else 0.0

  picks = []
  for k in range(len(passes[0])):
    order = sorted(range(len(passes)), key=lambda i: speed(passes[i][k]))
    picks.append(order[len(order) // 2])
  return picks


def median_pass(passes: Sequence[Sequence[dict]]) -> list[dict]:
  """One record per method: each method's record of median speed (`median_passes`)."""
  return [passes[i][k] for k, i in enumerate(median_passes(passes))]
