"""experiments/bench_gguf_kernel.py: every block of a model in GGUF blocks is counted once
under its type, its Q4_0 copy holds the same rows at Q4_0's bytes, and each (type, T) gets
a timing (a tiny model in Q8_0 blocks)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from experiments import bench_gguf_kernel
from specjax import cpu_kernels  # noqa: E402
from specjax.models.loader import load_model  # noqa: E402


def test_parts_by_type_and_their_q4_0_copies_are_timed():
  if cpu_kernels.kernel_status("gguf_matmul") != "ready":
    pytest.skip("the gguf_matmul kernel does not build here")
  m = load_model("tiny-llama", dtype="gguf")
  parts = bench_gguf_kernel.parts_by_type(m.state)
  assert list(parts) == ["Q8_0"]
  blocks = [x for x in jax.tree.leaves(m.state) if x.dtype == np.uint8]
  assert sum(b.nbytes for b, _ in parts["Q8_0"]) == sum(b.nbytes for b in blocks)
  q4 = bench_gguf_kernel.as_q4_0(parts["Q8_0"], 8)
  for (b8, n8), (b4, n4) in zip(parts["Q8_0"], q4):
    assert n4 == n8 and b4.shape == (b8.shape[0], n8 // 32 * 18)
  records = bench_gguf_kernel.measure({"Q8_0": parts["Q8_0"], "Q8_0→q4_0": q4}, (1, 5), runs=1)
  assert {(r["type"], r["rows"]) for r in records} == {
      (t, n) for t in ("Q8_0", "Q8_0→q4_0") for n in (1, 5)}
  assert all(r["ms"] > 0 and r["gw_s"] > 0 for r in records)
  by = {(r["type"], r["rows"]): r for r in records}
  assert by[("Q8_0→q4_0", 1)]["weights"] == by[("Q8_0", 1)]["weights"]
  assert by[("Q8_0→q4_0", 1)]["bytes"] == by[("Q8_0", 1)]["weights"] // 32 * 18
