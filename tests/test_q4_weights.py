"""`4bit` drafts: Q4_0 copies of every matrix (gguf-py's blocks, read by the gguf kernel)
that cover the model at 0.56 bytes a weight, lossless alone, under fixed layer plans and
under a shortlisted head on both decode loops, a sampling round that keeps the target
distribution, and clear errors for weights it cannot use. Over a target in its own blocks:
`test_gguf_matrix.test_tiny_model_in_blocks_decodes_losslessly`."""

from __future__ import annotations

import numpy as np
import pytest
from targets import (
  PROMPT,
  ar_tokens,
  assert_quantised_draft_keeps_the_target_distribution,
  assert_weights_overlay_is_lossless,
  model_of,
)

from specjax import cpu_kernels, quant
from specjax.decode.engine import speculative_generate
from specjax.drafters import FRSpecDrafter, Q4WeightsDrafter, SelfSDDrafter
from specjax.errors import ConfigError
from specjax.gguf_matrix import KINDS, GGUFMatrix
from specjax.plan import PlanError


def test_q4_0_copies_cover_every_matrix():
  model = model_of("qwen2")
  config, L = model.config, model.config.num_layers
  w = quant.quantize_weights_q4_0(model.state, L)
  matrices = [m for lw in w.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [w.head]
  assert w.bits == 4 and len(w.layers) == L
  assert all(isinstance(m, GGUFMatrix) and m.kinds == (KINDS["Q4_0"],) for m in matrices)
  assert w.head.shape == (config.embed_dim, config.vocab_size)
  weights = sum(np.prod(m.shape) for m in matrices)
  assert w.nbytes == weights // 32 * 18  # a half-float scale and 16 bytes per 32 weights
  # Q4_0 puts each weight within 1/8 of its block's largest magnitude (1/16 but where the
  # code clips at 15), off by the half-float rounding of the block's scale: 8 steps of 2⁻¹¹
  bound = 1 / 8 + 8 * 2.0**-11
  for (_, _, dense), q4 in zip(quant.model_matrices(model.state, L), matrices):
    dense = np.asarray(dense)  # [In, Out]
    err = np.abs(np.asarray(q4.dequantize()).T - dense).reshape(-1, 32, dense.shape[1])
    largest = np.abs(dense).reshape(-1, 32, dense.shape[1]).max(axis=1)
    assert np.all(err.max(axis=1) <= bound * largest)


@pytest.mark.parametrize("arch, base", [("llama", "none"), ("qwen2", "static"),
                                        ("gemma3", "early_exit")])
def test_4bit_drafts_are_lossless_on_both_loops(arch, base):
  assert_weights_overlay_is_lossless(Q4WeightsDrafter, arch, base)


@pytest.mark.parametrize("int8_inputs", [False, True])
def test_4bit_is_lossless_with_x_as_floats_and_at_8_bits(int8_inputs):
  """Both ways of reading the copies, whichever this CPU would choose (the 8-bit one runs
  its scalar loop where VNNI is missing): every matrix says which, and the target's tokens
  come out."""
  from specjax.drafters import StaticDrafter
  from specjax.plan import DraftPlan

  model = model_of("qwen2")
  drafter = Q4WeightsDrafter.for_model(
      model, base=StaticDrafter(DraftPlan.from_skips(4, [1], [2])), int8_inputs=int8_inputs)
  w = drafter.weights
  assert all(m.int8_inputs == int8_inputs
             for lw in w.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down, w.head))
  out = speculative_generate(model.graphdef, model.state, model.config, PROMPT, drafter,
                             max_new_tokens=48, gamma=4, threshold=0.0, eos_ids=())
  assert out.tokens == ar_tokens("qwen2")
  default = quant.quantize_weights_q4_0(model.state, model.config.num_layers)
  assert default.head.int8_inputs == cpu_kernels.q4_0_int8_fast()


def test_4bit_under_a_shortlisted_head_scores_its_q4_0_rows():
  """FR-Spec over the Q4_0 copy reads the shortlist's head rows as Q4_0 blocks, not the
  target's, and stays lossless."""
  model = model_of("llama")
  q4 = Q4WeightsDrafter.for_model(model)
  short = np.arange(0, model.config.vocab_size, 2)
  out = speculative_generate(model.graphdef, model.state, model.config, PROMPT,
                             FRSpecDrafter(short, q4), max_new_tokens=48, gamma=4, eos_ids=(),
                             loop="host", record_rounds=True)
  assert out.tokens == ar_tokens("llama")
  plan = out.plans[0]
  assert plan.weight_bits == 4 and plan.vocab is not None
  rows = plan.head_rows
  assert isinstance(rows, GGUFMatrix) and rows.kinds == (KINDS["Q4_0"],)
  assert rows.shape == (model.config.embed_dim, len(short))


def test_4bit_sampling_round_keeps_the_target_distribution():
  assert_quantised_draft_keeps_the_target_distribution(quant.quantize_weights_q4_0)


def test_4bit_refuses_other_weights_and_other_backends(monkeypatch):
  model = model_of("llama")
  int8 = quant.quantize_weights_int8(model.state, model.config.num_layers)
  with pytest.raises(PlanError, match="needs Q4_0 copies"):
    Q4WeightsDrafter(weights=int8)
  monkeypatch.setattr(cpu_kernels.build, "kernel_status", lambda name: "no C++ compiler")
  with pytest.raises(ConfigError, match="gguf_matmul CPU kernel .*no C\\+\\+ compiler"):
    Q4WeightsDrafter.for_model(model)


def test_searches_under_4bit_score_and_price_the_q4_0_copy():
  """`self_sd+4bit` searches with the Q4_0 copy (the same candidates, each costed in the
  bytes it reads: under an int8 copy's), and `knapspec+4bit`'s profile times draft steps
  that read it, labelled by its kind, never as QuantSpec's 4-bit MLP copy."""
  from specjax.offline import self_sd_search
  from specjax.selection import profiler

  model = model_of("qwen2")
  L = model.config.num_layers
  q4 = quant.quantize_weights_q4_0(model.state, L)
  w8 = quant.quantize_weights_int8(model.state, L)
  args = (model.graphdef, model.state, model.config, [PROMPT])
  kw = dict(iterations=4, init_points=4, new_tokens=8, verbose=False, drafter_of=SelfSDDrafter)
  int8, q4_0 = (self_sd_search.search(*args, weights=w, **kw) for w in (w8, q4))
  for a, b in zip(int8.history, q4_0.history):
    assert a["skipped"] == b["skipped"] and b["cost"] < 0.7 * a["cost"]
  prof = profiler.measure(model, lengths=(64,), gamma=2, repeats=2, verbose=False,
                          draft_weights=q4, loop_steps=0)
  assert prof.draft == "q4_0" and prof.draft != profiler.draft_label("int4")
