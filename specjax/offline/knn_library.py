"""KNN-SSD's skip library: per domain, anchors (representative prompt embeddings) and the
skip set a Self-SD search found on that domain's representative prompts (Song et al.
2025, "KNN-SSD").

A prompt's embedding is the mean-pooled, final-normed last hidden state
(`generate.pooled_prompt`), computed by the same prefill executable the engine runs, so
the key looked up at generation time is the one the anchors were made with. Anchors are
chosen per domain by k-means (scikit-learn) on unit-normalised embeddings: the prompt
nearest each centroid represents its cluster, and the largest clusters' representatives
are the search prompts. Lookup is 1-NN by cosine over all anchors of all domains.

The library is saved with orbax (arrays) beside a JSON meta (model, domains, search
record), and checked when loaded: another model's library, an empty domain, or
non-finite anchors are refused with a message that names the command to run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

from specjax.errors import SpecjaxError
from specjax.models import checkpoint
from specjax.offline import self_sd_search
from specjax.plan import DraftPlan


class LibraryError(SpecjaxError, ValueError):
  """A skip library that cannot be used: another model's, empty, or corrupt."""


class StaleLibraryError(LibraryError):
  """A library whose skip sets an older Self-SD objective searched (rebuild it)."""


# --- embeddings and anchors ----------------------------------------------------------------


def embed(graphdef, state, config, ids: Sequence[int]) -> np.ndarray:
  """The prompt embedding float32[D] that `speculative_generate` hands its drafter."""
  from specjax.decode.generate import Prefill, check_prompt
  from specjax.kv_cache import KVCache
  from specjax.sampling import SamplingParams

  size = check_prompt(ids, 1, config.max_context)
  cache = KVCache.create(config, 1, size)
  full, key = DraftPlan.full(config.num_layers), jax.random.key(0)
  prefill = Prefill.build(state, cache, ids, full, key, graphdef=graphdef,
                          sampling=SamplingParams(), return_pooled=True)
  return np.asarray(prefill(state, cache, full, key)[2], np.float32)


def unit(x: np.ndarray) -> np.ndarray:
  """Rows scaled to unit L2 norm (cosine similarity becomes a dot product)."""
  x = np.asarray(x, np.float32)
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def check_finite(x: np.ndarray, what: str) -> None:
  bad = ~np.isfinite(x)
  if bad.any():
    rows = sorted(set(np.nonzero(bad)[0].tolist())) if x.ndim > 1 else []
    raise LibraryError(f"{what} contain NaN/inf" + (f" (rows {rows[:10]})" if rows else "") +
                       ": a model or embedding that produced them cannot key a library")


@dataclasses.dataclass(frozen=True)
class Anchors:
  rows: np.ndarray  # int32[k]: indices of the representative prompts, largest cluster first
  sizes: np.ndarray  # int32[k]: how many prompts each represents


def choose_anchors(x: np.ndarray, k: int = 10, seed: int = 0) -> Anchors:
  """k-means on the unit-normalised rows of x[N, D]; per cluster, the row nearest its
  centroid. k is capped at the number of distinct rows."""
  from sklearn.cluster import KMeans

  x = np.asarray(x, np.float32)
  if x.ndim != 2 or x.shape[0] == 0:
    raise LibraryError(f"anchors need a non-empty [N, D] set of embeddings, got {x.shape}")
  check_finite(x, "embeddings")
  u = unit(x)
  k = min(k, len(np.unique(u.round(6), axis=0)))
  km = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(u)
  dist = ((u[:, None, :] - km.cluster_centers_[None]) ** 2).sum(-1)  # [N, k]
  sizes = np.bincount(km.labels_, minlength=k)
  rows = []
  for c in range(k):
    members = np.nonzero(km.labels_ == c)[0]
    rows.append(int(members[np.argmin(dist[members, c])]))
  order = np.argsort(-sizes, kind="stable")
  return Anchors(np.asarray(rows, np.int32)[order], sizes[order].astype(np.int32))


# --- the library ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Match:
  domain: int
  name: str
  similarity: float  # cosine to the nearest anchor (1 = identical direction)
  anchor: int


