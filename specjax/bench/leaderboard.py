"""The Spec-Bench leaderboard: docs/results/spec-bench.md, in Spec-Bench's own shape.

Spec-Bench's `Leaderboard.md` gives, per device, an environment line and one table of
methods with their mean accepted tokens (M) and speedup over AR. Ours does the same per
machine, model and weight format, with the settings that change a figure (prompts and new
tokens, the draft length, a method's options) beside it. Every `specjax bench
--write-docs` run is kept in docs/results/spec-bench.json (`record`); the page shows, for
each configuration, its latest run only, and a run no cell or verdict still shows is
dropped from the file (git history keeps it).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path

from specjax.bench import claims, docs, llama_cpp, metrics

STORE = docs.RESULTS / "spec-bench.json"
PAGE = docs.RESULTS / "spec-bench.md"
# The summary fields a leaderboard row keeps (metrics.summarize's names).
FIELDS = ("tokens_per_s", "speedup", "median_speedup", "M", "alpha", "mismatches", "ties")


def load(path: Path = STORE) -> list[dict]:
  """Every kept run, oldest first."""
  return json.loads(path.read_text())["runs"] if path.exists() else []


def record(run: Mapping, path: Path = STORE, page: Path = PAGE) -> None:
  """Add one run ({date, command, machine, model, dtype, methods: name -> summary row})
  and regenerate the page; runs that no longer show anything are dropped."""
  if not docs.DOCS_DIR.exists():
    return
  kept = {k: run[k] for k in ("date", "command", "machine", "model", "dtype")}
  # Unrounded: a figure rounded here and again on the page, or divided by another rounded
  # one (a round's cost, M / speedup), can differ from the run's own section in the last
  # digit shown.
  kept["methods"] = {m: {k: r[k] for k in FIELDS if r.get(k) is not None}
                     for m, r in run["methods"].items() if m != metrics.AR}
  runs = [*load(path), kept]
  shown = ({i for i, _, _ in cells(runs).values()}
           | {i for early in (False, True) for i, _ in verdicts(runs, early).values()})
  runs = [r for i, r in enumerate(runs) if r is kept or i in shown]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"runs": runs}, indent=1, ensure_ascii=False) + "\n")
  page.write_text(render(runs))


def settings(command: str, method: str) -> dict[str, str]:
  """What, in a run's command, changes `method`'s figures: prompts and tokens, the draft
  length and early stop, sampling, and the options of the method's parts."""
  args = shlex.split(command)
  def flag(name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default
  parts = set(method.split("+"))
  options = [o for i, o in enumerate(args) if i and args[i - 1] == "--option"
             and o.split(".")[0] in parts]
  gamma = f"≤ {flag('--gamma', '4')}" + (", fitted" if "--auto-gamma" in args else "")
  if (t := flag("--threshold")) is not None:
    gamma += f", τ {t}"
  if method == llama_cpp.METHOD:  # no draft
    gamma = "–"
  per_category = flag("--per-category", "1")
  workload = (f"{per_category}/category × {flag('--max-new-tokens', '64')} tokens"
              + (f", {flag('--categories')}" if "--categories" in args else ""))
  if "--temperature" in args and float(flag("--temperature")) > 0:
    workload += f", T {flag('--temperature')}"
  if int(flag("--tensor-parallel", "1")) > 1:
    workload += f", over {flag('--tensor-parallel')} devices"
  return {"workload": workload, "gamma": gamma, "options": ", ".join(sorted(options))}


def cells(runs: list[dict]) -> dict[tuple, tuple[int, str, dict]]:
  """(machine, model, dtype, workload, method, γ, options) -> (run index, method, row) of
  the latest run with that configuration."""
  out: dict[tuple, tuple[int, str, dict]] = {}
  for i, run in enumerate(runs):
    for method, row in run["methods"].items():
      s = settings(run["command"], method)
      key = (run["machine"], run["model"], run["dtype"], s["workload"], method,
             s["gamma"], s["options"])
      out[key] = (i, method, row)  # later runs replace earlier ones
  return out


def verdicts(runs: list[dict], early: bool = False) -> dict[tuple, tuple[int, claims.Verdict]]:
  """(machine, model, dtype, subject) -> (run index, verdict): each claim judged by the
  current `claims` rules on the latest run that decides it (or the latest run that states
  it, if none does). A verdict is judged within one run: a composition against its parts
  measured beside it. A method that ran a variant (`altered`) is not judged; with `early`,
  only the seed methods run before their paper's defaults (with no options of their own)
  are: what our variant did then, which the verdict page lists apart."""
  out: dict[tuple, tuple[int, claims.Verdict]] = {}
  for i, run in enumerate(runs):
    if early:
      found = claims.for_run({m: r for m, r in run["methods"].items()
                              if _variant(run, m) == "early"})
    else:
      found = claims.for_run(run["methods"], altered=altered(run))
    for v in found:
      key = (run["machine"], run["model"], run["dtype"], v.subject)
      if key not in out or v.outcome != claims.UNDECIDED or out[key][1].outcome == claims.UNDECIDED:
        out[key] = (i, v)
  return out


def _variant(run: Mapping, method: str) -> str | None:
  """Why `method` in `run` did not run its paper's method: "options" of its own on the
  command line, or "early", before the drafter took its paper's defaults; None if it did,
  and for a composition, which is judged against its parts measured beside it whatever
  they ran."""
  if "+" in method:
    return None
  if settings(run["command"], method)["options"]:
    return "options"
  return "early" if claims.predates_paper(method, run["date"]) else None


def altered(run: Mapping) -> set[str]:
  """The seed methods of `run` that ran a variant (`_variant`): no paper verdict reads
  them."""
  return {m for m in run["methods"] if _variant(run, m)}


def _x(v) -> str:
  return "–" if v is None else f"{v:.2f}"


def _mismatches(row: dict) -> str:
  n = row.get("mismatches")
  return "–" if n is None else metrics.mismatch_text(n, row.get("ties"))


def weights(dtype: str, machine: str) -> str:
  """The target's precision in words (`--dtype auto` is float32 on a CPU, bf16 on a GPU)."""
  if dtype == "auto":
    return "float32 weights" if machine.startswith("CPU") else "bfloat16 weights"
  return ("the GGUF file's own blocks (`--dtype gguf`)" if dtype == "gguf"
          else f"`--dtype {dtype}`")


def render(runs: list[dict]) -> str:
  """The page: per machine, per model and weights, one table of methods."""
  latest = cells(runs)
  out = [
      "# Spec-Bench leaderboard", "",
      "Lossless decoding speed over autoregressive decoding (AR), measured in the same "
      "process as AR on Spec-Bench's prompts (Xia et al. 2024; the questions are read from "
      "`../shared/data`). `M`: tokens committed per verification round; `speedup`: total "
      "tokens over total decode time, against AR's; `median`: the median of each prompt's "
      "speedup; `mismatches`: prompts whose tokens differ from AR's (a float32 run must "
      "show 0). Each row is the latest run of its configuration; the runs are listed "
      "under each table with the command that reproduces them. Per-category figures and "
      "draft-length fits of the latest run per model: [spec-bench-runs.md]"
      "(spec-bench-runs.md); the seed papers' verdicts: [verdicts.md](verdicts.md).",
  ]
  by_machine: dict[str, dict[tuple, list]] = {}
  for key, (i, method, row) in latest.items():
    machine, model, dtype, workload = key[:4]
    by_machine.setdefault(machine, {}).setdefault((model, dtype, workload), []).append(
        (i, method, key[5], key[6], row))
  for machine in sorted(by_machine):
    out += ["", f"## {machine}"]
    for (model, dtype, workload), rows in sorted(by_machine[machine].items()):
      used = sorted({i for i, *_ in rows})
      ref = {i: n + 1 for n, i in enumerate(used)}
      out += ["", f"### {model}: {weights(dtype, machine)}, {workload}", "",
              "| method | γ | options | M | speedup | median | tok/s | mismatches | run |",
              "|" + " --- |" * 9]
      before: dict[str, str] = {}  # drafter -> the day it took its paper's defaults
      for i, method, gamma, options, row in sorted(
          rows, key=lambda r: -(r[4].get("speedup") or 0)):
        early = claims.predates_paper(method, runs[i]["date"])
        before.update((p, claims.PAPER_DEFAULTS_SINCE[p]) for p in early)
        out.append(f"| `{method}`{' †' if early else ''} | {gamma} | {options or '–'} | "
                   f"{_x(row.get('M'))} | {_x(row.get('speedup'))}× | "
                   f"{_x(row.get('median_speedup'))} | {row.get('tokens_per_s', 0):.1f} | "
                   f"{_mismatches(row)} | [{ref[i]}] |")
      out += [""] + [f"[{ref[i]}] {runs[i]['date']}: `{runs[i]['command']}`" + "  "
                     for i in used]
      if before:
        days = {day: [p for p in sorted(before) if before[p] == day]
                for day in sorted(set(before.values()))}
        out.append("† ran before its drafter took the paper's defaults (" + "; ".join(
            ", ".join(f"`{p}`" for p in ps) + f": {day}" for day, ps in days.items())
            + "): what ran is now a variant ([../FIDELITY.md](../FIDELITY.md)), and "
            "[verdicts.md](verdicts.md) lists its verdicts apart from the paper's method's.")
      out[-1] = out[-1].rstrip()
  return "\n".join(out) + "\n"
