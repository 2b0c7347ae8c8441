"""The results store every benchmark shares: resume, crash safety, settings kept apart."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.bench.results_store import ResultsStore, ResumeError, fingerprint

SETTINGS = {"model": "tiny-llama", "gamma": 4, "drafters": ["knapspec"]}


def unit_records(i: int) -> list[dict]:
  return [{"method": "ar", "i": i}, {"method": "knapspec", "i": i, "text": "é" * (i % 5)}]


def test_units_survive_reopening_and_a_rerun_needs_resume(tmp_path):
  store = ResultsStore(tmp_path, SETTINGS, resume=False)
  for i in range(3):
    store.add(f"p{i}", unit_records(i))
  with pytest.raises(ResumeError, match="--resume"):
    ResultsStore(tmp_path, SETTINGS, resume=False)
  again = ResultsStore(tmp_path, SETTINGS, resume=True)
  assert again.units() == ["p0", "p1", "p2"] and again.done("p1") and not again.done("p3")
  assert again.records() == [r for i in range(3) for r in unit_records(i)]


def test_changed_settings_are_refused_naming_the_change(tmp_path):
  ResultsStore(tmp_path, SETTINGS, resume=False).add("p0", unit_records(0))
  with pytest.raises(ResumeError, match=r"gamma: 4 -> 6"):
    ResultsStore(tmp_path, {**SETTINGS, "gamma": 6}, resume=True)


def test_separate_mode_keeps_each_settings_own_units(tmp_path):
  store = ResultsStore(tmp_path, {"sweep": "s"}, resume=False, mismatch="separate")
  a, b = store.register({**SETTINGS, "gamma": 2}), store.register({**SETTINGS, "gamma": 6})
  store.add("p0", unit_records(0), settings_key=a)
  store.add("p0", unit_records(1), settings_key=b)
  again = ResultsStore(tmp_path, {"sweep": "s"}, resume=True, mismatch="separate")
  assert again.records(a) == unit_records(0) and again.records(b) == unit_records(1)
  assert again.done("p0", a) and not again.done("p1", b)
  assert json.loads((tmp_path / "settings.json").read_text())[a]["gamma"] == 2


def test_a_file_of_another_format_is_refused(tmp_path):
  (tmp_path / "results.jsonl").write_text(json.dumps({"prompt_id": "p0", "method": "ar"}) + "\n")
  (tmp_path / "settings.json").write_text(json.dumps({fingerprint(SETTINGS): SETTINGS}))
  with pytest.raises(ResumeError, match="not written by specjax's results store"):
    ResultsStore(tmp_path, SETTINGS, resume=True)
  (tmp_path / "settings.json").unlink()
  (tmp_path / "results.jsonl").write_text(json.dumps({"unit": "p0", "settings": "x",
                                                      "records": []}) + "\n")
  with pytest.raises(ResumeError, match="no settings.json"):
    ResultsStore(tmp_path, SETTINGS, resume=True)


@settings(max_examples=40, deadline=None)
@given(units=st.integers(1, 6), cut=st.floats(0, 1))
def test_a_kill_anywhere_loses_at_most_the_unit_being_written(tmp_path_factory, units, cut):
  """Cut the file at any byte (a kill mid-write): reopening keeps exactly the units whose
  line is complete, drops the cut one from the file, and later units append cleanly."""
  folder = tmp_path_factory.mktemp("store")
  store = ResultsStore(folder, SETTINGS, resume=False)
  for i in range(units):
    store.add(f"p{i}", unit_records(i))
  raw = (folder / "results.jsonl").read_bytes()
  at = int(cut * len(raw))
  (folder / "results.jsonl").write_bytes(raw[:at])
  complete = raw[:at].count(b"\n")
  again = ResultsStore(folder, SETTINGS, resume=True)
  assert again.units() == [f"p{i}" for i in range(complete)]
  for i in range(complete, units):
    again.add(f"p{i}", unit_records(i))
  final = ResultsStore(folder, SETTINGS, resume=True)
  assert final.units() == [f"p{i}" for i in range(units)]
  assert final.records() == [r for i in range(units) for r in unit_records(i)]


def test_carried_states_survive_a_restart_and_a_torn_file_only_warns(tmp_path):
  store = ResultsStore(tmp_path, SETTINGS, resume=False)
  assert store.load_carried() == {}
  store.save_carried({"swift": {"trials": 7}, "static": None})
  again = ResultsStore(tmp_path, SETTINGS, resume=True)
  assert again.load_carried() == {"swift": {"trials": 7}}
  assert ResultsStore(tmp_path / "other", {"x": 1}, resume=False).load_carried() == {}
  path = next(tmp_path.glob("carried-*.pkl"))
  path.write_bytes(path.read_bytes()[:5])  # torn
  with pytest.warns(UserWarning, match="start cold"):
    assert again.load_carried() == {}


def test_done_is_per_settings_key(tmp_path):
  """A unit finished under one point's settings is not done under another's: a sweep
  resumed after a kill runs each point's missing prompts, not the prompts some other point
  finished."""
  store = ResultsStore(tmp_path, {"sweep": "s"}, resume=False, mismatch="separate")
  a, b = store.register({**SETTINGS, "gamma": 2}), store.register({**SETTINGS, "gamma": 6})
  store.add("p0", unit_records(0), settings_key=a)
  again = ResultsStore(tmp_path, {"sweep": "s"}, resume=True, mismatch="separate")
  for s in (store, again):
    assert s.done("p0", a) and not s.done("p0", b)
    assert s.units(a) == ["p0"] and s.units(b) == [] and s.records(b) == []


def test_a_corrupt_line_mid_file_costs_only_its_own_unit(tmp_path):
  """A line that is not JSON between good ones (a disk error, a hand edit): the units
  before and after it stay done, its unit is redone, and the file is not cut there."""
  store = ResultsStore(tmp_path, SETTINGS, resume=False)
  for i in range(3):
    store.add(f"p{i}", unit_records(i))
  lines = (tmp_path / "results.jsonl").read_bytes().split(b"\n")
  lines[1] = lines[1][: len(lines[1]) // 2] + b"\x00garbage"
  (tmp_path / "results.jsonl").write_bytes(b"\n".join(lines))
  again = ResultsStore(tmp_path, SETTINGS, resume=True)
  assert again.units() == ["p0", "p2"]
  assert again.done("p0") and not again.done("p1") and again.done("p2")
  assert again.records() == unit_records(0) + unit_records(2)
  again.add("p1", unit_records(1))
  final = ResultsStore(tmp_path, SETTINGS, resume=True)
  assert final.units() == ["p0", "p2", "p1"]
  assert final.records() == unit_records(0) + unit_records(2) + unit_records(1)
