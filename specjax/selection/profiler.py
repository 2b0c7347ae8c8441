"""Latency profile of one model on one device: what a sub-layer costs in a draft step.

Measured on the real draft step (so conditionals and cache reads are included) by
difference: a step running every attention sub-layer and no MLP, minus a step running
nothing, over L, is one attention sub-layer; likewise the MLP. The empty step is the base
(embedding, final norm, LM head). Verification is timed as the real verify step over
T = γ+1 tokens and as one AR step (T = 1).

The steps are timed the way the decode loop pays them (`draft_length.step_times`): by
default `LOOP_STEPS` of each chained inside one jitted loop, as KnapSpec's rounds run in
the device loop, so no host dispatch is counted; `loop_steps=0` times each step as a call
from the host (the host loop's cost, and every profile made before `loop_steps` was
recorded). Timed as calls, a GPU's base cost is mostly the host's dispatch and wait,
hundreds of times a sub-layer's on a small model; the device loop pays no call per step,
so a profile of calls overprices every draft there.

A draft that reads quantised copies of the weights (`8bit`, `4bit`; QuantSpec's 8- or
4-bit weights) costs a fraction of the full step per sub-layer, so a selection under it
must price its sub-layers by their quantised times: `measure(..., draft_weights=...)` times
the draft steps with those weights (the profile's `draft` is then the copy's kind,
`quant.WEIGHT_KINDS`: "int8", "int4" or "q4_0"), and such a profile is stored and loaded
apart.

Each is the median of several repeats after warm-up, round-robin, at several cache sizes n,
and fit: `t_attn(n) = a·n + b`, `t_mlp = c`, base and verification linear in n. n is the
cache allocation; the steps read a context of about n tokens.

Profiles are saved as JSON per (model, device, dtype, draft) under the specjax cache and
reused; a profile made for another model or device is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from specjax.errors import ConfigError, SpecjaxError
from specjax.models.source import artefact_key
from specjax.plan import DraftPlan


class MissingProfileError(SpecjaxError, FileNotFoundError):
  def __str__(self) -> str:
    return self.args[0]


class ProfileMismatchError(SpecjaxError, ValueError):
  pass


def device_name() -> str:
  d = jax.devices()[0]
  return f"{d.platform}-{re.sub(r'[^A-Za-z0-9]+', '_', d.device_kind).strip('_').lower()}"


def _fit(xs, ys) -> tuple[float, float]:
  """Least-squares y = slope·x + intercept (a constant when there is one point)."""
  if len(xs) < 2:
    return 0.0, float(ys[0])
  slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
  return float(slope), float(intercept)


@dataclasses.dataclass(frozen=True)
class LatencyProfile:
  model: str
  device: str
  dtype: str
  num_layers: int
  verify_tokens: int  # T of the timed verification (γ + 1)
  lengths: tuple[int, ...]  # cache sizes profiled
  attn: tuple[float, ...]  # seconds per attention sub-layer, at each length
  mlp: tuple[float, ...]
  base: tuple[float, ...]  # draft step running no sub-layer
  verify: tuple[float, ...]  # verification of `verify_tokens` tokens
  step: tuple[float, ...]  # one AR step (T = 1)
  draft: str = "target"  # the weights the draft steps read: `draft_label(kind)`
  loop_steps: int = 0  # steps chained per timed jitted loop; 0: each step a host call

  @property
  def timing(self) -> str:
    """How the steps were timed, in words."""
    return (f"{self.loop_steps} steps chained in a jitted loop" if self.loop_steps
            else "each step a call from the host")

  # --- fits -----------------------------------------------------------------------------
  @functools.cached_property
  def _fits(self) -> dict[str, tuple[float, float]]:
    """Least-squares lines, fitted once (drafters query them every round)."""
    return {k: _fit(self.lengths, getattr(self, k)) for k in ("attn", "base", "step", "verify")}

  def t_attn(self, n: float) -> float:
    a, b = self._fits["attn"]
    return max(a * n + b, 1e-7)

  def t_mlp(self, n: float = 0) -> float:
    return max(float(np.median(self.mlp)), 1e-7)

  def t_base(self, n: float) -> float:
    a, b = self._fits["base"]
    return max(a * n + b, 0.0)

  def t_target(self, n: float, tokens: int) -> float:
    """Verification of `tokens` positions (linear between one AR step and γ+1 tokens)."""
    a1, b1 = self._fits["step"]
    a2, b2 = self._fits["verify"]
    t1, t2 = a1 * n + b1, a2 * n + b2
    frac = (tokens - 1) / max(self.verify_tokens - 1, 1)
    return max(t1 + frac * (t2 - t1), 1e-7)

  def sublayer_times(self, n: float) -> np.ndarray:
    """Seconds per sub-layer in model order (attn_0, mlp_0, attn_1, ...)."""
    t = np.empty(2 * self.num_layers)
    t[0::2], t[1::2] = self.t_attn(n), self.t_mlp(n)
    return t

  def draft_time(self, bits: np.ndarray, n: float) -> np.ndarray:
    """One draft step for each plan in bits[..., 2L] at cache size n."""
    return self.t_base(n) + np.asarray(bits, float) @ self.sublayer_times(n)

  def weights(self, n: float, cap: int = 5) -> np.ndarray:
    """Integer knapsack weights per sub-layer: w = round(t / Δ), Δ = min(t_attn, t_mlp),
    capped at `cap` (KnapSpec)."""
    t = self.sublayer_times(n)
    return np.clip(np.rint(t / t.min()), 1, cap).astype(np.int32)

  # --- storage --------------------------------------------------------------------------
  def check(self, model: str, num_layers: int, device: str | None = None,
            draft: str = "target") -> LatencyProfile:
    device = device or device_name()
    if self.draft != draft:
      raise ProfileMismatchError(
          f"the latency profile times a draft reading {self.draft} weights, not {draft}: run "
          f"`specjax profile --model {model}{_draft_flag(draft)}`")
    if self.model != model or self.num_layers != num_layers:
      raise ProfileMismatchError(
          f"the latency profile is for {self.model} ({self.num_layers} layers), not {model} "
          f"({num_layers} layers): run `specjax profile --model {model}`")
    if self.device != device:
      raise ProfileMismatchError(
          f"the latency profile was measured on {self.device}, this is {device}: run "
          f"`specjax profile --model {model}` here")
    return self

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, obj: dict) -> LatencyProfile:
    fields = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    if not required <= set(obj):
      raise ProfileMismatchError(f"not a latency profile: missing {sorted(required - set(obj))}")
    obj = {**obj, "draft": _LEGACY_DRAFTS.get(obj.get("draft"), obj.get("draft", "target"))}
    return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in obj.items()
                  if k in fields})


# Labels of draft weights before they were named by kind: 8 and 4 bits, when the only
# 4-bit copy was QuantSpec's. Profiles saved under them still load.
_LEGACY_DRAFTS = {"8bit": "int8", "4bit": "int4"}


def draft_label(kind: str | None) -> str:
  """A profile's `draft` for draft steps reading the copy of this kind
  (`quant.WEIGHT_KINDS`; None: the target's own weights)."""
  from specjax.quant import WEIGHT_KINDS

  if kind is not None and kind not in WEIGHT_KINDS:
    raise ConfigError(f"unknown draft weights {kind!r}; known: {', '.join(WEIGHT_KINDS)}")
  return "target" if kind is None else kind


def _draft_flag(draft: str) -> str:
  """The `specjax profile` flag that measures a profile of this `draft`."""
  return "" if draft == "target" else f" --draft-weights {draft}"


def profile_path(model: str, device: str | None = None, dtype: str = "float32",
                 draft: str = "target") -> Path:
  from specjax.storage import cache_root

  suffix = "" if draft == "target" else f"__draft-{draft}"
  return cache_root() / "profiles" / f"{model}__{device or device_name()}__{dtype}{suffix}.json"


def _saved_path(model: str, dtype: str, draft: str) -> Path:
  """Where this profile is saved: its path, or the one an older specjax saved it at."""
  path = profile_path(model, dtype=dtype, draft=draft)
  legacy = {v: k for k, v in _LEGACY_DRAFTS.items()}.get(draft)
  if legacy and not path.exists() and profile_path(model, dtype=dtype, draft=legacy).exists():
    return profile_path(model, dtype=dtype, draft=legacy)
  return path


def save_profile(profile: LatencyProfile, path: Path | None = None) -> Path:
  path = Path(path or profile_path(profile.model, profile.device, profile.dtype,
                                   profile.draft))
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(profile.to_json(), indent=1))
  tmp.replace(path)
  return path


