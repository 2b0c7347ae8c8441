"""`knn`: KNN-SSD (Song et al. 2025). At prefill the prompt embedding (mean-pooled last
hidden state, computed inside the prefill executable) is matched by cosine against the
skip library's anchors; the nearest anchor's domain gives the skip set for the whole
generation. The lookup is one [A, D] x [D] product on the host: its time is the
drafter's selection time.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import numpy as np

from specjax.drafters.base import Drafter
from specjax.errors import ConfigError
from specjax.offline.knn_library import SkipLibrary
from specjax.plan import DraftPlan


@flax.struct.dataclass
class KNNState:
  plan: DraftPlan
  domain: str = flax.struct.field(pytree_node=False)
  similarity: float = flax.struct.field(pytree_node=False)  # cosine to the nearest anchor


@dataclasses.dataclass(frozen=True)
class KNNDrafter(Drafter):
  name = "knn"
  adaptive = False
  library: SkipLibrary  # `knn_library.load_library`, or `specjax knn build`

  def __post_init__(self):
    if self.library is None:
      raise ConfigError("the knn drafter needs a skip library: knn_library.load_library(...) "
                       "or `specjax knn build`")

  def init(self, session, prior=None) -> KNNState:
    if session.prompt_embedding is None:
      raise ConfigError("the knn drafter needs the session's prompt embedding (set by "
                       "speculative_generate's prefill)")
    self.library.check(session.config.num_layers, session.config.embed_dim)
    match = self.library.nearest(np.asarray(session.prompt_embedding))
    return KNNState(self.library.plan(match.domain), match.name, match.similarity)

  def plan(self, state: KNNState) -> DraftPlan:
    return state.plan
