"""`specjax knn build`: KNN-SSD's skip library for one model, one domain at a time.

Per domain: embed its build prompts, pick anchors by k-means, run the Self-SD search on
the representatives of the largest clusters, and write the domain's part
(`<library>.parts/<domain>.npz`) before moving on — an interrupted build resumes at the
next domain. The parts are then joined into the orbax library.

Domains are Spec-Bench categories, MT-bench (its 8 categories as one domain) and GSM8K
train. The default is the paper's five distinct domains as near as the data here allows
(`DEFAULT_DOMAINS`). The first 30 % of every category, in file order, are held out: the
benchmarks evaluate on them, and they never shape a library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from specjax import data
from specjax.errors import ConfigError
from specjax.models.source import artefact_key
from specjax.offline import self_sd_search as self_sd
from specjax.offline.knn_library import (
  LibraryError,
  SkipLibrary,
  choose_anchors,
  default_dir,
  embed,
  from_parts,
  save_library,
)

# KNN-SSD's five domains are CNN/DM, GSM8K, WMT16 De-En, TinyStories and Spider2. Spec-Bench
# holds the first three (its summarization is CNN/DM, its math_reasoning GSM8K, its
# translation WMT14 De-En); TinyStories and Spider2 are not here, so its qa and rag stand
# in as two more distinct tasks. MT-bench and GSM8K train remain as `domains` to name.
DEFAULT_DOMAINS = ("summarization", "math_reasoning", "translation", "qa", "rag")
HELD_OUT_SHARE = 0.3


def domain_names(domains: str | Sequence[str] | None) -> tuple[str, ...]:
  """The domains an option or flag names: comma-separated text or a sequence; None (or
  nothing) is the default, the paper's five."""
  if isinstance(domains, str):
    domains = [d.strip() for d in domains.split(",")]
  names = tuple(d for d in domains or () if d)
  return names or DEFAULT_DOMAINS


def domain_prompts(data_dir=None, domains: Sequence[str] = DEFAULT_DOMAINS,
                   gsm8k_rows: int = 100) -> tuple[dict, dict]:
  """(build, held_out): prompts per domain, split by category as the module says."""
  spec = data.load_spec_bench(data_dir)
  by_cat: dict[str, list[data.Prompt]] = {}
  for p in spec:
    by_cat.setdefault(p.category, []).append(p)
  if "gsm8k" in domains:
    by_cat["gsm8k"] = data.load_gsm8k(data_dir, limit=gsm8k_rows)
  build: dict[str, list] = {}
  held: dict[str, list] = {}
  for domain in domains:
    cats = data.MT_BENCH_CATEGORIES if domain == "mt_bench" else (domain,)
    if any(c not in by_cat for c in cats):
      raise ConfigError(f"unknown domain {domain!r}; known: mt_bench, gsm8k and the "
                       f"Spec-Bench categories {', '.join(data.SPEC_BENCH_CATEGORIES)}")
    for c in cats:
      k = math.ceil(HELD_OUT_SHARE * len(by_cat[c]))
      held.setdefault(domain, []).extend(by_cat[c][:k])
      build.setdefault(domain, []).extend(by_cat[c][k:])
  return build, held


def prompt_ids(tokenizer, prompt: data.Prompt) -> list[int]:
  """A prompt's first turn as the model sees it (chat template when it has one)."""
  return data.prompt_ids(tokenizer, prompt.turns[:1])


def embed_all(model, prompts: Sequence[data.Prompt], desc: str = "embed",
              verbose: bool = True) -> np.ndarray:
  """float32[N, D]: the prompt embedding of each prompt (`knn_library.embed`)."""
  rows = [embed(model.graphdef, model.state, model.config, prompt_ids(model.tokenizer, p))
          for p in tqdm(prompts, desc=desc, unit="prompt", disable=not verbose, leave=False)]
  return np.stack(rows) if rows else np.zeros((0, model.config.embed_dim), np.float32)


def build_domain(model, name: str, prompts: Sequence[data.Prompt], x: np.ndarray, *,
                 anchors: int = 10, search_prompts: int = 8, iterations: int = 40,
                 gamma: int = 4, seed: int = 0, objective: str = "measured",
                 drafter_of=None, verbose: bool = True) -> dict:
  """One domain's part from its prompts' embeddings x[N, D]: anchors [k, D], the searched
  skip masks, and the search record. `objective`: the Self-SD search's
  (`self_sd_search.OBJECTIVES`; KNN-SSD's paper times each candidate, "measured"), which
  decodes with `drafter_of(plan)` (`self_sd_search.search`). A measured search also
  scores its candidates by the predicted objective and keeps the two rankings' Spearman ρ
  (`rank_agreement`): we run far fewer timed steps than the paper's 1,000, and ρ says
  whether the quick objective could stand in for the timed one."""
  chosen = choose_anchors(x, anchors, seed)
  reps = [prompts[i] for i in chosen.rows[:search_prompts]]
  ids = [prompt_ids(model.tokenizer, p) for p in reps]
  res = self_sd.search(model.graphdef, model.state, model.config, ids, iterations=iterations,
                       gamma=gamma, seed=seed, objective=objective, drafter_of=drafter_of,
                       rank_check=objective == "measured", verbose=verbose)
  return dict(anchors=x[chosen.rows], attn=np.asarray(res.plan.attn),
              mlp=np.asarray(res.plan.mlp), anchor_ids=[prompts[i].id for i in chosen.rows],
              cluster_sizes=chosen.sizes.tolist(), search_ids=[p.id for p in reps],
              objective=res.objective, objective_kind=res.kind, alpha=res.alpha,
              cost=res.cost, rank_agreement=res.rank_agreement)


