"""`specjax sweep FILE`: an ablation grid over models, drafters and their hyper-parameters,
resumable, with one table and one plot per swept axis.

A sweep file is TOML:

    name = "clasp-interval"                  # the docs section and the default --out
    metric = "speedup"                       # plotted: speedup, tokens_per_s, M or alpha
    [fixed]                                  # settings every point shares
    model = "smollm2-135m-instruct"
    drafters = ["clasp"]
    categories = ["writing", "qa"]
    per_category = 1
    [grid]                                   # axes: every combination is a point
    gamma = [2, 4]
    "clasp.interval" = [4, 8, 16]

Keys are `specjax bench` settings (model, drafters, gamma, threshold, max_new_tokens,
per_category, categories, temperature, …), `context` (long prompts of about that many
tokens instead of Spec-Bench's), `mix_ratio` (a task stream of `stream_length` held-out
prompts over the categories as domains, switching domain with that probability after
each prompt, as in KNN-SSD) or `DRAFTER.OPTION` (any option of `drafters.names`).
`[[points]]` tables list points instead of (or as well as) a grid.

Every point runs AR and its drafters on the same prompts in the same process (the
harness), so each point's speedup is a ratio measured in one run. All points share one
results store: a point is its own settings fingerprint, so a resumed sweep redoes only
what is missing, and a point whose settings changed is run anew beside the old rows
(which the table no longer shows).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specjax import data, plots
from specjax.bench import docs, metrics
from specjax.bench import runner as bench
from specjax.bench.results_store import ResultsStore
from specjax.errors import SpecjaxError

METRICS = ("speedup", "tokens_per_s", "M", "alpha")
_WORKLOAD = ("context", "mix_ratio", "stream_length")
_BENCH_FIELDS = {f.name for f in dataclasses.fields(bench.BenchConfig)} - {"options"}
_DEFAULTS = dict(drafters=bench.DEFAULT_DRAFTERS, per_category=1,
                 categories=data.SPEC_BENCH_CATEGORIES, max_new_tokens=64, max_turns=1, gamma=4,
                 threshold=None, temperature=0.0, top_p=1.0, seed=0, search_iterations=60,
                 plan_file=None)


class SweepFileError(SpecjaxError, ValueError):
  """A sweep file that cannot be run as written (the message says where)."""


@dataclasses.dataclass(frozen=True)
class Point:
  """One setting of the grid: its bench settings, its workload (Spec-Bench, long prompts
  of `context` tokens, or a task stream with `mix_ratio`), and the values of the swept
  axes (for the table)."""

  config: bench.BenchConfig
  context: int | None
  axes: tuple[tuple[str, Any], ...]
  mix_ratio: float | None = None
  stream_length: int = 10

  def settings(self) -> dict:
    return {**bench.settings_of(self.config), "context": self.context,
            "mix_ratio": self.mix_ratio, "stream_length": self.stream_length}


@dataclasses.dataclass(frozen=True)
class Sweep:
  name: str
  metric: str
  axes: tuple[str, ...]
  points: tuple[Point, ...]


def load(path: str | Path) -> Sweep:
  """Parse and check a sweep file: every key known, every point buildable by name."""
  path = Path(path)
  try:
    spec = tomllib.loads(path.read_text())
  except FileNotFoundError:
    raise SweepFileError(f"no sweep file at {path}") from None
  except tomllib.TOMLDecodeError as err:
    raise SweepFileError(f"{path}: not valid TOML: {err}") from None
  unknown = set(spec) - {"name", "metric", "fixed", "grid", "points"}
  if unknown:
    raise SweepFileError(f"{path}: unknown table or key {sorted(unknown)[0]!r} (name, metric, "
                         f"fixed, grid, points)")
  metric = spec.get("metric", "speedup")
  if metric not in METRICS:
    raise SweepFileError(f"{path}: metric {metric!r} is not one of {', '.join(METRICS)}")
  fixed, grid = spec.get("fixed", {}), spec.get("grid", {})
  for axis, values in grid.items():
    if not isinstance(values, list) or not values:
      raise SweepFileError(f"{path}: grid axis {axis!r} needs a non-empty list of values")
  combos = [dict(zip(grid, vals)) for vals in itertools.product(*grid.values())] if grid else []
  listed = spec.get("points", [])
  if not combos and not listed:
    combos = [{}]
  rows = [{**c, **p} for p in (listed or [{}]) for c in (combos or [{}])]
  axes = tuple(dict.fromkeys(k for r in rows for k in r))
  points = tuple(_point(path, {**fixed, **r}, tuple((a, r.get(a)) for a in axes)) for r in rows)
  if len({json.dumps(p.settings(), sort_keys=True) for p in points}) < len(points):
    raise SweepFileError(f"{path}: two points have the same settings")
  return Sweep(spec.get("name", path.stem), metric, axes, points)


def _point(path: Path, values: Mapping[str, Any], axes) -> Point:
  settings: dict[str, Any] = dict(_DEFAULTS)
  options: dict[str, dict] = {}
  context, workload = None, {}
  for key, value in values.items():
    if key == "context":
      context = int(value)
    elif key in ("mix_ratio", "stream_length"):
      workload[key] = value
    elif "." in key:
      part, _, option = key.partition(".")
      options.setdefault(part, {})[option] = value
    elif key in _BENCH_FIELDS:
      settings[key] = value
    else:
      raise SweepFileError(f"{path}: unknown setting {key!r}; settings: "
                           f"{', '.join(sorted(_BENCH_FIELDS | set(_WORKLOAD)))} or "
                           f"DRAFTER.OPTION")
  if "model" not in settings:
    raise SweepFileError(f"{path}: no model (set it in [fixed] or sweep it in [grid])")
  for key in ("drafters", "categories"):
    if isinstance(settings[key], str):
      settings[key] = [settings[key]]
    settings[key] = tuple(settings[key])
  cfg = bench.BenchConfig(**settings, options=options)
  try:
    bench.validate(cfg)
  except (ValueError, KeyError) as err:  # KeyError: UnknownDrafterError
    raise SweepFileError(f"{path}: point {dict(axes)}: {err}") from None
  if context is not None and "mix_ratio" in workload:
    raise SweepFileError(f"{path}: point {dict(axes)}: context and mix_ratio are two workloads; "
                         f"choose one")
  if not 0 <= workload.get("mix_ratio", 0) <= 1 or workload.get("stream_length", 1) < 1:
    raise SweepFileError(f"{path}: point {dict(axes)}: mix_ratio must be in [0, 1] and "
                         f"stream_length >= 1")
  return Point(cfg, context, axes, **workload)


def run(sweep: Sweep, out_dir: Path, *, data_dir=None, resume: bool = False,
        verbose: bool = True, write_docs: bool = False, command: str | None = None) -> dict:
  """Run every point not already in the store; then the table, CSV and plots."""
  from specjax.models.loader import load_model

  store = ResultsStore(out_dir, {"sweep": sweep.name}, resume=resume, mismatch="separate")
  keys = [store.register(p.settings()) for p in sweep.points]
  prompts = [_prompts(p, data_dir) for p in sweep.points]
  todo = [[q for q in qs if not store.done(q[0], k)] for qs, k in zip(prompts, keys)]
  bar = tqdm(total=sum(len(qs) for qs in prompts), desc=f"sweep {sweep.name}", unit="prompt",
             disable=not verbose, initial=sum(len(a) - len(b) for a, b in zip(prompts, todo)))
  models: dict[tuple[str, str], Any] = {}
  for point, key, work in zip(sweep.points, keys, todo):
    if not work:
      continue
    cfg = point.config
    if (cfg.model, cfg.dtype) not in models:
      models = {(cfg.model, cfg.dtype): load_model(cfg.model, dtype=cfg.dtype, verbose=False)}
    model = models[(cfg.model, cfg.dtype)]
    if point.context is not None:  # the long prompts are token ids: tokenise now
      work = _tokenised(model, point, work, data_dir)
    _, search, pilots = bench.split_prompts(cfg, data_dir)
    bar.set_postfix_str(", ".join(f"{a}={v}" for a, v in point.axes))
    # Per point: its draft lengths (auto_gamma) depend on its settings.
    bench.run_units(cfg, model, work, store, work_dir=out_dir / "points" / key,
                    search_prompts=search, pilot_prompts=pilots,
                    data_dir=data_dir, settings_key=key, verbose=verbose,
                    progress=bar.update)
  bar.close()
  return finish(sweep, store, keys, out_dir, verbose, write_docs, command)


def _prompts(point: Point, data_dir) -> list[tuple[str, str, Any]]:
  """(unit, category, turns or None) per prompt of the point; long prompts are built
  once the model (its tokenizer) is loaded."""
  cfg = point.config
  if point.context is not None:
    return [(f"ctx{point.context}/{i}", f"ctx-{point.context}", None)
            for i in range(cfg.per_category)]
  if point.mix_ratio is not None:  # held-out prompts: never used to build a KNN library
    from specjax.offline.knn_build import domain_prompts

    _, held = domain_prompts(data_dir, cfg.categories)
    stream = data.task_stream(held, point.stream_length, point.mix_ratio, cfg.seed)
    return [(f"r{point.mix_ratio}/{j}", p.category, p.turns) for j, p in enumerate(stream)]
  evaluation, _, _ = bench.split_prompts(cfg, data_dir)
  return [(p.id, p.category, p.turns) for p in evaluation]


def _tokenised(model, point: Point, work, data_dir):
  longs = data.long_context_prompts(model.tokenizer, point.context, point.config.per_category,
                                    data_dir)
  by_unit = {f"ctx{point.context}/{i}": list(p.ids) for i, p in enumerate(longs)}
  return [(unit, category, by_unit[unit]) for unit, category, _ in work]


def rows(sweep: Sweep, store: ResultsStore, keys: list[str]) -> list[dict]:
  """One row per (point, method): the swept values and the point's figures."""
  out = []
  for point, key in zip(sweep.points, keys):
    records = store.records(key)
    if not records:
      continue
    for method, s in metrics.summarize(records).items():
      if "M" not in s:  # AR and the other references
        continue
      out.append({**dict(point.axes), "method": method, "prompts": s["prompts"],
                  "tokens_per_s": s["tokens_per_s"], "speedup": s["speedup"], "M": s["M"],
                  "alpha": s["alpha"], "mismatches": s["mismatches"], "ties": s["ties"]})
  return out


