"""experiments/trace_step_ops.py: an AR step and a verification traced op by op, summed by
kind of operation, ending in one JSON line."""

from __future__ import annotations

import json
import sys

from experiments import trace_step_ops


def test_op_kinds_drop_the_instance_number_only():
  assert trace_step_ops.op_kind("ynn_fusion.175") == "ynn_fusion"
  assert trace_step_ops.op_kind("add_dynamic-update-slice_fusion") == (
      "add_dynamic-update-slice_fusion")
  assert trace_step_ops._OP_NAME.fullmatch("ffi_call.0")
  assert not trace_step_ops._OP_NAME.fullmatch("ThunkExecutor::Execute")
  assert not trace_step_ops._OP_NAME.fullmatch("Handle inputs")


def test_kernel_calls_are_named_by_target_and_largest_operand():
  hlo = """
  %ffi_call.244 = f32[1,5,960]{2,1,0} custom-call(%fusion.60, %bitcast.4), custom_call_target="specjax_f32_matmul_io", operand_layout_constraints={f32[1,5,576]{2,1,0}, f32[576,960]{1,0}}, api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(verify_fn)/ffi_call"}
  %ffi_call.7 = (f32[1,1,9]{2,1,0}) custom-call(%q, %k), custom_call_target="specjax_f32_attention", operand_layout_constraints={f32[1,1,9,64]{3,2,1,0}, s32[1,1]{1,0}, f32[1,3,320,64]{3,2,1,0}}, api_version=API_VERSION_TYPED_FFI
  %ffi_call.9 = (s32[1,5]{1,0}) custom-call(%logits), custom_call_target="specjax_f32_argmax", operand_layout_constraints={f32[1,5,49152]{2,1,0}}, api_version=API_VERSION_TYPED_FFI
  %add.1 = f32[4]{0} add(%a, %b)
  """
  assert trace_step_ops.kernel_calls(hlo) == {
      "ffi_call.244": "f32_matmul_io f32[576,960]",
      "ffi_call.7": "f32_attention f32[1,3,320,64]", "ffi_call.9": "f32_argmax"}


def test_a_tiny_model_is_traced_op_by_op(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["trace_step_ops.py", "--model", "tiny-llama", "--context",
                                    "32", "--steps", "2"])
  trace_step_ops.main()
  out = capsys.readouterr().out.strip().splitlines()
  figures = json.loads(out[-1])
  assert figures["model"] == "tiny-llama" and figures["steps"] == 2
  for side in ("ar", "verify"):
    ops = figures["ms"][side]
    kernels = [k for k in ops if k.startswith(("f32_", "int8_", "int4_", "quant_"))]
    assert ops and all(trace_step_ops._OP_NAME.fullmatch(k) for k in ops if k not in kernels)
    # on a CPU the matmuls are the few-row kernel's calls, named by their weights' shapes
    assert any(k.startswith("f32_matmul_") and "[" in k for k in kernels), ops
    assert abs(sum(ops.values()) - figures["total_ms"][side]) < 1e-2
  assert any(line.startswith("| all |") for line in out)
