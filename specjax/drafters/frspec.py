"""`frspec`: the draft's LM head scores a fixed shortlist of frequent tokens (FR-Spec,
Zhao et al. 2025), optionally on top of any layer-skipping drafter.

The shortlist is the `size` most frequent tokens of a corpus — tokenised training prompts
plus the model's own greedy continuations of them (so that it reflects what the model
writes, not only what it reads) — with every EOS id forced in. Counts are computed once
and saved with the model name; the draft gathers those rows of the head (gather +
matmul) and maps its choice back to vocabulary ids. Verification keeps the full
vocabulary, so the output is unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.drafters.base import Drafter
from specjax.drafters.overlay import OverlayDrafter
from specjax.errors import ConfigError
from specjax.plan import DraftPlan


@dataclasses.dataclass(frozen=True, eq=False)
class FRSpecDrafter(OverlayDrafter):
  """A static shortlist on the base drafter's plan (the full model when `base` is None)."""

  name = "frspec"
  # The draft head's fields (DynaSpec's too: one head at a time).
  fields = ("vocab", "head_rows", "router")
  shortlist: np.ndarray  # vocabulary ids: `offline.token_counts.frequent_shortlist`
  base: Drafter | None = None

  def __post_init__(self):
    if self.shortlist is None:
      raise ConfigError("frspec needs a shortlist (see offline.token_counts.frequent_shortlist)")

  def overlay_plan(self, session) -> DraftPlan:
    cfg = session.config
    return DraftPlan.full(cfg.num_layers).with_shortlist(self.shortlist, cfg.vocab_size,
                                                         cfg.eos_ids)
