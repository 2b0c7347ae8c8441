"""experiments/trace_step_ops.py: an AR step and a verification traced op by op, summed by
kind of operation, ending in one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import trace_step_ops  # noqa: E402


def test_op_kinds_drop_the_instance_number_only():
  assert trace_step_ops.op_kind("ynn_fusion.175") == "ynn_fusion"
  assert trace_step_ops.op_kind("add_dynamic-update-slice_fusion") == (
      "add_dynamic-update-slice_fusion")
  assert trace_step_ops._OP_NAME.fullmatch("ffi_call.0")
  assert not trace_step_ops._OP_NAME.fullmatch("ThunkExecutor::Execute")
  assert not trace_step_ops._OP_NAME.fullmatch("Handle inputs")


def test_a_tiny_model_is_traced_op_by_op(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["trace_step_ops.py", "--model", "tiny-llama", "--context",
                                    "32", "--steps", "2"])
  trace_step_ops.main()
  out = capsys.readouterr().out.strip().splitlines()
  figures = json.loads(out[-1])
  assert figures["model"] == "tiny-llama" and figures["steps"] == 2
  for side in ("ar", "verify"):
    ops = figures["ms"][side]
    assert ops and all(trace_step_ops._OP_NAME.fullmatch(k) for k in ops)
    assert abs(sum(ops.values()) - figures["total_ms"][side]) < 1e-2
  assert any(line.startswith("| all |") for line in out)
