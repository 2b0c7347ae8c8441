"""Drafter names: one layer drafter, then overlays, joined by `+`.

`knapspec+8bit+dynaspec` is DynaSpec's head over 8-bit weights over KnapSpec's layer
plans; an overlay alone drafts with the full model (`8bit`, `quantspec`,
`frspec+quantspec`). Overlays apply left to right, each on top of the drafter before it;
two overlays that set the same plan fields (`frspec+dynaspec`: both the head;
`quantspec+8bit`: both the weights) are refused. Every command that takes a drafter
(`specjax generate --drafter`, `specjax bench --drafters`, sweeps) reads names through
`parse`; `factory.DrafterFactory` builds them with the artefacts they read.

Options per part (`{"knapspec": {"tau": 0.3}}`, `--option knapspec.tau=0.3`) are the
part's constructor fields, plus the artefact settings in `offline.artefacts.ARTEFACT_OPTIONS`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
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
  drafter_class,
)
from specjax.errors import ConfigError, SpecjaxError
from specjax.offline.artefacts import ARTEFACT_OPTIONS

BASES = ("static", "early_exit", "self_sd", "swift", "clasp", "knapspec", "knn")
OVERLAYS = ("8bit", "4bit", "quantspec", "streaming_kv", "snapkv", "frspec", "dynaspec")
CLASSES: dict[str, type[Drafter]] = {
    "static": StaticDrafter, "early_exit": EarlyExitDrafter, "self_sd": SelfSDDrafter,
    "swift": SwiftDrafter, "clasp": ClaspDrafter, "knapspec": KnapSpecDrafter,
    "knn": KNNDrafter, "8bit": Int8WeightsDrafter, "4bit": Q4WeightsDrafter,
    "quantspec": QuantSpecDrafter, "streaming_kv": StreamingKVDrafter, "snapkv": SnapKVDrafter,
    "frspec": FRSpecDrafter, "dynaspec": DynaSpecDrafter}
# Constructor fields the factory fills itself (artefacts), not options.
FILLED = {"fixed", "profile", "library", "weights", "base", "kv_cache", "shortlist", "bundle",
          "core"}


class DrafterNameError(SpecjaxError, ValueError):
  """A drafter name that cannot be built (the message lists what can)."""


def parse(name: str) -> tuple[str | None, list[str]]:
  """(layer drafter or None, overlays in order) of a composed name, validated."""
  parts = [p for p in name.split("+")]
  if not name or any(not p for p in parts):
    raise DrafterNameError(f"drafter name {name!r}: empty part; names are a layer drafter "
                           f"({', '.join(BASES)}) and/or overlays ({', '.join(OVERLAYS)}) "
                           f"joined by '+'")
  for p in parts:
    if p not in CLASSES:
      drafter_class(p)  # an unknown name: UnknownDrafterError lists them all
      raise DrafterNameError(f"{p!r} is not built by name")
  base = parts[0] if parts[0] in BASES else None
  overlays = parts[1:] if base else parts
  misplaced = [p for p in overlays if p in BASES]
  if misplaced:
    raise DrafterNameError(f"{name!r}: {misplaced[0]!r} is a layer drafter; a name holds at "
                           f"most one, first (e.g. knapspec+8bit+dynaspec)")
  owner: dict[str, str] = {}
  for p in overlays:
    for field in CLASSES[p].fields:
      if field in owner:
        raise DrafterNameError(f"{name!r}: {owner[field]} and {p} both set the draft's "
                               f"{field}; keep one")
      owner[field] = p
  return base, overlays


def all_names() -> list[str]:
  """Every single part a name can hold (compositions join them with '+')."""
  return list(BASES) + list(OVERLAYS)


def parse_options(pairs: list[str] | None) -> dict[str, dict]:
  """`knapspec.tau=0.3` pairs (each a `--option`) -> {"knapspec": {"tau": 0.3}}; values are
  read as JSON when they parse (numbers, true/false, null), as text otherwise."""
  out: dict[str, dict] = {}
  for pair in pairs or []:
    key, sep, value = pair.partition("=")
    part, dot, name = key.partition(".")
    if not sep or not dot or not part or not name:
      raise ConfigError(f"--option {pair!r}: expected DRAFTER.OPTION=VALUE (knapspec.tau=0.3)")
    try:
      parsed = json.loads(value)
    except ValueError:
      parsed = value
    out.setdefault(part, {})[name] = parsed
  return out


def check_options(options: Mapping[str, Mapping[str, Any]]) -> None:
  """Refuse an option no drafter part has, listing the part's options."""
  for part, opts in options.items():
    if part not in CLASSES:
      raise DrafterNameError(f"options for {part!r}: not a drafter ({', '.join(CLASSES)})")
    allowed = set(ARTEFACT_OPTIONS.get(part, {})) | option_fields(CLASSES[part])
    bad = sorted(set(opts) - allowed)
    if bad:
      raise DrafterNameError(f"{part} has no option {bad[0]!r}; its options: "
                             f"{', '.join(sorted(allowed))}")


def option_fields(cls) -> set[str]:
  """A part's options that are constructor fields: all but the artefacts the factory
  fills in itself (`FILLED`)."""
  return {f.name for f in dataclasses.fields(cls) if f.init} - FILLED
