"""`dynaspec`: the draft head scores a shortlist picked per draft step by a router
(DynaSpec), optionally on top of any layer-skipping drafter.

The router (`specjax.offline.router`) scores token clusters (`specjax.offline.vocab_clusters`)
inside the jitted draft step; the union of the top-k clusters is the shortlist. By default
it reads the paper's [E(x_t), h̃_{t−1}]: the embedding of the token the step feeds and the
final hidden state before it, the target's at a round's first step (the engine carries it
from verification) and the draft's after. A bundle trained with `--inputs hidden` reads the
step's own h_t instead (our variant, `--option dynaspec.inputs=hidden`). Verification keeps
the full vocabulary, so the output is exactly the target's. `k` is a decoding setting, not
a training one: one router serves every shortlist size.

`core` adds a static part: token ids scored at every step (the most frequent ones, as
FR-Spec picks them), their head rows gathered once per generation, and left out of the
clusters. It was built on the guess that the router misses frequent tokens; on
Qwen2.5-1.5B the 1k core added 0.011 recall at 16 clusters with a 160-prompt router and
nothing with a 640-prompt one, and no acceptance either time, so the misses lie
elsewhere: more router training text is what raised recall (docs/results/vocab.md,
vocab- and router-ablation-qwen2.5-coder-1.5b-instruct).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.drafters.base import Drafter
from specjax.drafters.overlay import OverlayDrafter
from specjax.errors import ConfigError
from specjax.offline.router import RouterBundle, RouterMismatchError
from specjax.plan import DraftPlan


@dataclasses.dataclass(frozen=True, eq=False)
class DynaSpecDrafter(OverlayDrafter):
  name = "dynaspec"
  # The draft head's fields (FR-Spec's too: one head at a time).
  fields = ("vocab", "head_rows", "router")
  bundle: RouterBundle  # `offline.router.load_bundle`, or `specjax router train`
  base: Drafter | None = None
  positions: int = 8  # draft positions with their own k (later ones reuse the last)
  k: int | None = None  # clusters per shortlist; None: the bundle's k_max
  # The paper's schedule: k at the first two draft positions, then k // ((t + 1) · 2)
  # (`router.k_schedule`). False: the same k at every position, its DynaSpec-F ablation.
  decay: bool = True
  core: np.ndarray | None = None  # ids always scored (`token_counts.frequent_shortlist`)

  def __post_init__(self):
    if self.bundle is None:
      raise ConfigError("dynaspec needs a trained router: `specjax router train`, then "
                       "specjax.offline.router.load_bundle")
    M, k = self.bundle.clusters.num_clusters, self.bundle.k_max if self.k is None else self.k
    if not 1 <= k <= M:
      raise ConfigError(f"k = {k} clusters, but there are only {M}")

  def overlay_plan(self, session) -> DraftPlan:
    cfg, c = session.config, self.bundle.clusters
    if c.assignment.size != cfg.vocab_size or c.centroids.shape[1] != cfg.embed_dim:
      raise RouterMismatchError(
          f"the router of {self.bundle.model} covers {c.assignment.size} tokens of width "
          f"{c.centroids.shape[1]}; this model has {cfg.vocab_size} of width {cfg.embed_dim}")
    plan = DraftPlan.full(cfg.num_layers)
    if self.core is not None:  # checked as a shortlist: distinct, in range, EOS in
      plan = plan.with_shortlist(self.core, cfg.vocab_size, cfg.eos_ids)
    return plan.replace(router=self.bundle.plan_field(self.positions, self.k, plan.vocab,
                                                      decay=self.decay))
