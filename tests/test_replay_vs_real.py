"""experiments/replay_vs_real.py: replayed (γ, τ) against real decodes on a tiny model, one
JSON line at the end; malformed pairs are refused."""

from __future__ import annotations

import json
import sys

import pytest
from test_data import write_spec_bench

from experiments import replay_vs_real


def test_pairs_parse_and_bad_ones_are_refused(monkeypatch, tmp_path):
  assert replay_vs_real.parse_pairs("8:0,4:0.4,2") == [(8, 0.0), (4, 0.4), (2, 0.0)]
  monkeypatch.setattr(sys, "argv", ["replay_vs_real.py", "--pairs", "9:0", "--gamma-max", "8"])
  with pytest.raises(SystemExit, match="γ in 1..8"):
    replay_vs_real.main()
  with pytest.raises(SystemExit, match="'8-0.4' is not γ:τ"):
    replay_vs_real.parse_pairs("4:0,8-0.4")


def test_replayed_and_real_figures_for_each_pair_and_the_fit(monkeypatch, tmp_path, capsys):
  root = write_spec_bench(tmp_path / "data")
  monkeypatch.setattr(sys, "argv", [
      "replay_vs_real.py", "--model", "tiny-qwen3", "--drafter", "8bit", "--pairs", "3:0,2:0.5",
      "--gamma-max", "3", "--prompts", "2", "--max-new-tokens", "10", "--runs", "1",
      "--data-dir", str(root)])
  replay_vs_real.main()
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  pairs = {(p["gamma"], p["threshold"]) for p in figures["pairs"]}
  assert {(3, 0.0), (2, 0.5), tuple(figures["fit"])} == pairs
  assert all(p["replayed"] > 0 and p["real"] > 0 for p in figures["pairs"])
  assert figures["pilot_positions"] >= 2 * 10 and isinstance(figures["same_order"], bool)
