"""The artefacts drafters read, each found where specjax keeps them or built (and kept) on
first use, and shared by every drafter name that reads it: the Self-SD skip set (searched
on prompts outside the evaluation), KnapSpec's latency profile, the KNN-SSD library,
FR-Spec's token counts and DynaSpec's router, and one int8, one 4-bit MLP (QuantSpec's)
and one Q4_0 copy of the model (`4bit`'s). A searched layer plan (Self-SD, KnapSpec) is
searched for the weights its draft reads: under a quantised copy it is scored with that
copy and priced by that copy's bytes or measured times (a profile and a skip set per copy
kind, `quant.WEIGHT_KINDS`). `drafters.factory` builds drafters from them; commands that
need an artefact alone (`specjax profile`, the experiments) ask the store.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specjax.errors import ConfigError
from specjax.models.source import artefact_key

# Options that shape an artefact rather than a constructor field, with their defaults.
ARTEFACT_OPTIONS: dict[str, dict[str, Any]] = {
    "static": {"plan": None},  # a plan file saved by a search
    # Bayesian-optimisation steps (default: the factory's); what scores a candidate
    # (`self_sd_search.OBJECTIVES`: the paper's measured speedup, or our predicted one)
    "self_sd": {"iterations": None, "objective": "measured"},
    # k-means anchors per domain; representative prompts each domain's search scores on
    # (the paper's 8); the objective of those searches; the domains, comma-separated
    # (None: `knn_build.DEFAULT_DOMAINS`, the paper's five as near as the data here allows)
    "knn": {"anchors": 10, "search_prompts": 8, "objective": "measured", "domains": None},
    "quantspec": {"weight_bits": None, "group": 128, "residual": 128},  # bits None: the default (4)
    "frspec": {"size": 32768},  # FR-Spec's shortlist: the paper's 32k
    # k, a decoding setting, is the drafter's own field; core: that many frequent tokens
    # scored beside the routed clusters (0: none); inputs: what the router reads
    # (`router.INPUTS`: the paper's [E(x_t), h̃_{t−1}], or our h_t)
    "dynaspec": {"clusters": 1024, "core": 0, "inputs": "embed_prev"},
}
ARTEFACTS = ("profile", "int8_profile", "int4_profile", "q4_0_profile", "library", "counts",
             "bundle", "self_sd_plan", "int8_weights", "int4_weights", "q4_weights")


@dataclasses.dataclass
class ArtefactStore:
  """The artefacts of one model. `gamma`, `seed` and `search_iterations` are the searches'
  settings; `options` the artefact settings per drafter part (`ARTEFACT_OPTIONS`; other
  keys are ignored here); `work_dir` keeps run-specific artefacts (the Self-SD skip set);
  `search_prompts` are the prompts offline searches score on (default: the last Spec-Bench
  prompt of each category, which `specjax bench` never evaluates with its default
  settings); `given`: artefacts already at hand, used instead of finding or building them
  (`ARTEFACTS`)."""

  model: Any
  gamma: int = 4
  seed: int = 0
  search_iterations: int = 60
  options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  work_dir: Path | None = None
  data_dir: str | Path | None = None
  search_prompts: Sequence[Any] | None = None  # data.Prompt
  given: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  verbose: bool = True
  # what the Self-SD searches' measured objective decodes a candidate plan with
  # (`drafters.SelfSDDrafter`, which the factory hands in: this module sits below it)
  drafter_of: Callable[[Any], Any] | None = None
  _profiles: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

  def __post_init__(self):
    unknown = set(self.given) - set(ARTEFACTS)
    if unknown:
      raise ConfigError(f"unknown artefact {sorted(unknown)[0]!r}; known: {', '.join(ARTEFACTS)}")

  def option(self, part: str) -> dict[str, Any]:
    """A part's artefact settings: its defaults (`ARTEFACT_OPTIONS`) under the given ones."""
    return {**ARTEFACT_OPTIONS.get(part, {}), **self.options.get(part, {})}

  @functools.cached_property
  def int8_weights(self):
    """The int8 copy every 8-bit name shares (`8bit`, and `quantspec` at 8 weight bits)."""
    from specjax.quant import quantize_weights_int8

    if "int8_weights" in self.given:
      return self.given["int8_weights"]
    return quantize_weights_int8(self.model.state, self.model.config.num_layers)

  @functools.cached_property
  def int4_weights(self):
    """QuantSpec's 4-bit copy (the paper's: MLP matrices in groups of 128 rows), shared by
    its drafter, its KnapSpec profile and its Self-SD search."""
    from specjax.quant import quantize_mlp_weights

    if "int4_weights" in self.given:
      return self.given["int4_weights"]
    return quantize_mlp_weights(self.model.state, self.model.config.num_layers)

  @functools.cached_property
  def q4_weights(self):
    """The Q4_0 copy every `4bit` name shares."""
    from specjax.quant import q4_0_draft_weights

    if "q4_weights" in self.given:
      return self.given["q4_weights"]
    return q4_0_draft_weights(self.model.state, self.model.config.num_layers)

  def draft_weights(self, kind: str | None):
    """The quantised copy of this kind (`quant.WEIGHT_KINDS`) a draft reads; None: the
    target's own weights."""
    if kind is None:
      return None
    copies = {"int8": "int8_weights", "int4": "int4_weights", "q4_0": "q4_weights"}
    if kind not in copies:
      raise ConfigError(f"unknown draft weights {kind!r}; known: {', '.join(copies)}")
    return getattr(self, copies[kind])

  @property
  def latency_profile(self):
    """The saved profile of this model on this device; measured now (and saved) when
    there is none. A profile of another model or device is refused, not replaced."""
    return self.latency_profile_for(None)

  @property
  def int8_latency_profile(self):
    """The profile KnapSpec selects with under `8bit`: its sub-layers at their 8-bit times."""
    return self.latency_profile_for("int8")

  def latency_profile_for(self, kind: str | None):
    """The profile of draft steps that read the copy of this kind (None: the target's
    weights), kept for this factory: KnapSpec under QuantSpec's 4-bit weights prices a
    sub-layer at what its 4-bit MLP costs, not at the target's time."""
    if kind not in self._profiles:
      self._profiles[kind] = self._profile(kind)
    return self._profiles[kind]

  def _profile(self, kind: str | None):
    from specjax.decode.generate import precision_name
    from specjax.selection import profiler

    artefact = "profile" if kind is None else f"{kind}_profile"
    if artefact in self.given:
      return self.given[artefact]
    try:  # a profile of the precision the model runs at (a bfloat16 step costs less)
      return profiler.load_profile(artefact_key(self.model), self.model.config.num_layers,
                                   dtype=precision_name(self.model.config, self.model.state),
                                   draft=profiler.draft_label(kind))
    except profiler.MissingProfileError as err:
      self._say(f"{err}\nrunning the profiler now")
      # the quantised copy is made only to measure (a saved profile needs none)
      prof = profiler.measure(self.model, gamma=self.gamma, verbose=self.verbose,
                              draft_weights=self.draft_weights(kind))
      profiler.save_profile(prof)
      return prof

  @functools.cached_property
  def token_counts(self):
    """FR-Spec's token counts: `specjax router train`'s, or counted now from training
    prompts when absent (minutes; no router is trained for them)."""
    from specjax.offline import shortlists
    from specjax.storage import cache_root

    if "counts" in self.given or "bundle" in self.given:
      return self.given.get("counts")
    out = cache_root() / "shortlists" / artefact_key(self.model)
    if not (out / "counts.npz").exists():
      self._say(f"no FR-Spec counts for {self.model.name} at {out}: counting them now "
                f"(`specjax router train` does the same, and trains DynaSpec's router)")
    return shortlists.build_counts(self.model, out, data_dir=self.data_dir,
                                   verbose=self.verbose)

  @functools.cached_property
  def shortlists(self):
    """(FR-Spec token counts, DynaSpec router bundle): `specjax router train`'s, built
    now from training prompts when absent."""
    from specjax.offline import shortlists
    from specjax.offline.router import check_inputs, is_current

    if "counts" in self.given or "bundle" in self.given:
      return self.given.get("counts"), self.given.get("bundle")
    o = self.option("dynaspec")
    inputs = check_inputs(o["inputs"])
    out = shortlists.folder(self.model, o["clusters"], inputs)
    if not (out / "counts.npz").exists() or not is_current(out / "router", inputs):
      self._say(f"no FR-Spec counts / current DynaSpec router for {self.model.name} at {out}: "
                f"building them now (`specjax router train` does the same)")
      shortlists.share_continuations(shortlists.folder(self.model), out)
    counts, bundle, _ = shortlists.build(self.model, out, clusters=o["clusters"],
                                         inputs=inputs, data_dir=self.data_dir,
                                         verbose=self.verbose)
    return counts, bundle

  def knn_library(self):
    """The model's KNN-SSD library for these anchors and search prompts; built now (and
    kept) when absent, a library with other settings in a folder of its own that shares
    the default one's prompt embeddings. Another model's library is refused, not
    replaced."""
    from specjax.offline import knn_build, knn_library

    if "library" in self.given:
      return self.given["library"]
    o = self.option("knn")
    domains = knn_build.domain_names(o["domains"])
    default = knn_library.default_dir(artefact_key(self.model))
    path = default.with_name(default.name + "".join(
        f"-{key.replace('_', '-')}{o[key]}"
        for key in ("anchors", "search_prompts", "objective")
        if o[key] != ARTEFACT_OPTIONS["knn"][key]) + (
        "" if domains == knn_build.DEFAULT_DOMAINS else "-domains-" + "+".join(domains)))
    cfg = self.model.config
    if (path / "meta.json").exists():
      try:
        return knn_library.load_library(path, model=artefact_key(self.model), num_layers=cfg.num_layers,
                                        embed_dim=cfg.embed_dim, domains=domains)
      except knn_library.StaleLibraryError as err:
        self._say(f"{err}: rebuilding it")
    self._say(f"no KNN-SSD library for {self.model.name} at {path}: building it now "
              f"(`specjax knn build --model {self.model.name}` does the same)")
    build, _ = knn_build.domain_prompts(self.data_dir, domains)
    return knn_build.build(self.model, {d: ps[:40] for d, ps in build.items()}, path,
                           anchors=o["anchors"], search_prompts=o["search_prompts"],
                           objective=o["objective"], drafter_of=self.drafter_of,
                           iterations=self.search_iterations, gamma=self.gamma,
                           seed=self.seed, verbose=self.verbose,
                           embeddings=knn_build.parts_dir(default))

  def self_sd_plan(self, kind: str | None = None):
    """A Self-SD skip set searched on `search_prompts`, kept in `work_dir` under a name
    that says what it was searched with (a resumed run reuses it). `kind`: searched for a
    draft that reads that quantised copy (scored with it, costed in its bytes)."""
    from specjax.data import prompt_ids
    from specjax.offline import self_sd_search as self_sd
    from specjax.plan import load_plan, save_plan
    from specjax.storage import cache_root

    if "self_sd_plan" in self.given:
      return self.given["self_sd_plan"]
    from specjax.decode.generate import precision_name, weight_bits

    iterations = self.option("self_sd")["iterations"] or self.search_iterations
    objective = self.option("self_sd")["objective"]
    self_sd.check_objective(objective, self.drafter_of, "self_sd.objective")
    prompts = list(self.search_prompts if self.search_prompts is not None
                   else default_search_prompts(self.data_dir))
    if not prompts:
      raise ConfigError("self_sd needs search prompts (none given and no Spec-Bench data)")
    ids = [prompt_ids(self.model.tokenizer, list(p.turns[:1])) for p in prompts]
    # plans searched under an older objective are not reused (a new key)
    precision = precision_name(self.model.config, self.model.state)
    key = hashlib.sha256(json.dumps([f"v{self_sd.OBJECTIVE_VERSION}", iterations, self.gamma,
                                     self.seed, ids]
                                    + ([] if precision == "float32" else [precision])
                                    + ([] if objective == "measured" else [objective])
                                    ).encode()
                         ).hexdigest()[:10] + _plan_suffix(kind)
    folder = Path(self.work_dir) if self.work_dir else cache_root() / "searches" / artefact_key(self.model)
    path = folder / f"self_sd_plan-{key}.json"
    if path.exists():
      return load_plan(path, model=artefact_key(self.model))
    m = self.model
    res = self_sd.search(m.graphdef, m.state, m.config, ids, iterations=iterations,
                         gamma=self.gamma, seed=self.seed,
                         weights=self.draft_weights(kind),
                         target_bits=weight_bits(m.state), objective=objective,
                         drafter_of=self.drafter_of, verbose=self.verbose)
    folder.mkdir(parents=True, exist_ok=True)
    save_plan(path, res.plan, model=artefact_key(m), objective=res.objective, alpha=res.alpha,
              cost=res.cost, search_prompts=[p.id for p in prompts], iterations=iterations,
              objective_kind=res.kind)
    if res.objective < 1.0:
      self._say(f"self_sd: no skip set found beats AR on {m.name} ({res.kind} speedup of the "
                f"best {res.objective:.2f}x, agreement {res.alpha:.2f}); using it anyway")
    return res.plan

  def _say(self, text: str) -> None:
    if self.verbose:
      print(text, file=sys.stderr)


def _plan_suffix(kind: str | None) -> str:
  """The file-name suffix of a Self-SD skip set searched under this copy; the int8 and
  QuantSpec int4 ones keep the names they had when copies were named by bits (a resumed
  run finds its plan)."""
  if kind is None:
    return ""
  return "-" + {"int8": "8bit", "int4": "4bit"}.get(kind, kind)


def default_search_prompts(data_dir=None) -> list:
  """Prompts for offline searches that `specjax bench` does not evaluate (its defaults)."""
  from specjax import data

  return data.evaluation_and_search(data.load_spec_bench(data_dir), per_category=1)[1]


