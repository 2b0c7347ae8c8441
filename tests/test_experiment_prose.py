"""Benchmark prose is written from the figures: the words change when the numbers do."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_quantspec  # noqa: E402
import profile_round  # noqa: E402


def test_break_even_prose_follows_the_measured_cost():
  assert "no acceptance rate makes it beat AR" in profile_round.break_even_text(5.3, 4)
  text = profile_round.break_even_text(2.0, 4)
  assert "breaks even at M = 2.00" in text
  alpha = float(text.split("α ≈ ")[1].split(" ")[0])
  assert abs((1 - alpha ** 5) / (1 - alpha) - 2.0) < 0.02  # M(α) at the quoted α


def test_quantspec_prose_quotes_the_measured_int8_ar_speed():
  figures = {"1024": {"int8kv_ar_vs_fp_ar": 0.61}, "4096": {"int8kv_ar_vs_fp_ar": 1.12}}
  assert bench_quantspec.int8_vs_fp(figures) == "0.61–1.12×"
  assert bench_quantspec.int8_vs_fp({"1024": {"int8kv_ar_vs_fp_ar": 0.5}}) == "0.50×"