def load_profile(model: str, num_layers: int, path: Path | None = None,
                 dtype: str = "float32", draft: str = "target") -> LatencyProfile:
  """The saved profile for this model on this device (and draft weights); a clear error if
  there is none or it was made for another model, device or draft."""
  path = Path(path or _saved_path(model, dtype, draft))
  command = f"`specjax profile --model {model}{_draft_flag(draft)}`"
  if not path.exists():
    raise MissingProfileError(
        f"no latency profile for {model} on {device_name()} ({path}): run {command} first "
        f"(about a minute on a CPU)")
  try:
    obj = json.loads(path.read_text())
  except ValueError as err:
    raise ProfileMismatchError(f"{path} is not a valid profile ({err}): run {command} "
                               f"again") from err
  try:
    profile = LatencyProfile.from_json(obj)
  except ProfileMismatchError as err:  # an older specjax's format, or another file
    raise ProfileMismatchError(f"{path}: {err}: run {command} again") from err
  return profile.check(model, num_layers, draft=draft)


def median_time(fn, repeats: int, warmup: int = 2) -> float:
  """Median wall seconds of `fn()` (its result waited for) after `warmup` calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def check_lengths(lengths, gamma: int, loop_steps: int | None = None) -> int:
  """The loop steps `measure` will chain (`loop_steps`, default `LOOP_STEPS`), after
  checking that every cache size leaves a context for them and a verification."""
  from specjax.decode.draft_length import LOOP_STEPS

  loop = LOOP_STEPS if loop_steps is None else loop_steps
  if loop < 0 or not lengths or min(lengths) - gamma - 2 - loop < 4:
    raise ConfigError(f"cache sizes {tuple(lengths)} leave no context for {loop} chained "
                      f"steps and a verification of {gamma + 1} tokens: use larger lengths or "
                      "fewer loop steps")
  return loop


def measure(model, lengths=(256, 1024, 2048, 4096), gamma: int = 4, repeats: int = 7,
            verbose: bool = True, draft_weights=None, loop_steps: int | None = None
            ) -> LatencyProfile:
  """Profile a loaded model (`loader.LoadedModel`) at the given cache sizes;
  `draft_weights` (`quant.DraftWeights` of any kind): the draft steps read them;
  `loop_steps`: steps chained per timed loop (default `LOOP_STEPS`; 0: host calls)."""
  from tqdm.auto import tqdm

  from specjax.decode.draft_length import step_times
  from specjax.decode.generate import precision_name

  cfg, graphdef, state = model.config, model.graphdef, model.state
  L = cfg.num_layers
  lengths = tuple(sorted({min(int(n), cfg.max_context) for n in lengths}))
  loop = check_lengths(lengths, gamma, loop_steps)
  ones, zeros = np.ones(L, bool), np.zeros(L, bool)
  plans = {name: [DraftPlan.from_masks(a, m).replace(weights=draft_weights)] for name, (a, m)
           in dict(none=(zeros, zeros), attn=(ones, zeros), mlp=(zeros, ones)).items()}
  rows = {k: [] for k in ("attn", "mlp", "base", "verify", "step")}
  for n in tqdm(lengths, desc=f"profile {model.name}", unit="length", disable=not verbose):
    # step_times allocates context + γ + 2 + loop slots: n, the size this point stands for.
    # KnapSpec stops its drafts early: each step is timed in a loop of unknown length, as
    # it drafts (on a GPU the loop's predicate is a host round trip a step, in the base).
    t = step_times(graphdef, state, cfg, plans, gammas=(gamma,), context=n - gamma - 2 - loop,
                   repeats=repeats, loop=loop, early_stop=tuple(plans))
    none = t.drafts["none"]
    rows["base"].append(none)
    rows["attn"].append(max(t.drafts["attn"] - none, 0.0) / L)
    rows["mlp"].append(max(t.drafts["mlp"] - none, 0.0) / L)
    rows["verify"].append(t.verify[gamma])
    rows["step"].append(t.ar)
  return LatencyProfile(model=artefact_key(model), device=device_name(), dtype=precision_name(cfg, state),
                        num_layers=L, verify_tokens=gamma + 1, lengths=lengths,
                        draft=draft_label(None if draft_weights is None
                                          else draft_weights.kind),
                        loop_steps=loop, **{k: tuple(v) for k, v in rows.items()})


def table(profile: LatencyProfile) -> str:
  """Markdown table of the measured points (milliseconds)."""
  lines = ["| cache n | attn sub-layer | MLP sub-layer | base (head) | AR step | "
           f"verify T={profile.verify_tokens} |", "|" + " ---: |" * 6]
  for i, n in enumerate(profile.lengths):
    lines.append(f"| {n} | {profile.attn[i] * 1e3:.3f} | {profile.mlp[i] * 1e3:.3f} | "
                 f"{profile.base[i] * 1e3:.2f} | {profile.step[i] * 1e3:.2f} | "
                 f"{profile.verify[i] * 1e3:.2f} |")
  return "\n".join(lines)
