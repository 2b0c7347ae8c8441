"""`streaming_kv`: a sparse-KV self-speculative draft, StreamingLLM's cache pattern.

QuantSpec (Tiwari et al. 2025) states its claims against self-speculative drafts that
read a sparse KV cache (MagicDec and TriForce draft this way): the target's own layers,
attending to a few "attention sink" tokens at the start of the context (StreamingLLM,
Xiao et al. 2024: four suffice) and a window of the most recent ones. This drafter is
that baseline. Its plan carries `kv_window = (sinks, recent)`; the draft's attention then
reads two slices of the verified full-precision cache (`kv_cache.window_segments`) plus
the round's drafts, so a draft step costs sinks + recent slots of attention whatever the
context. Nothing is evicted: verification reads the whole cache, which keeps the output
the target's, and the draft needs no cache of its own.

Over a layer drafter the two compose (`self_sd+streaming_kv`); with `quantspec` it does
not: both decide how the draft reads the KV cache.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from specjax.drafters.base import Drafter
from specjax.drafters.overlay import OverlayDrafter
from specjax.plan import DraftPlan, PlanError


@dataclasses.dataclass(frozen=True)
class StreamingKVDrafter(OverlayDrafter):
  name = "streaming_kv"
  # kv_bits too: the draft reads the cache as stored, which QuantSpec's 4-bit read would
  # contradict (`names.parse` refuses two overlays that set one field).
  fields = ("kv_window", "kv_bits")
  # Alone it is the whole model on part of the context: it drafts a fixed γ, as
  # QuantSpec's draft does.
  early_stop: ClassVar[float] = 0.0
  base: Drafter | None = None
  sinks: int = 4  # StreamingLLM's attention sinks
  # The recent window: with the sinks a 512-slot budget, a quarter of the 2,048-token
  # context from which QuantSpec's claim is judged (`bench.claims`); our choice.
  recent: int = 508

  def __post_init__(self):
    if self.sinks < 0 or self.recent < 1:
      raise PlanError(f"streaming_kv needs sinks >= 0 and recent >= 1, got sinks={self.sinks}, "
                      f"recent={self.recent}")

  def overlay_plan(self, session) -> DraftPlan:
    L = session.config.num_layers
    return DraftPlan.full(L).replace(kv_window=(int(self.sinks), int(self.recent))).check(L)
