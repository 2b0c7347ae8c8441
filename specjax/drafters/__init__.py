"""Drafters by name: each produces the `DraftPlan` for every round (see base.py)."""

from __future__ import annotations

from specjax.drafters.base import Drafter
from specjax.drafters.clasp import ClaspDrafter
from specjax.drafters.dynaspec import DynaSpecDrafter
from specjax.drafters.early_exit import EarlyExitDrafter
from specjax.drafters.frspec import FRSpecDrafter
from specjax.drafters.int8_weights import Int8WeightsDrafter
from specjax.drafters.knapspec import KnapSpecDrafter
from specjax.drafters.knn import KNNDrafter
from specjax.drafters.q4_weights import Q4WeightsDrafter
from specjax.drafters.quantspec import QuantSpecDrafter
from specjax.drafters.self_sd import SelfSDDrafter
from specjax.drafters.snapkv import SnapKVDrafter
from specjax.drafters.static import StaticDrafter
from specjax.drafters.streaming_kv import StreamingKVDrafter
from specjax.drafters.swift import SwiftDrafter
from specjax.errors import SpecjaxError

DRAFTERS: dict[str, type[Drafter]] = {
    d.name: d for d in (StaticDrafter, EarlyExitDrafter, SelfSDDrafter, SwiftDrafter,
                        ClaspDrafter, KnapSpecDrafter, KNNDrafter, QuantSpecDrafter, FRSpecDrafter,
                        DynaSpecDrafter, Int8WeightsDrafter, Q4WeightsDrafter,
                        StreamingKVDrafter, SnapKVDrafter)
}


class UnknownDrafterError(SpecjaxError, KeyError):
  def __str__(self) -> str:
    return self.args[0]


def drafter_class(name: str) -> type[Drafter]:
  if name not in DRAFTERS:
    raise UnknownDrafterError(f"unknown drafter {name!r}; available: {', '.join(DRAFTERS)}")
  return DRAFTERS[name]


__all__ = ["DRAFTERS", "ClaspDrafter", "Drafter", "DynaSpecDrafter", "EarlyExitDrafter",
           "FRSpecDrafter", "Int8WeightsDrafter", "KNNDrafter", "KnapSpecDrafter",
           "Q4WeightsDrafter", "QuantSpecDrafter", "SelfSDDrafter", "SnapKVDrafter",
           "StaticDrafter", "StreamingKVDrafter", "SwiftDrafter",
           "UnknownDrafterError", "drafter_class"]