def cached_embeddings(model, name: str, prompts: Sequence[data.Prompt], folder: Path,
                      verbose: bool = True) -> np.ndarray:
  """The prompts' embeddings, kept in `folder` so that a rebuild with other search
  settings does not embed again (prefilling long rag/summarisation prompts is the slow
  part on a CPU)."""
  path = folder / f"{name}.embeddings.npz"
  ids = [p.id for p in prompts]
  if path.exists():
    with np.load(path) as z:
      if z["ids"].tolist() == ids:
        return z["x"]
  x = embed_all(model, prompts, f"embed {name}", verbose)
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, ids=np.asarray(ids), x=x)
  tmp.replace(path)
  return x


def parts_dir(library: Path) -> Path:
  return library.with_name(library.name + ".parts")


def build(model, domains: Mapping[str, Sequence[data.Prompt]], out: Path | None = None, *,
          verbose: bool = True, embeddings: Path | None = None, **kw) -> SkipLibrary:
  """Build (or resume) the library for `domains` and save it at `out`. `embeddings`: the
  folder that keeps the prompts' embeddings (default: beside the parts), so libraries
  that differ only in their search settings embed once."""
  self_sd.check_objective(kw.get("objective", "measured"), kw.get("drafter_of"))
  out = Path(out or default_dir(artefact_key(model)))
  parts_path = parts_dir(out)
  parts_path.mkdir(parents=True, exist_ok=True)
  embeddings = Path(embeddings) if embeddings else parts_path
  embeddings.mkdir(parents=True, exist_ok=True)
  parts = {}
  for name in tqdm(list(domains), desc="knn library", unit="domain", disable=not verbose):
    path = parts_path / f"{name}.npz"
    settings = dict({k: v for k, v in kw.items() if k != "drafter_of"},
                    prompts=[p.id for p in domains[name]],
                    search_version=self_sd.OBJECTIVE_VERSION)
    if path.exists():
      parts[name] = _read_part(path)
      if parts[name].get("settings") == settings:
        continue  # built by an earlier, interrupted run with the same settings
    if not domains[name]:
      raise LibraryError(f"domain {name!r} has no prompts: every domain needs some to pick "
                         f"anchors and search a skip set on")
    x = cached_embeddings(model, name, domains[name], embeddings, verbose)
    parts[name] = build_domain(model, name, domains[name], x, verbose=verbose, **kw)
    parts[name]["settings"] = settings
    _write_part(path, parts[name])
  cfg = model.config
  lib = from_parts(artefact_key(model), parts).check(cfg.num_layers, cfg.embed_dim)
  save_library(out, lib)
  return lib


def _write_part(path: Path, part: dict) -> None:
  arrays = {k: part[k] for k in ("anchors", "attn", "mlp")}
  meta = {k: v for k, v in part.items() if k not in arrays}
  tmp = path.with_suffix(".tmp.npz")
  np.savez(tmp, meta=json.dumps(meta), **arrays)
  tmp.replace(path)


def _read_part(path: Path) -> dict:
  with np.load(path) as z:
    part = json.loads(str(z["meta"]))
    part.update(anchors=z["anchors"], attn=z["attn"], mlp=z["mlp"])
  return part


def summary_table(lib: SkipLibrary) -> str:
  """Markdown: per domain, its anchors and the skip set the search found."""
  rows = ["| domain | anchors | skipped attn | skipped MLP | search α | search speedup "
          "| ρ predicted vs measured |", "| --- | --- | --- | --- | --- | --- | --- |"]
  for i, d in enumerate(lib.domains):
    m = lib.meta.get(d, {})
    alpha, obj, rho = m.get("alpha"), m.get("objective"), m.get("rank_agreement")
    kind = m.get("objective_kind", "predicted")
    rows.append(f"| {d} | {int((lib.anchor_domain == i).sum())} | {int((~lib.attn[i]).sum())} "
                f"| {int((~lib.mlp[i]).sum())} | {'' if alpha is None else f'{alpha:.2f}'} "
                f"| {'' if obj is None else f'{obj:.2f} ({kind})'} "
                f"| {'' if rho is None else f'{rho:+.2f}'} |")
  return "\n".join(rows)
