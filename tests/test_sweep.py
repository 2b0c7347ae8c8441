"""`specjax sweep`: grids from a file, killed mid-run and resumed, tables and plots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_data import write_spec_bench

from specjax.bench import sweep
from specjax.cli import main

SWEEP = """
name = "tiny"
metric = "speedup"
[fixed]
model = "tiny-qwen3"
drafters = ["early_exit"]
categories = ["writing", "qa"]
per_category = 1
max_new_tokens = {tokens}
[grid]
gamma = [2, 3]
"early_exit.k" = [1]
"""


def units(out) -> list[tuple[str, str]]:
  return [(l["settings"], l["unit"]) for l in
          map(json.loads, (out / "results.jsonl").read_text().splitlines())]


def test_a_killed_sweep_resumes_without_losing_or_repeating_a_row(tmp_path, capsys):
  root = write_spec_bench(tmp_path / "data")
  spec = tmp_path / "tiny.toml"
  spec.write_text(SWEEP.format(tokens=12))
  out = tmp_path / "run"
  argv = ["sweep", str(spec), "--data-dir", str(root), "--out", str(out)]
  proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", *argv], env=os.environ.copy(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  path = out / "results.jsonl"
  while time.time() < deadline and proc.poll() is None:
    if path.exists() and path.read_bytes().count(b"\n") >= 1:
      break
    time.sleep(0.02)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  before = units(out)
  assert 1 <= len(before) < 4, f"the kill came too late to test a resume: {len(before)} rows"

  assert main(argv) == 2  # refuses to start over without --resume
  assert "--resume" in capsys.readouterr().err
  assert main(argv + ["--resume"]) == 0
  after = units(out)
  assert after[: len(before)] == before  # nothing redone, nothing lost
  assert len(after) == len(set(after)) == 4  # 2 points x 2 prompts, once each
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert figures["points"] == 2 and figures["mismatches"] == 0
  assert [r["gamma"] for r in figures["rows"]] == [2, 3]
  assert (out / "table.md").exists() and (out / "table.csv").exists()
  assert (out / "sweep_tiny.png").exists()

  # Changed settings: the points are run anew, kept apart from the old rows.
  spec.write_text(SWEEP.format(tokens=8))
  assert main(argv + ["--resume"]) == 0
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert len(units(out)) == 8 and units(out)[:4] == after
  assert all(r["prompts"] == 2 for r in figures["rows"]) and len(figures["rows"]) == 2


@pytest.mark.parametrize("text, message", [
    ('name = "x"\n[fixed]\ndrafters = ["clasp"]', "no model"),
    ('[fixed]\nmodel = "tiny-llama"\ncolour = 1', "unknown setting 'colour'"),
    ('metric = "bleu"\n[fixed]\nmodel = "tiny-llama"', "metric 'bleu'"),
    ('[fixed]\nmodel = "tiny-llama"\n[grid]\ngamma = []', "non-empty list"),
    ('[fixed]\nmodel = "tiny-llama"\n[grid]\ndrafters = [["medusa"]]', "unknown drafter"),
    ('[fixed]\nmodel = "tiny-llama"\n[grid]\n"clasp.M" = [2]', "clasp has no option 'M'"),
    ('[fixed]\nmodel = "tiny-llama"\n[grid]\ngamma = [0]', "gamma must be >= 1"),
    ('[fixed\nmodel = 1', "not valid TOML"),
    ('[[points]]\ngamma = 2\n[[points]]\ngamma = 2\n[fixed]\nmodel = "tiny-llama"',
     "same settings"),
])
def test_bad_sweep_files_say_what_is_wrong(tmp_path, text, message):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  with pytest.raises(sweep.SweepFileError, match=message):
    sweep.load(path)


def test_points_and_grids_combine():
  path_text = """
