"""One experiment under several Python environments (jax installs), side by side.

    python -m experiments.bench_jax_versions \
        --pythons .venv/bin/python,.venv-latest/bin/python --repeats 3 \
        -- -m experiments.bench_forward --runs 3

XLA:CPU's code generation changes between jax releases, and every speedup specjax reports
is a ratio of programs XLA compiled: a release that moves the AR step or verification moves
them all. This runs the experiment given after `--` once under each interpreter per
repeat, the interpreters in turn (so the machine's drift hits them alike), and takes each
run's figures from its last line (every experiment ends with one line of JSON). Each run is
stored as it finishes (`--out`, `--resume`: an interrupted comparison goes on where it
stopped). Reports the median of each figure in `--figures` per interpreter and its ratio
to the first interpreter's; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from experiments import report
from specjax.bench.results_store import ResultsStore
from specjax.errors import SpecjaxError

ROOT = Path(__file__).resolve().parent.parent
# bench_forward's step ratios and decode speed: what a jax release could move.
DEFAULT_FIGURES = ("ar_step_ms", "verify_over_ar", "draft_step_over_ar.50",
                   "int8_draft_step_over_ar.100", "specjax_decode_tok_s",
                   "specjax_share_of_roofline")


class RunFailedError(SpecjaxError, RuntimeError):
  """The experiment exited with an error, or printed no JSON figures."""


def flatten(figures: dict, prefix: str = "") -> dict[str, float]:
  """{"a": {"b": 1}} -> {"a.b": 1.0}: every number in a nested JSON object, by path."""
  out: dict[str, float] = {}
  for key, value in figures.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(flatten(value, path + "."))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      out[path] = float(value)
  return out


def interpreter(name: str) -> str | None:
  """`name` as an absolute path: a command on PATH, or a path from here or from the repo
  (not resolved: a virtualenv's python is a link, and following it leaves the venv)."""
  if os.sep not in name:
    return shutil.which(name)
  for base in (Path.cwd(), ROOT):
    path = (base / name).absolute()
    if os.access(path, os.X_OK):
      return str(path)
  return None


def jax_version(python: str) -> str:
  """The jax version `python` imports (the one label that tells two installs apart)."""
  proc = subprocess.run([python, "-c", "import jax; print(jax.__version__)"],
                        capture_output=True, text=True)
  if proc.returncode != 0:
    raise RunFailedError(f"{python} cannot import jax:\n{proc.stderr[-1000:]}")
  return proc.stdout.strip()


def run_once(python: str, experiment: list[str]) -> dict:
  """The figures (last output line, JSON) of one run of `experiment` under `python`."""
  proc = subprocess.run([python, *experiment], capture_output=True, text=True, cwd=ROOT)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode != 0 or not lines:
    raise RunFailedError(f"{python} {shlex.join(experiment)} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-2000:]}")
  try:
    return json.loads(lines[-1])
  except ValueError as err:
    raise RunFailedError(f"{python} {shlex.join(experiment)}: its last line is not JSON: "
                         f"{lines[-1][:200]!r}") from err


def medians(store: ResultsStore, labels: list[str], figures: list[str]
            ) -> dict[str, dict[str, float | None]]:
  """{label: {figure: median over that interpreter's runs}} (None where no run had it)."""
  out = {}
  for label in labels:
    runs = [flatten(r["figures"]) for r in store.records() if r["label"] == label]
    out[label] = {f: (statistics.median(v) if (v := [r[f] for r in runs if f in r]) else None)
                  for f in figures}
  return out


def table(labels: list[str], meds: dict, figures: list[str], runs: dict[str, int]) -> str:
  """Figures as rows, interpreters as columns, and each later one over the first."""
  base = labels[0]
  header = ["figure", *(f"{lb} ({runs[lb]} runs)" for lb in labels),
            *(f"{lb} ÷ {base}" for lb in labels[1:])]
  rows = []
  for f in figures:
    vals = [meds[lb][f] for lb in labels]
    ratios = [("-" if v is None or not vals[0] else v / vals[0]) for v in vals[1:]]
    rows.append([f, *("-" if v is None else v for v in vals), *ratios])
  return report.markdown_table(header, rows)


def main() -> None:
  argv = sys.argv[1:]
  split = argv.index("--") if "--" in argv else len(argv)
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--pythons", default=".venv/bin/python,.venv-latest/bin/python",
                  help="comma-separated interpreters, the first the baseline")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--figures", default=",".join(DEFAULT_FIGURES),
                  help="comma-separated paths into the experiment's JSON (a.b for nesting)")
  ap.add_argument("--out", help="output folder (default runs/jax-versions-EXPERIMENT)")
  ap.add_argument("--resume", action="store_true",
                  help="continue an interrupted comparison made with the same settings")
  ap.add_argument("--write-docs", action="store_true",
                  help="write this comparison's section of docs/results/cpu-kernels.md")
  args = ap.parse_args(argv[:split])
  experiment = argv[split + 1:]
  if not experiment:
    ap.error("name the experiment after `--`, e.g. -- -m experiments.bench_forward")
  named = [p for p in args.pythons.split(",") if p]
  pythons = [interpreter(p) for p in named]
  if None in pythons:
    missing = [p for p, found in zip(named, pythons) if found is None]
    ap.error(f"no interpreter at {', '.join(missing)} (`make setup` and `make setup-latest` "
             f"make .venv and .venv-latest)")
  names = [f for f in args.figures.split(",") if f]
  try:
    labels = [f"jax {jax_version(p)}" for p in pythons]
  except RunFailedError as err:
    ap.error(str(err))
  if len(set(labels)) < len(labels):
    labels = [f"{lb} ({p})" for lb, p in zip(labels, named)]

  # `-m experiments.bench_forward ...` or a script's path
  name = experiment[1].rsplit(".", 1)[-1] if experiment[0] == "-m" else Path(experiment[0]).stem
  settings = {"pythons": named, "labels": labels, "experiment": experiment,
              "repeats": args.repeats}
  store = ResultsStore(args.out or f"runs/jax-versions-{name}", settings, resume=args.resume)
  total = args.repeats * len(pythons)
  for i in range(args.repeats):
    for j, (python, label) in enumerate(zip(pythons, labels)):
      unit = f"{i}/{label}"
      if store.done(unit):
        continue
      print(f"[{i * len(pythons) + j + 1}/{total}] {label}: {shlex.join(experiment)}",
            flush=True)
      try:
        figures = run_once(python, experiment)
      except RunFailedError as err:
        sys.exit(f"{err}\n(the runs before it are kept: rerun with --resume)")
      store.add(unit, [{"label": label, "repeat": i, "figures": figures}])

  meds = medians(store, labels, names)
  runs = {lb: sum(r["label"] == lb for r in store.records()) for lb in labels}
  text = table(labels, meds, names, runs)
  print(text)
  if args.write_docs:
    first = next((r["figures"] for r in store.records()), {})
    model = first.get("model", "")
    machine = first.get("machine", report.machine()).rsplit(", jax", 1)[0]
    body = "\n".join([
        f"## One experiment on {len(labels)} jax installs ({name}"
        f"{', ' + model if model else ''})",
        "",
        f"Machine: {machine}. Commit {report.git_revision()}.",
        "",
        f"`{shlex.join(experiment)}` run {args.repeats} times under each interpreter "
        f"({', '.join(f'{lb}: `{p}`' for lb, p in zip(labels, named))}), the interpreters "
        f"in turn; medians of the runs, and each later install's over the first's:",
        "",
        text,
    ])
    report.write_section(f"jax-versions-{name}{'-' + model if model else ''}", body)
  report.print_json({"experiment": experiment, "labels": labels, "runs": runs,
                     "medians": meds})


if __name__ == "__main__":
  main()