def table(sweep: Sweep, table_rows: list[dict]) -> str:
  head = [*sweep.axes, "method", "prompts", "tok/s", "speedup", "M", "α", "mismatches"]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  for r in table_rows:
    cells = [str(r[a]) for a in sweep.axes] + [
        r["method"], str(r["prompts"]), f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
        f"{r['M']:.2f}", f"{r['alpha']:.2f}", metrics.mismatch_text(r["mismatches"], r["ties"])]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(sweep: Sweep, table_rows: list[dict], path: Path) -> Path | None:
  """The metric against each swept axis (one panel per axis), one line per setting of
  the other axes and method."""
  axes = [a for a in sweep.axes if len({str(r[a]) for r in table_rows}) > 1]
  if not axes:
    return None
  plt = plots.pyplot()
  fig, panels = plt.subplots(1, len(axes), figsize=(4.2 * len(axes), 3.4), squeeze=False)
  for ax, axis in zip(panels[0], axes):
    others = [a for a in sweep.axes if a != axis]
    groups: dict[str, list[dict]] = {}
    for r in table_rows:
      label = ", ".join([r["method"]] + [f"{a}={r[a]}" for a in others])
      groups.setdefault(label, []).append(r)
    values = list(dict.fromkeys(str(r[axis]) for r in table_rows))
    for label, rs in groups.items():
      xs = [values.index(str(r[axis])) for r in rs]
      ax.plot(xs, [r[sweep.metric] for r in rs], marker="o", label=label)
    ax.set_xticks(range(len(values)), values)
    ax.set_xlabel(axis)
    ax.set_ylabel(sweep.metric)
    if sweep.metric == "speedup":
      ax.axhline(1.0, color="k", lw=0.7)
    if len(groups) <= 8:
      ax.legend(fontsize=7)
  return plots.save(fig, path)


