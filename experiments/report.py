"""Shared helpers for experiment scripts: timing medians, machine description, and
regenerating a section of docs/BENCHMARKS.md in place."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def machine() -> str:
  import jax

  cpu = platform.processor() or platform.machine()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  dev = jax.devices()[0]
  return (f"{dev.platform.upper()} ({getattr(dev, 'device_kind', '')}), {cpu}, "
          f"{os.cpu_count()} cores, jax {jax.__version__}")


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def command_line() -> str:
  return " ".join(["python", os.path.relpath(sys.argv[0], DOCS.parent.parent)] + sys.argv[1:])


def write_section(name: str, body: str) -> None:
  """Replace the `name` section of docs/BENCHMARKS.md (or append it) with `body`."""
  begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
  stamp = datetime.date.today().isoformat()
  block = f"{begin}\n{body.rstrip()}\n\n_Regenerated {stamp} by `{command_line()}`._\n{end}"
  text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
  if begin in text:
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
  else:
    text = text.rstrip() + "\n\n" + block + "\n"
  DOCS.parent.mkdir(parents=True, exist_ok=True)
  DOCS.write_text(text)


def markdown_table(header: list[str], rows: list[list]) -> str:
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def print_json(figures: dict) -> None:
  """The last line of every experiment's output: its figures as one JSON object."""
  print(json.dumps(figures, sort_keys=True))


def git_revision() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=DOCS.parent.parent).stdout.strip()
  except OSError:
    return "unknown"