@dataclasses.dataclass(frozen=True)
class SkipLibrary:
  model: str
  domains: tuple[str, ...]
  anchors: np.ndarray  # float32[A, D], unit rows
  anchor_domain: np.ndarray  # int32[A]
  attn: np.ndarray  # bool[domains, L]: attention sub-layers the domain's draft runs
  mlp: np.ndarray  # bool[domains, L]
  meta: Mapping = dataclasses.field(default_factory=dict)  # search record, prompt ids

  def check(self, num_layers: int | None = None, embed_dim: int | None = None) -> SkipLibrary:
    n, A = len(self.domains), self.anchors.shape[0]
    if n == 0:
      raise LibraryError("the skip library has no domains")
    if self.anchors.ndim != 2 or self.anchor_domain.shape != (A,):
      raise LibraryError(f"anchors {self.anchors.shape} and their domains "
                         f"{self.anchor_domain.shape} do not match")
    check_finite(self.anchors, "library anchors")
    counts = np.bincount(self.anchor_domain, minlength=n)
    if counts.size > n or np.any(self.anchor_domain < 0):
      raise LibraryError(f"anchor domains must lie in [0, {n}), got {np.unique(self.anchor_domain)}")
    empty = [d for d, c in zip(self.domains, counts) if c == 0]
    if empty:
      raise LibraryError(f"domains {empty} have no anchors: every domain needs prompts")
    if self.attn.shape != self.mlp.shape or self.attn.shape[0] != n:
      raise LibraryError(f"skip masks {self.attn.shape}/{self.mlp.shape} do not cover "
                         f"{n} domains")
    if num_layers is not None and self.attn.shape[1] != num_layers:
      raise LibraryError(f"the library's plans have {self.attn.shape[1]} layers, the model "
                         f"{num_layers}: it was built for another model")
    if embed_dim is not None and self.anchors.shape[1] != embed_dim:
      raise LibraryError(f"the library's anchors are {self.anchors.shape[1]}-dimensional, the "
                         f"model's hidden states {embed_dim}: it was built for another model")
    return self

  def plan(self, domain: int) -> DraftPlan:
    return DraftPlan.from_masks(self.attn[domain], self.mlp[domain])

  def nearest(self, x: np.ndarray) -> Match:
    """1-NN by cosine among all anchors; an input unlike every domain still gets the
    nearest one (its similarity says how far it was)."""
    x = np.asarray(x, np.float32).reshape(-1)
    check_finite(x, "the prompt embedding")
    sims = self.anchors @ unit(x)
    a = int(np.argmax(sims))
    d = int(self.anchor_domain[a])
    return Match(d, self.domains[d], float(sims[a]), a)


def from_parts(model: str, parts: Mapping[str, dict]) -> SkipLibrary:
  """A library from per-domain parts: {"anchors": [k, D], "attn": [L], "mlp": [L], ...}."""
  names = tuple(parts)
  for name in names:
    if len(parts[name]["anchors"]) == 0:
      raise LibraryError(f"domain {name!r} has no anchors: every domain needs prompts")
  anchors = np.concatenate([unit(parts[n]["anchors"]) for n in names])
  owner = np.concatenate([np.full(len(parts[n]["anchors"]), i, np.int32)
                          for i, n in enumerate(names)])
  attn = np.stack([np.asarray(parts[n]["attn"], bool) for n in names])
  mlp = np.stack([np.asarray(parts[n]["mlp"], bool) for n in names])
  meta = {n: {k: v for k, v in parts[n].items() if k not in ("anchors", "attn", "mlp")}
          for n in names}
  return SkipLibrary(model, names, anchors, owner, attn, mlp, meta).check()


def save_library(directory: str | Path, lib: SkipLibrary) -> None:
  lib.check()
  tree = {"anchors": lib.anchors, "anchor_domain": lib.anchor_domain,
          "attn": lib.attn.astype(np.int8), "mlp": lib.mlp.astype(np.int8)}
  checkpoint.save_tree(Path(directory), tree, dict(
      model=lib.model, domains=list(lib.domains), num_anchors=int(lib.anchors.shape[0]),
      embed_dim=int(lib.anchors.shape[1]), num_layers=int(lib.attn.shape[1]),
      search_version=self_sd_search.OBJECTIVE_VERSION,
      domain_meta=json.loads(json.dumps(lib.meta, default=_jsonable))))


def load_library(directory: str | Path, *, model: str, num_layers: int | None = None,
                 embed_dim: int | None = None,
                 domains: Sequence[str] | None = None) -> SkipLibrary:
  """The library saved at `directory`, checked against the model it serves; `domains`:
  the ones it must cover, in order (a library of other domains is stale)."""
  directory = Path(directory)
  build = f"`specjax knn build --model {model}`"
  if not (directory / "meta.json").exists():
    raise LibraryError(f"no skip library at {directory}: build one with {build}")
  meta = checkpoint.load_meta(directory)
  if meta.get("model") != model:
    raise LibraryError(f"the skip library at {directory} was built for {meta.get('model')}, "
                       f"not {model}: build one with {build}")
  if meta.get("search_version", 1) < self_sd_search.OBJECTIVE_VERSION:
    raise StaleLibraryError(f"the skip library at {directory} holds skip sets of an older "
                            f"Self-SD search objective: rebuild it with {build}")
  if domains is not None and list(meta.get("domains", ())) != list(domains):
    raise StaleLibraryError(f"the skip library at {directory} covers the domains "
                            f"{meta.get('domains')}, not {list(domains)}: rebuild it with "
                            f"{build} --domains {','.join(domains)}")
  try:
    A, D, L, n = meta["num_anchors"], meta["embed_dim"], meta["num_layers"], len(meta["domains"])
  except KeyError as err:
    raise LibraryError(f"the skip library at {directory} is corrupt ({err} missing): "
                       f"rebuild it with {build}") from err
  like = {"anchors": np.zeros((A, D), np.float32), "anchor_domain": np.zeros(A, np.int32),
          "attn": np.zeros((n, L), np.int8), "mlp": np.zeros((n, L), np.int8)}
  try:
    tree = checkpoint.restore_tree(directory, like)
  except checkpoint.CheckpointError as err:
    raise LibraryError(f"{err}; rebuild it with {build}") from err
  lib = SkipLibrary(model, tuple(meta["domains"]), np.asarray(tree["anchors"]),
                    np.asarray(tree["anchor_domain"]), np.asarray(tree["attn"]).astype(bool),
                    np.asarray(tree["mlp"]).astype(bool), meta.get("domain_meta", {}))
  return lib.check(num_layers, embed_dim)


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def default_dir(model: str) -> Path:
  from specjax.storage import cache_root

  return cache_root() / "knn" / model