def finish(sweep: Sweep, store: ResultsStore, keys: list[str], out_dir: Path, verbose: bool,
           write_docs: bool, command: str | None) -> dict:
  table_rows = rows(sweep, store, keys)
  text = table(sweep, table_rows)
  (out_dir / "table.md").write_text(f"# sweep {sweep.name}\n\n{text}\n")
  with (out_dir / "table.csv").open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=[*sweep.axes, "method", "prompts", "tokens_per_s",
                                           "speedup", "M", "alpha", "mismatches", "ties"])
    writer.writeheader()
    writer.writerows(table_rows)
  image = plot(sweep, table_rows, out_dir / f"sweep_{sweep.name}.png")
  if verbose:
    print(f"\n{text}\n\ntable: {out_dir / 'table.md'} (and .csv)"
          + (f"  plot: {image}" if image else ""), file=sys.stderr)
  if write_docs:
    _write_docs(sweep, text, image, command or f"specjax sweep {sweep.name}.toml")
  return {"sweep": sweep.name, "points": len(sweep.points), "metric": sweep.metric,
          "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                   for r in table_rows],
          "mismatches": sum(r["mismatches"] or 0 for r in table_rows)}


def _write_docs(sweep: Sweep, text: str, image: Path | None, command: str) -> None:
  first = sweep.points[0]
  cfg = first.config
  model = "models swept" if "model" in sweep.axes else cfg.model
  prompts = (f"{cfg.per_category} long prompt(s) of {first.context} tokens"
             if first.context else
             f"task streams of {first.stream_length} held-out prompts over "
             f"{', '.join(cfg.categories)}" if first.mix_ratio is not None else
             f"{cfg.per_category * len(cfg.categories)} Spec-Bench prompts ({cfg.per_category} "
             f"per category: {', '.join(cfg.categories)})")
  sampling = "greedy" if cfg.temperature == 0 else f"T = {cfg.temperature}"
  body = "\n".join([
      f"## Sweep: {sweep.name}", "",
      f"{model}; {prompts}, {cfg.max_new_tokens} new tokens, {sampling}. Per point, AR and "
      f"the drafters decode the same prompts in one process; speedup is the point's drafter "
      f"over the point's AR. Machine: {docs.machine()}.", "", text, "",
      docs.copy_image(image, f"sweep_{sweep.name}.png")])
  docs.write_section(f"sweep-{sweep.name}", body, command)
