"""Token clusters for DynaSpec: balanced spherical k-means over the LM-head rows.

Rows are L2-normalised (a token's logit is h·w, so tokens whose rows point the same way
are scored alike). k-means++ seeding, then Lloyd iterations on the unit sphere: assign
each row to the centroid of highest cosine, re-centre, re-normalise; empty clusters
restart at the worst-fitting rows. The final assignment is balanced — no cluster above
`capacity` rows, filled in order of cosine from each row's nearest centroids — because
the draft's shortlist is a padded [k · capacity] gather: one oversized cluster would pad
every shortlist.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class VocabClusters:
  centroids: np.ndarray  # float32[M, D], unit rows
  assignment: np.ndarray  # int32[V] cluster of each token
  table: np.ndarray  # int32[M, capacity] token ids per cluster, -1 padded
  objective: tuple[float, ...]  # mean cosine to the own centroid, per iteration

  @property
  def num_clusters(self) -> int:
    return self.centroids.shape[0]

  @property
  def capacity(self) -> int:
    return self.table.shape[1]

  def sizes(self, core=None) -> np.ndarray:
    """Tokens per cluster (those outside `core`, when given)."""
    return np.sum(self.without(core) >= 0, axis=1)

  def without(self, core=None) -> np.ndarray:
    """The table with the `core` ids (-1 padding allowed) blanked to -1."""
    if core is None:
      return self.table
    core = np.asarray(core)
    return np.where(np.isin(self.table, core[core >= 0]), -1, self.table).astype(np.int32)


def _normalise(x):
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@jax.jit
def _assign(x, centroids):
  sims = x @ centroids.T  # [chunk, M]
  return jnp.argmax(sims, -1).astype(jnp.int32), jnp.max(sims, -1)


def _assign_all(x, centroids, chunk: int = 16384):
  """Nearest centroid and its cosine for every row, in chunks (V x M would not fit)."""
  idx, sim = [], []
  for i in range(0, x.shape[0], chunk):
    a, s = _assign(x[i : i + chunk], centroids)
    idx.append(a)
    sim.append(s)
  return jnp.concatenate(idx), jnp.concatenate(sim)


def spherical_kmeans(rows, num_clusters: int, iterations: int = 20, seed: int = 0,
                     slack: float = 1.25, verbose: bool = False) -> VocabClusters:
  """Cluster the rows [V, D] into `num_clusters` balanced groups (capacity
  ceil(slack · V / M))."""
  from tqdm.auto import tqdm

  V = rows.shape[0]
  if not 1 <= num_clusters <= V:
    raise ConfigError(f"num_clusters must be in 1..{V}, got {num_clusters}")
  x = _normalise(jnp.asarray(rows, jnp.float32))
  centroids = _plus_plus(x, num_clusters, np.random.default_rng(seed))
  history = []
  for _ in tqdm(range(iterations), desc="k-means", unit="it", disable=not verbose):
    assign, sim = _assign_all(x, centroids)
    history.append(float(jnp.mean(sim)))
    sums = jax.ops.segment_sum(x, assign, num_segments=num_clusters)
    counts = np.asarray(jnp.bincount(assign, length=num_clusters))
    empty = np.flatnonzero(counts == 0)
    if empty.size:  # restart empty clusters at the rows that fit worst
      worst = np.argsort(np.asarray(sim))[: empty.size]
      sums = sums.at[empty].set(x[worst])
    centroids = _normalise(sums)
  capacity = int(np.ceil(slack * V / num_clusters))
  assignment = balanced_assignment(x, centroids, capacity)
  table = np.full((num_clusters, capacity), -1, np.int32)
  for c in range(num_clusters):
    members = np.flatnonzero(assignment == c)
    table[c, : members.size] = members
  return VocabClusters(np.asarray(centroids), assignment, table, tuple(history))


@jax.jit
def _closer(best, x, c):
  return jnp.maximum(best, x @ c)


def _plus_plus(x, num_clusters: int, rng: np.random.Generator):
  """k-means++ seeding on the sphere: each next centroid is a row drawn with probability
  proportional to its distance 1 − cos to the nearest centroid so far."""
  V = x.shape[0]
  picks = [int(rng.integers(V))]
  best = jnp.full((V,), -1.0, jnp.float32)
  for _ in range(num_clusters - 1):
    best = _closer(best, x, x[picks[-1]])
    d = np.maximum(1.0 - np.asarray(best, np.float64), 0.0)
    d[picks] = 0.0
    total = d.sum()
    picks.append(int(rng.choice(V, p=d / total)) if total > 0 else
                 int(rng.choice(np.setdiff1d(np.arange(V), picks))))
  return x[np.asarray(picks)]


def balanced_assignment(x, centroids, capacity: int, candidates: int = 8) -> np.ndarray:
  """Each row to one of its `candidates` nearest centroids, most similar pairs first,
  no centroid above `capacity`; rows left over go to the emptiest clusters."""
  V, M = x.shape[0], centroids.shape[0]
  if capacity * M < V:
    raise ConfigError(f"capacity {capacity} x {M} clusters cannot hold {V} rows")
  k = min(candidates, M)
  top_sim, top_idx = [], []
  for i in range(0, V, 16384):
    s, j = jax.lax.top_k(x[i : i + 16384] @ centroids.T, k)
    top_sim.append(np.asarray(s))
    top_idx.append(np.asarray(j))
  sim, idx = np.concatenate(top_sim), np.concatenate(top_idx)
  assignment = np.full(V, -1, np.int32)
  room = np.full(M, capacity, np.int64)
  for r in range(k):  # round r: unassigned rows try their r-th nearest centroid
    rows = np.flatnonzero(assignment < 0)
    if rows.size == 0:
      break
    want, s = idx[rows, r], sim[rows, r]
    order = np.lexsort((-s, want))  # by centroid, most similar first
    rows, want = rows[order], want[order]
    first = np.searchsorted(want, want, side="left")
    rank = np.arange(want.size) - first  # position within its centroid's queue
    ok = rank < room[want]
    assignment[rows[ok]] = want[ok]
    np.subtract.at(room, want[ok], 1)
  for row in np.flatnonzero(assignment < 0):  # rare: all candidates full
    c = int(np.argmax(room))
    assignment[row] = c
    room[c] -= 1
  return assignment
