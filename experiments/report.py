"""Shared helpers for experiment scripts: machine description, tables, the last JSON line,
and regenerating a section of docs/BENCHMARKS.md (via specjax.docs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from specjax import docs
from specjax.docs import DOCS, machine  # noqa: F401  (re-exported for the scripts)


def command_line() -> str:
  return " ".join(["python", os.path.relpath(sys.argv[0], DOCS.parent.parent)] + sys.argv[1:])


def write_section(name: str, body: str) -> None:
  """Replace the `name` section of docs/BENCHMARKS.md, stamped with this command line."""
  docs.write_section(name, body, command_line())


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


def copy_image(src, name: str) -> str:
  """Copy a plot next to BENCHMARKS.md (docs/img/NAME); return its Markdown image link,
  or "" when there is no plot."""
  import shutil
  from pathlib import Path

  if not src or not Path(src).exists():
    return ""
  img = DOCS.parent / "img" / name
  img.parent.mkdir(exist_ok=True)
  shutil.copy(src, img)
  return f"![{Path(name).stem}](img/{name})"