[fixed]
model = "tiny-llama"
drafters = "clasp"
[grid]
"clasp.interval" = [2, 4]
[[points]]
gamma = 2
[[points]]
gamma = 3
"""
  import tempfile
  from pathlib import Path

  with tempfile.TemporaryDirectory() as d:
    p = Path(d) / "s.toml"
    p.write_text(path_text)
    s = sweep.load(p)
  assert s.axes == ("clasp.interval", "gamma")
  assert [dict(pt.axes) for pt in s.points] == [
      {"clasp.interval": 2, "gamma": 2}, {"clasp.interval": 4, "gamma": 2},
      {"clasp.interval": 2, "gamma": 3}, {"clasp.interval": 4, "gamma": 3}]
  assert s.points[0].config.drafters == ("clasp",)
  assert s.points[1].config.options == {"clasp": {"interval": 4}}


def test_every_shipped_sweep_file_loads():
  from pathlib import Path

  files = sorted((Path(__file__).parent.parent / "experiments" / "sweeps").glob("*.toml"))
  assert len(files) >= 5
  for f in files:
    assert sweep.load(f).points


def test_a_mix_ratio_point_decodes_a_task_stream_of_held_out_prompts(tmp_path):
  """r = 0 stays in one domain, r = 1 switches after every prompt; the prompts are the
  held-out share of each category (never used to build a KNN library)."""
  root = write_spec_bench(tmp_path / "data", per_category=4)
  spec = tmp_path / "s.toml"
  spec.write_text('[fixed]\nmodel = "tiny-llama"\ndrafters = ["knn"]\n'
                  'categories = ["writing", "qa", "translation"]\nstream_length = 6\n'
                  '[grid]\nmix_ratio = [0.0, 1.0]\n')
  s = sweep.load(spec)
  still, mixed = (sweep._prompts(p, root) for p in s.points)
  assert len(still) == len(mixed) == 6
  assert len({c for _, c, _ in still}) == 1
  assert all(a[1] != b[1] for a, b in zip(mixed, mixed[1:]))
  held = {f"{c} question {i}?" for c in ("writing", "qa", "translation") for i in range(2)}
  assert {t[0] for _, _, t in still + mixed} <= held  # ceil(0.3 * 4) = 2 held out each
  assert [u for u, _, _ in mixed][:2] == ["r1.0/0", "r1.0/1"]
  bad = tmp_path / "bad.toml"
  bad.write_text('[fixed]\nmodel = "tiny-llama"\ncontext = 512\nmix_ratio = 0.5\n')
  with pytest.raises(sweep.SweepFileError, match="two workloads"):
    sweep.load(bad)


def _records(point: int, prompt: str) -> list[dict]:
  """AR and early_exit on one prompt of grid point `point`: figures that differ from point
  to point and from column to column (speedup, M and α are all different numbers)."""
  ar = {"method": "ar", "prompt_id": prompt, "decode_tokens": 40, "decode_s": 2.0,
        "is_reference": True, "matches_ar": None}
  ssd = {"method": "early_exit", "prompt_id": prompt, "decode_tokens": 40,
         "decode_s": 2.0 / (1.2 + 0.3 * point), "rounds": 10, "drafted": 30,
         "accepted": 7 + 5 * point, "committed": 17 + 5 * point,
         "matches_ar": point != 1}
  return [ar, ssd]


def test_rows_and_table_carry_each_points_own_figures(tmp_path):
  """Each row holds its own point's figures, as `metrics.summarize` gives them from that
  point's records alone, and each table column prints its own figure."""
  from specjax.bench import metrics
  from specjax.bench.results_store import ResultsStore

  spec = tmp_path / "s.toml"
  spec.write_text(SWEEP.format(tokens=12))
  s = sweep.load(spec)
  store = ResultsStore(tmp_path / "run", {"sweep": s.name}, resume=False, mismatch="separate")
  keys = [store.register(p.settings()) for p in s.points]
  for i, key in enumerate(keys):
    for prompt in ("a", "b"):
      store.add(prompt, _records(i, prompt), settings_key=key)
  rows = sweep.rows(s, store, keys)
  assert [(r["gamma"], r["method"]) for r in rows] == [(2, "early_exit"), (3, "early_exit")]
  for i, (r, key) in enumerate(zip(rows, keys)):
    want = metrics.summarize(store.records(key))["early_exit"]
    assert want["speedup"] == pytest.approx(1.2 + 0.3 * i)
    assert want["M"] == pytest.approx(1.7 + 0.5 * i)
    assert {k: r[k] for k in ("prompts", "tokens_per_s", "speedup", "M", "alpha",
                              "mismatches")} == {k: want[k] for k in (
        "prompts", "tokens_per_s", "speedup", "M", "alpha", "mismatches")}
  lines = sweep.table(s, rows).splitlines()
  head = [c.strip() for c in lines[0].strip("|").split("|")]
  for r, line in zip(rows, lines[2:]):
    cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
    assert cells == {"gamma": str(r["gamma"]), "early_exit.k": "1", "method": "early_exit",
                     "prompts": "2", "tok/s": f"{r['tokens_per_s']:.1f}",
                     "speedup": f"{r['speedup']:.2f}", "M": f"{r['M']:.2f}",
                     "α": f"{r['alpha']:.2f}", "mismatches": str(r["mismatches"])}
  assert [r["mismatches"] for r in rows] == [0, 2]
