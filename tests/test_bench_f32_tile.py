"""experiments/bench_f32_tile.py: the f32 kernel's tile built alone, timed per row count
against the core's FMA rate, ends in one JSON line."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from experiments import bench_f32_tile


def test_parse_reads_lanes_peak_and_each_row_count():
  lanes, peak, times, mix = bench_f32_tile.parse(["lanes 8", "peak 6.031", "mix 1 5.5",
                                                  "rows 1 233.5", "mix 5 3.3", "rows 5 372.0"])
  assert (lanes, peak, times, mix) == (8, 6.031, {1: 233.5, 5: 372.0}, {1: 5.5, 5: 3.3})


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_small_matrix_is_timed_at_every_row_count(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["bench_f32_tile.py", "--shape", "40,72", "--rows", "1,5,9",
                                    "--reps", "3"])
  bench_f32_tile.main()
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert figures["shape"] == [40, 72] and figures["peak_gvfma"] > 0
  assert set(figures["rows"]) == {"1", "5", "9"}
  assert all(r["us"] > 0 and r["share_of_peak"] > 0 and r["mix_gvfma"] > 0
             for r in figures["rows"].values())


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_matrices_in_turn_with_padded_rows_are_timed(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["bench_f32_tile.py", "--shape", "40,72", "--rows", "5",
                                    "--reps", "4", "--copies", "3", "--pad", "8"])
  bench_f32_tile.main()
  out = capsys.readouterr().out.strip().splitlines()
  assert "rows stored 80 floats apart, 3 in turn" in out[0]
  figures = json.loads(out[-1])
  assert (figures["copies"], figures["pad"]) == (3, 8) and figures["rows"]["5"]["us"] > 0


def test_rows_beyond_one_pass_are_refused(monkeypatch):
  assert bench_f32_tile.max_rows() == 9  # a γ = 8 verification in one pass
  monkeypatch.setattr(sys, "argv", ["bench_f32_tile.py", "--rows", "5,10"])
  with pytest.raises(SystemExit, match="between 1 and 9"):
    bench_f32_tile.main()
  monkeypatch.setattr(sys, "argv", ["bench_f32_tile.py", "--copies", "0"])
  with pytest.raises(SystemExit, match="--copies: at least 1"):
    bench_f32_tile.main()
