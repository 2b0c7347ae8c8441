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
  # The plan per model shape, built once: one shortlist array from prompt to prompt, so
  # the engine's gathered head rows (`Session.with_head_rows`) stay valid across them.
  _plans: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

  def __post_init__(self):
    if self.shortlist is None:
      raise ConfigError("frspec needs a shortlist (see offline.token_counts.frequent_shortlist)")

  def overlay_plan(self, session) -> DraftPlan:
    cfg = session.config
    key = (cfg.num_layers, cfg.vocab_size, tuple(cfg.eos_ids))
    if key not in self._plans:
      self._plans[key] = DraftPlan.full(cfg.num_layers).with_shortlist(
          self.shortlist, cfg.vocab_size, cfg.eos_ids)
    return self._plans[key]
