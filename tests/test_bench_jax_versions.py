"""experiments/bench_jax_versions.py: one experiment under two interpreters, in turn, each
run stored as it finishes, medians per interpreter, and a resume after a failed run that
redoes nothing already measured. The interpreters are two paths to this one (a wrapper
script), the experiment a script that counts its runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ("-m", "experiments.bench_jax_versions")  # run from ROOT

# Prints its run number n (1, 2, ...) as a figure; fails on the run named by FAIL_AT.
EXPERIMENT = """
import json, os, sys
from pathlib import Path
count = Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if str(n) == os.environ.get("FAIL_AT"):
  sys.exit("boom")
print("progress that is not JSON")
print(json.dumps({"model": "fake", "run": {"n": n}, "flag": True}))
"""


def compare(tmp_path: Path, *extra: str, fail_at: str = "") -> subprocess.CompletedProcess:
  wrapper = tmp_path / "other-python"
  wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
  wrapper.chmod(0o755)
  experiment = tmp_path / "experiment.py"
  experiment.write_text(EXPERIMENT)
  env = {**os.environ, "FAIL_AT": fail_at}
  return subprocess.run(
      [sys.executable, *SCRIPT, "--pythons", f"{sys.executable},{wrapper}",
       "--repeats", "2", "--figures", "run.n,missing", "--out", str(tmp_path / "out"),
       *extra, "--", str(experiment), str(tmp_path / "count")],
      capture_output=True, text=True, env=env, cwd=ROOT)


def test_runs_take_turns_and_medians_are_per_interpreter(tmp_path):
  proc = compare(tmp_path)
  assert proc.returncode == 0, proc.stderr
  figures = json.loads(proc.stdout.strip().splitlines()[-1])
  first, second = figures["labels"]
  assert first.startswith("jax ") and first != second  # same jax: told apart by path
  # In turn: the first interpreter ran 1 and 3, the second 2 and 4.
  assert figures["medians"][first] == {"run.n": 2.0, "missing": None}
  assert figures["medians"][second] == {"run.n": 3.0, "missing": None}
  assert figures["runs"] == {first: 2, second: 2}
  assert "| run.n | 2 | 3 | 1.5 |" in proc.stdout


def test_a_failed_run_keeps_the_others_and_resume_goes_on(tmp_path):
  proc = compare(tmp_path, fail_at="3")
  assert proc.returncode != 0 and "boom" in proc.stderr and "--resume" in proc.stderr
  lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
  assert len(lines) == 2  # runs 1 and 2, stored as they finished
  again = compare(tmp_path, "--resume")
  assert again.returncode == 0, again.stderr
  figures = json.loads(again.stdout.strip().splitlines()[-1])
  # Runs 4 and 5 (3 failed) finish the second repeat: nothing measured is run again.
  assert sorted(figures["medians"][lb]["run.n"] for lb in figures["labels"]) == [2.5, 3.5]
  assert (tmp_path / "count").read_text() == "5"


def test_an_interpreter_that_is_not_there_is_named(tmp_path):
  proc = subprocess.run([sys.executable, *SCRIPT, "--pythons", "no/such/python", "--",
                         "x.py"], capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 2 and "no interpreter at no/such/python" in proc.stderr
  assert "make setup-latest" in proc.stderr
  no_jax = tmp_path / "python-without-jax"
  no_jax.write_text('#!/bin/sh\nexec /usr/bin/env python3 -I -c "import sys; sys.exit(1)"\n')
  no_jax.chmod(0o755)
  proc = subprocess.run([sys.executable, *SCRIPT, "--pythons", str(no_jax), "--",
                         "x.py"], capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 2 and "cannot import jax" in proc.stderr
  proc = subprocess.run([sys.executable, *SCRIPT, "--pythons", sys.executable],
                        capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 2 and "name the experiment after `--`" in proc.stderr


@pytest.mark.parametrize("figures,flat", [
    ({"a": 1, "b": {"c": 2.5, "d": {"e": 3}}, "f": "x", "g": None, "h": True},
     {"a": 1.0, "b.c": 2.5, "b.d.e": 3.0}),
])
def test_flatten_keeps_the_numbers_by_path(figures, flat):
  from experiments import bench_jax_versions

  assert bench_jax_versions.flatten(figures) == flat
