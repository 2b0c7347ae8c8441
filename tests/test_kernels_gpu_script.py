"""experiments/kernels_gpu.py is meant for GPU sessions, which are rare: a CPU smoke run in
interpret mode keeps the script working (it checks the kernel against the jnp reference
before timing anything, and ends with its JSON line) so a GPU session only has to run it."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).parent.parent


def test_interpret_smoke_run_checks_the_kernel_and_ends_with_json():
  out = subprocess.run(
      [sys.executable, "-m", "experiments.kernels_gpu", "--interpret", "--contexts", "2048",
       "--repeats", "1", "--splits", "2", "--block", "128", "--matmuls", ""],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  figures = json.loads(out.stdout.strip().splitlines()[-1])
  assert figures["backend"] == "cpu"
  entry = figures["contexts"]["2048"]
  for bits in (4, 8):
    assert entry[f"int{bits}"]["max_abs_err"] < 1e-4
  # int8 reads both code planes, int4 only the upper one; both far less than bf16.
  assert entry["int4"]["bytes_read"] < entry["int8"]["bytes_read"]
  assert entry["int8"]["bytes_read"] < entry["dense_bf16"]["bytes_read"]


def test_interpret_smoke_run_checks_the_matmul_kernels():
  """The matmul part alone: both kernels checked against their references (timing XLA's
  forms only: interpreted kernels time nothing real), int4 reading fewer bytes than int8
  and int8 fewer than bf16."""
  out = subprocess.run(
      [sys.executable, "-m", "experiments.kernels_gpu", "--interpret", "--contexts", "",
       "--matmuls", "down:256x384", "--repeats", "1"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  figures = json.loads(out.stdout.strip().splitlines()[-1])
  for rows in (1, 5):
    entry = figures["matmuls"][f"down/{rows}"]
    assert entry["max_abs_err_int8"] < 1e-3 and entry["max_abs_err_int4"] < 1e-3
    assert (entry["int4 (XLA)"]["bytes"] < entry["int8 (XLA)"]["bytes"]
            < entry["bf16 (XLA)"]["bytes"])
  assert "| down | 256×384 | 1 | int8 (XLA) |" in out.stdout


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU is present")
def test_refuses_to_time_on_cpu_without_interpret():
  out = subprocess.run([sys.executable, "-m", "experiments.kernels_gpu", "--contexts", "2048"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and "no GPU" in out.stderr
