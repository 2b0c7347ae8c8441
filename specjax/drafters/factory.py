"""Every drafter and every composition, built by name (`names`), from the artefacts it
reads (`offline.artefacts.ArtefactStore`: found where specjax keeps them or built on first
use, one of each shared by every name that reads it). A searched layer plan (Self-SD,
KnapSpec) is searched for the weights its draft reads (`draft_kind`). Every option changes
the numbers, so runs fingerprint them (`BenchConfig.options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specjax.drafters import (
  ClaspDrafter,
  Drafter,
  DynaSpecDrafter,
  EarlyExitDrafter,
  FRSpecDrafter,
  Int8WeightsDrafter,
  KnapSpecDrafter,
  KNNDrafter,
  Q4WeightsDrafter,
  QuantSpecDrafter,
  SelfSDDrafter,
  SnapKVDrafter,
  StaticDrafter,
  StreamingKVDrafter,
  SwiftDrafter,
)
from specjax.drafters.names import (
  CLASSES,
  DrafterNameError,
  check_options,
  option_fields,
  parse,
)
from specjax.errors import ConfigError
from specjax.models.source import artefact_key
from specjax.offline.artefacts import ArtefactStore


@dataclasses.dataclass
class DrafterFactory:
  """Builds drafters for one model. `gamma`, `seed` and `search_iterations` are the
  defaults of the drafters and searches that take them; `options` each part's options
  (`names`); the rest, and `artefacts` (given ones, `offline.artefacts.ARTEFACTS`), go to
  the `store` its drafters' artefacts come from."""

  model: Any
  gamma: int = 4
  seed: int = 0
  search_iterations: int = 60
  options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  work_dir: Path | None = None
  data_dir: str | Path | None = None
  search_prompts: Sequence[Any] | None = None  # data.Prompt
  # Artefacts already at hand, used instead of finding or building them (`ARTEFACTS`).
  artefacts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  verbose: bool = True
  store: ArtefactStore = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    check_options(self.options)
    self.store = ArtefactStore(self.model, self.gamma, self.seed, self.search_iterations,
                               self.options, self.work_dir, self.data_dir,
                               self.search_prompts, self.artefacts, self.verbose,
                               drafter_of=SelfSDDrafter)

  # -- public ------------------------------------------------------------------------

  def make(self, name: str) -> Drafter:
    base_name, overlays = parse(name)
    drafter = None if base_name is None else self._base(base_name, overlays)
    for part in overlays:
      drafter = self._overlay(part, drafter)
    return drafter

  def _opts(self, part: str) -> dict[str, Any]:
    return self.store.option(part)

  def _kwargs(self, part: str) -> dict[str, Any]:
    """The constructor fields among this part's options."""
    fields = option_fields(CLASSES[part])
    return {k: v for k, v in self.options.get(part, {}).items() if k in fields}

  # -- construction ------------------------------------------------------------------

  def _base(self, name: str, overlays: Sequence[str] = ()) -> Drafter:
    """The layer drafter; a search-based one is searched for the draft the overlays make
    of it (under a quantised copy, from `8bit`, `4bit` or `quantspec`, Self-SD costs and
    scores its candidates with that copy and KnapSpec prices its sub-layers at its times)."""
    kw = self._kwargs(name)
    L = self.model.config.num_layers
    if name == "static":
      from specjax.plan import load_plan

      plan = self._opts("static")["plan"]
      if plan is None:
        raise ConfigError("the static drafter needs a plan file (option plan, or --plan FILE)")
      return StaticDrafter(load_plan(plan, model=artefact_key(self.model)), **kw)
    if name == "early_exit":
      return EarlyExitDrafter(**{"k": L // 2, **kw})
    if name == "swift":
      return SwiftDrafter(**{"seed": self.seed, **kw})
    kind = self._draft_kind_under(overlays)
    if name == "self_sd":
      return SelfSDDrafter(self.store.self_sd_plan(kind), **kw)
    if name == "clasp":
      return ClaspDrafter(**kw)
    if name == "knapspec":
      return KnapSpecDrafter(profile=self.store.latency_profile_for(kind),
                             **{"max_gamma": self.gamma, **kw})
    if name == "knn":
      return KNNDrafter(self.store.knn_library(), **kw)
    raise DrafterNameError(f"{name!r} is not a layer drafter")  # parse() prevents this

  def _quantspec_weight_bits(self) -> int | None:
    """QuantSpec's draft weight bits: its option, or the default (`default_weight_bits`)."""
    from specjax.drafters.quantspec import default_weight_bits

    bits = self._opts("quantspec")["weight_bits"]
    bits = default_weight_bits() if bits is None else bits
    if bits not in (4, 8, 16):
      raise ConfigError(f"QuantSpec's draft weights are 4, 8 or 16 bits, got {bits}")
    return bits

  def draft_kind(self, name: str) -> str | None:
    """The kind of quantised copy (`quant.WEIGHT_KINDS`) the draft of a composed name
    reads, None for the target's own weights: what its KnapSpec profile and Self-SD
    search are made with."""
    return self._draft_kind_under(parse(name)[1])

  def _draft_kind_under(self, overlays: Sequence[str]) -> str | None:
    """The copy the overlays make the draft read: "int8" (`8bit`, or `quantspec` at 8
    weight bits), "q4_0" (`4bit`), "int4" (`quantspec` at 4); None: the target's own
    (no weights overlay, or `quantspec` at 16 bits). `parse` lets one overlay at most set
    the weights."""
    if "8bit" in overlays:
      return "int8"
    if "4bit" in overlays:
      return "q4_0"
    if "quantspec" in overlays:
      return {4: "int4", 8: "int8", 16: None}[self._quantspec_weight_bits()]
    return None

  def _overlay(self, name: str, base: Drafter | None) -> Drafter:
    kw = self._kwargs(name)
    cfg = self.model.config
    if name == "8bit":
      return Int8WeightsDrafter(weights=self.store.int8_weights, base=base, **kw)
    if name == "4bit":
      return Q4WeightsDrafter(weights=self.store.q4_weights, base=base, **kw)
    if name == "quantspec":
      from specjax.quant_kv_cache import QuantKV

      o = self._opts("quantspec")
      kv = QuantKV(group=o["group"], residual=o["residual"])
      weights = self.store.draft_weights(self._draft_kind_under(["quantspec"]))  # the shared copy
      return QuantSpecDrafter(weights=weights, base=base, kv_cache=kv, **kw)
    if name == "streaming_kv":
      return StreamingKVDrafter(base=base, **kw)
    if name == "snapkv":
      return SnapKVDrafter(base=base, **kw)
    if name == "frspec":
      from specjax.offline.token_counts import frequent_shortlist

      counts = self.store.token_counts
      if counts is None:
        raise ConfigError("frspec needs token counts (artefact 'counts')")
      size = min(self._opts("frspec")["size"], cfg.vocab_size)
      return FRSpecDrafter(frequent_shortlist(counts, size, cfg.eos_ids), base, **kw)
    if name == "dynaspec":
      from specjax.offline.token_counts import frequent_shortlist

      counts, bundle = self.store.shortlists
      if bundle is None:
        raise ConfigError("dynaspec needs a router bundle (artefact 'bundle')")
      size = self._opts("dynaspec")["core"]
      if size and counts is None:
        raise ConfigError("dynaspec's core needs token counts (artefact 'counts')")
      core = frequent_shortlist(counts, min(size, cfg.vocab_size), cfg.eos_ids) if size else None
      return DynaSpecDrafter(bundle, base, core=core, **kw)
    raise DrafterNameError(f"{name!r} is not an overlay")  # parse() prevents this
