"""experiments/bench_forward.py: the weight bytes a step reads (each step's floor) add up
as the plan says, and the step costs come back with them (a tiny model)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import bench_forward
from specjax.models.loader import load_model  # noqa: E402
from specjax.plan import DraftPlan  # noqa: E402
from specjax.quant import model_matrices, quantize_weights_int8  # noqa: E402


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gemma3"])
def model(request):
  return load_model(request.param)


def _matrix_bytes(m) -> dict:
  return {(l, name): w.nbytes for l, name, w in model_matrices(m.state, m.config.num_layers)}


def _head_bytes(m) -> int:
  cfg = m.config
  return m.state["embedding" if cfg.tie_embeddings else "lm_head"][...].nbytes


def test_read_bytes_counts_the_active_sub_layers_and_the_head(model):
  L = model.config.num_layers
  mats = _matrix_bytes(model)
  full = DraftPlan.full(L)
  assert bench_forward.read_bytes(model, full) == sum(mats.values()) + _head_bytes(model)
  none = DraftPlan.from_bits(np.zeros(2 * L, bool))
  assert bench_forward.read_bytes(model, none) == _head_bytes(model)
  attn0 = np.zeros(2 * L, bool)
  attn0[0] = True  # layer 0's attention alone
  assert bench_forward.read_bytes(model, DraftPlan.from_bits(attn0)) == (
      mats[0, "qkv"] + mats[0, "o"] + _head_bytes(model))


def test_read_bytes_of_8_bit_weights_and_of_a_shortlist(model):
  L, cfg = model.config.num_layers, model.config
  full = DraftPlan.full(L)
  int8 = full.replace(weights=quantize_weights_int8(model.state, L))
  dense = bench_forward.read_bytes(model, full)
  assert bench_forward.read_bytes(model, int8) == int8.weights.nbytes
  assert 0.25 < int8.weights.nbytes / dense < 0.3  # a byte a weight, and a scale a channel
  size = cfg.vocab_size // 4
  short = bench_forward.with_shortlist_head(model, full, size, np.random.default_rng(0))
  assert short.vocab.shape == (size,) and short.head_rows.shape == (size, cfg.embed_dim)
  assert bench_forward.read_bytes(model, short) == (
      dense - _head_bytes(model) + size * cfg.embed_dim * 4)


def test_step_ratios_time_every_step_beside_its_floor(model):
  r = bench_forward.step_ratios(model, context=16, rounds=1, steps=1,
                                shortlist=model.config.vocab_size // 4)
  assert r["ar_ms"] > 0 and r["verify_over_ar"] > 0 and r["shortlist_draft_over_ar"] > 0
  floor = r["floor"]
  assert floor[1.0] == pytest.approx(1.0)
  assert [floor[f] for f in bench_forward.FRACTIONS] == sorted(
      floor[f] for f in bench_forward.FRACTIONS)
  assert floor[(1.0, 8)] < 0.3 and floor[(0.5, "shortlist")] < floor[0.5]
  assert floor[(1.0, 8)] < floor[(1.0, 4)] < 1.0 and r["int4_mlp_draft_over_ar"] > 0
  assert 0 < r["head_share"] < floor[0.25]


class _Clock:
  """A stand-in for `time` whose clock moves only when the fake engine works."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self) -> float:
    return self.now


def test_llama_cpp_baseline_uses_every_core_and_times_its_prefill_apart(monkeypatch):
  """The llama.cpp row: all cores (the binding's default is half), each run from an empty
  KV cache, a warm-up dropped, decode-only rate from the first token's arrival."""
  import types

  from specjax.bench import llama_cpp

  clock, made = _Clock(), {"resets": 0}

  class Llama:
    def __init__(self, **kw):
      made.update(kw)

    def reset(self):
      made["resets"] += 1

    def generate(self, ids, temp):
      assert temp == 0.0 and ids == [5, 6, 7]
      clock.now += 0.5  # the prompt, then the first token
      for i in range(1000):
        yield 10 + i
        clock.now += 0.1  # each further token

  monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
  monkeypatch.setattr(llama_cpp, "time", clock)
  monkeypatch.setattr(llama_cpp, "gguf_file", lambda name: Path("m.gguf"))
  r = bench_forward.llama_cpp_ar("smollm2-135m-instruct", [5, 6, 7], tokens=11, runs=3)
  assert made["n_threads"] == made["n_threads_batch"] == r["threads"] == (os.cpu_count() or 1)
  assert made["resets"] == 4  # the warm-up and three timed runs
  assert r["tokens"] == list(range(10, 21))
  assert r["end_to_end_tok_s"] == pytest.approx(11 / 1.5)
  assert r["decode_tok_s"] == pytest.approx(10 / 1.0)


def test_llama_cpp_baseline_is_skipped_when_the_binding_is_absent(monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
  assert bench_forward.llama_cpp_ar("smollm2-135m-instruct", [1], tokens=4, runs=1) is None
  assert "pip install llama-cpp-python" in capsys.readouterr().out


def test_shared_prefix():
  from specjax.bench.llama_cpp import shared_prefix

  assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2
  assert shared_prefix([1, 2], [1, 2, 3]) == 2
  assert shared_prefix([], [1]) == 0


def test_read_bytes_of_a_gguf_target_are_its_blocks():
  """Under `--dtype gguf` a step reads the file's blocks (a tiny model's: Q8_0, 34 bytes a
  32 weights), not the float32 matrices they stand for."""
  from specjax import cpu_kernels

  if cpu_kernels.kernel_status("gguf_matmul") != "ready":
    pytest.skip("the gguf_matmul kernel does not build here")
  m = load_model("tiny-llama", dtype="gguf")
  dense = load_model("tiny-llama")
  full = DraftPlan.full(m.config.num_layers)
  blocks = sum(x.nbytes for x in jax.tree.leaves(m.state["blocks"]) if x.dtype == np.uint8)
  assert bench_forward.read_bytes(m, full) == blocks + sum(
      x.nbytes for x in jax.tree.leaves(m.state["embedding"]))
  assert bench_forward.read_bytes(m, full) / bench_forward.read_bytes(dense, full) == (
      pytest.approx(34 / 128, rel=0.01))
  assert bench_forward.section_name("smollm2-135m-instruct", "gguf") == (
      "forward-smollm2-135m-instruct-gguf")
