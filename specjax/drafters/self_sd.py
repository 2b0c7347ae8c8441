"""`self_sd`: a skip set found offline by Bayesian optimisation (Draft & Verify, Zhang et
al. 2024; `specjax.offline.self_sd_search`), then used for every prompt."""

from __future__ import annotations

import dataclasses

from specjax.drafters.static import StaticDrafter


@dataclasses.dataclass(frozen=True)
class SelfSDDrafter(StaticDrafter):
  name = "self_sd"
