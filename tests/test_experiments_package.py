"""experiments/ is a package: every script runs as `python -m experiments.NAME`, none edits
`sys.path`, and the index names every script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                 if p.stem not in ("__init__", "report"))

# Every script's `--help`, run as `python -m` runs it, in one child process (one jax
# import for all of them): a script that cannot import, or whose parser breaks, fails.
_HELP_ALL = """
import contextlib, io, json, runpy, sys
out = {}
for name in sys.argv[1:]:
  sys.argv = [name, "--help"]
  text = io.StringIO()
  try:
    with contextlib.redirect_stdout(text):
      runpy.run_module(f"experiments.{name}", run_name="__main__", alter_sys=True)
    out[name] = ("no exit", text.getvalue()[:200])
  except SystemExit as exit:
    out[name] = (exit.code, text.getvalue()[:200])
  except BaseException as err:
    out[name] = (repr(err), "")
print(json.dumps(out))
"""


def test_every_script_runs_as_a_module_and_answers_help():
  proc = subprocess.run([sys.executable, "-c", _HELP_ALL, *SCRIPTS], capture_output=True,
                        text=True, cwd=ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  failed = {n: r for n, r in got.items() if r[0] not in (0, None) or "usage:" not in r[1]}
  assert not failed, failed
  assert set(got) == set(SCRIPTS)


def test_no_script_edits_sys_path():
  edits = [p.name for p in (ROOT / "experiments").glob("*.py")
           if re.search(r"sys\.path\.(insert|append)", p.read_text())]
  assert edits == []


def test_the_index_names_every_script():
  index = (ROOT / "experiments" / "README.md").read_text()
  missing = [n for n in SCRIPTS if f"`{n}`" not in index and f"`{n}` (" not in index]
  assert missing == []
