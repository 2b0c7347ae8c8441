"""Shared helpers for experiment scripts: machine description, tables, the last JSON line,
and regenerating a section of a results page under docs/results/ (via specjax.bench.docs)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from specjax.bench import docs, verdict_page
from specjax.bench.docs import copy_image, machine  # noqa: F401  (re-exported for the scripts)
from specjax.cli import add_dtype_arg


def command_line() -> str:
  """This run's command as a reader types it again: `python -m experiments.NAME ARGS` for
  an experiment (run as a module, its argv[0] is its file), else the script's path."""
  script = Path(sys.argv[0]).resolve()
  if script.parent == Path(__file__).resolve().parent:
    head = ["python", "-m", f"experiments.{script.stem}"]
  else:
    head = ["python", os.path.relpath(sys.argv[0], ROOT)]
  return shlex.join(head + sys.argv[1:])  # quoted: an argument with spaces stays one


ROOT = Path(__file__).resolve().parent.parent


def child(name: str, *args: str) -> list[str]:
  """The argv that runs experiment `name` again in a child process, as a module (with
  `child_env`, from any working directory)."""
  return [sys.executable, "-m", f"experiments.{name}", *args]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
  """`env` (default this process's) with the repository root first on PYTHONPATH, so a
  child finds the experiments package wherever it runs."""
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
  return env


def common_args(p, default_model: str = "smollm2-135m-instruct", results: bool = True) -> None:
  """The flags every experiment shares, spelled as `specjax bench` spells them. `results`:
  the script keeps a results store (--out, --resume)."""
  p.add_argument("--model", default=default_model)
  add_dtype_arg(p)
  if results:
    p.add_argument("--out", help="output folder (default runs/EXPERIMENT-MODEL)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run made with the same settings")
  p.add_argument("--write-docs", action="store_true",
                 help="regenerate this experiment's section of its docs/results/ page")


# Arguments that say where things are or what to write, not what is measured.
_NOT_SETTINGS = {"out", "resume", "write_docs", "data_dir"}


def settings(args) -> dict:
  """Every argument that changes a number: the results store's fingerprint."""
  return {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_SETTINGS}


def write_section(name: str, body: str) -> None:
  """Replace the `name` section of its results page, stamped with this command line, and
  regenerate the verdicts page (the section may end with verdict lines)."""
  docs.write_section(name, body, command_line())
  verdict_page.refresh()


def markdown_table(header: list[str], rows: list[list]) -> str:
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def round_robin(calls: dict, repeats: int) -> dict[str, list[float]]:
  """ms of each call (which blocks until its work is done) over `repeats` passes, the calls
  in turn within a pass, so the machine's drift hits them alike; one untimed pass first."""
  times: dict[str, list[float]] = {name: [] for name in calls}
  for i in range(repeats + 1):
    for name, call in calls.items():
      t = time.perf_counter()
      call()
      if i:
        times[name].append((time.perf_counter() - t) * 1e3)
  return times


def print_json(figures: dict) -> None:
  """The last line of every experiment's output: its figures as one JSON object."""
  print(json.dumps(figures, sort_keys=True))


def git_revision() -> str:
  """The commit of the code that runs: `SPECJAX_COMMIT` when set, since a copy of the tree
  (a lent GPU machine's) can carry a .git whose HEAD is not the tree's; else git's HEAD."""
  if named := os.environ.get("SPECJAX_COMMIT", "").strip():
    return named
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()
  except OSError:
    return "unknown"


