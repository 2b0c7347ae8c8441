"""experiments/bench_gpu.py is meant for GPU sessions, which are rare: a CPU smoke run on a
tiny random-init shape keeps the script working end to end (measure, append the JSON
line, render the section from it) so a GPU session only has to run it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _script(*args: str) -> list:
  out = subprocess.run([sys.executable, "-m", "experiments.bench_gpu", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout.strip().splitlines()


def test_smoke_run_measures_every_step_and_renders_its_section(tmp_path):
  lines = tmp_path / "gpu.jsonl"
  _script("--models", "shape:tiny", "--dtype", "mixed", "--repeats", "1", "--chain", "2",
          "--loop-steps", "2", "--tokens", "8", "--runs", "1", "--out", str(lines))
  (row,) = [json.loads(line) for line in lines.read_text().splitlines()]
  assert row["model"] == "shape:tiny" and row["dtype"] == "mixed"
  assert set(row["draft_over_ar"]) == {"0.25", "0.5", "0.75", "traced 0.5", "dispatched 0.5",
                                       "0.5 early stop", "8-bit", "4-bit MLP", "8-bit pallas",
                                       "4-bit MLP pallas"}
  # a dispatched draft is host calls: the jitted loop cannot hold it
  assert set(row["loop_draft_over_ar"]) == set(row["draft_over_ar"]) - {"dispatched 0.5"}
  assert row["ar_ms"] > 0 and row["loop_ar_ms"] > 0 and row["decode_tok_s"] > 0
  # compile time is booked apart from timing, in both modes
  assert row["compiles"] >= 9 and row["loop_compiles"] >= 9
  assert 0 < row["compile_s"] < row["compile_and_time_s"]
  assert 0 < row["loop_compile_s"] < row["loop_compile_and_time_s"]
  out = _script("--report", str(lines))
  assert json.loads(out[-1])["models"] == [row]
  assert any(line.startswith("| draft, 50 %, frozen ÷ AR |") for line in out)
  # a run from before the early-stop row still renders, that cell marked as missing
  old = {**row, "draft_over_ar": {k: v for k, v in row["draft_over_ar"].items()
                                  if k != "0.5 early stop"}}
  lines.write_text(json.dumps(old) + "\n")
  out = _script("--report", str(lines))
  assert "| draft, 50 %, frozen, in a loop of unknown length ÷ AR | – |" in out


def test_a_subset_of_draft_rows_times_the_same_plans():
  """`--drafts` trims what compiles (a lease's minutes) without changing the plans timed."""
  from experiments import bench_gpu

  m = bench_gpu.Model("shape:tiny", "mixed")
  every, _ = bench_gpu.draft_plans(m)
  some, _ = bench_gpu.draft_plans(m, ["0.75", "0.5 early stop"])
  assert list(some) == ["0.75", "0.5 early stop"]
  assert some["0.75"][0].frozen == every["0.75"][0].frozen
  assert some["0.5 early stop"][0].frozen == every["0.5"][0].frozen


def test_an_unknown_draft_row_is_named():
  out = subprocess.run([sys.executable, "-m", "experiments.bench_gpu", "--drafts", "0.5,half"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  assert "unknown draft row 'half'; known: 0.25, 0.5, 0.75" in out.stderr


def test_the_commit_named_in_the_environment_wins_over_a_carried_git(monkeypatch):
  """A lent GPU machine's copy of the tree carries a .git of the session's start, not of
  the code that runs there: `SPECJAX_COMMIT` names that code."""
  from experiments import report

  monkeypatch.setenv("SPECJAX_COMMIT", "0123abc")
  assert report.git_revision() == "0123abc"
  monkeypatch.delenv("SPECJAX_COMMIT")
  assert report.git_revision() not in ("0123abc", "")


def test_ar_is_set_against_the_cards_datasheet_bandwidth():
  """The measured reduction can read slower than AR does (136 % of it on an H200), so the
  section also divides by the published figure, and says "–" for a card it does not know."""
  from experiments import bench_gpu

  row = {"machine": "GPU (NVIDIA H200), Intel(R) Xeon(R) Processor (AVX-512), 16 cores",
         "decode_tok_s": 223.1, "weight_mb": 15010.0}
  assert bench_gpu._datasheet_share(row) == "70%"
  assert bench_gpu._datasheet_share({**row, "machine": "CPU (AMD EPYC), 2 cores"}) == "–"
