"""experiments/bench_cpu_kernels.py: every matrix class of a model, through XLA and through
each ready kernel, ends in one JSON line (a smoke run on a tiny model)."""

from __future__ import annotations

import json
import sys

from experiments import bench_cpu_kernels
from specjax import cpu_kernels  # noqa: E402


def test_every_class_and_variant_is_timed(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["bench_cpu_kernels.py", "--model", "tiny-llama",
                                    "--runs", "1", "--rows", "3"])
  bench_cpu_kernels.main()
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert set(figures["ms"]) == set(bench_cpu_kernels.CLASSES)
  want = {"xla T=1", "xla T=3", "xla int4 T=1"}
  if cpu_kernels.kernel_status("f32_matmul") == "ready":
    want |= {"f32 kernel T=1", "f32 kernel T=3"}
  if cpu_kernels.kernel_status("int8_matmul") == "ready":
    want |= {"int8 kernel T=1"}
  if cpu_kernels.kernel_status("int4_matmul") == "ready":
    want |= {"int4 kernel T=1"}
  for times in figures["ms"].values():
    assert set(times) == want and all(t > 0 for t in times.values())
  assert set(figures["total_ms"]) == want
