"""A plan held on the host (`plan_path="dispatch"`): the draft calls one program per
sub-layer the plan runs, with no conditional. It drafts exactly what the traced path
(`lax.cond` per sub-layer) drafts, for every drafter whose plan changes at decode time
and under each overlay's plan fields, greedy and sampled; a new plan value compiles
nothing; bad settings are refused."""

from __future__ import annotations

import types

import jax
import pytest
from targets import PROMPT, ar_tokens, assert_exercised, target
from test_knapspec import synthetic_profile

from specjax import ops
from specjax.decode.dispatched_draft import DispatchedDraft, one_layer
from specjax.decode.engine import speculative_generate
from specjax.drafters import (
  ClaspDrafter,
  DynaSpecDrafter,
  Int8WeightsDrafter,
  KnapSpecDrafter,
  QuantSpecDrafter,
  StaticDrafter,
  SwiftDrafter,
)
from specjax.errors import ConfigError
from specjax.kv_cache import KVCache
from specjax.plan import DraftPlan
from specjax.quant_kv_cache import QuantKV
from specjax.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.8)


def _model(arch):
  config, graphdef, state = target(arch)
  return types.SimpleNamespace(graphdef=graphdef, state=state, config=config)


def _dynaspec(arch):
  from test_dynaspec import bundle

  return DynaSpecDrafter(bundle(arch)[0], ClaspDrafter(skip=2, interval=1))


ADAPTIVE = {
    "clasp": lambda arch: ClaspDrafter(skip=2, interval=1),
    "knapspec": lambda arch: KnapSpecDrafter(profile=synthetic_profile(), selection_budget=None),
    "swift": lambda arch: SwiftDrafter(trials=12, bo_every=4, window=16, max_score=2.0),
    # the overlays' plan fields: draft weights, a quantised cache read at 4 bits, a router
    "knapspec+8bit": lambda arch: Int8WeightsDrafter.for_model(
        _model(arch), base=KnapSpecDrafter(profile=synthetic_profile(), selection_budget=None)),
    "clasp+quantspec": lambda arch: QuantSpecDrafter.for_model(
        _model(arch), base=ClaspDrafter(skip=2, interval=1), weight_group=32,
        kv_cache=QuantKV(group=8, residual=16)),
    "clasp+dynaspec": _dynaspec,
}


def _both(arch, drafter, sampling=SamplingParams(), **kw):
  config, graphdef, state = target(arch)
  run = lambda path: speculative_generate(
      graphdef, state, config, PROMPT, drafter, max_new_tokens=40, eos_ids=(), gamma=4,
      sampling=sampling, loop="host", plan_path=path, record_rounds=True, **kw)
  return run("cond"), run("dispatch")


def _assert_same_rounds(cond, dispatch):
  assert dispatch.tokens == cond.tokens
  assert dispatch.round_drafted == cond.round_drafted
  assert dispatch.round_accepted == cond.round_accepted
  assert [p.to_bits().tolist() for p in dispatch.plans] == [p.to_bits().tolist()
                                                          for p in cond.plans]


@pytest.mark.parametrize("name", sorted(ADAPTIVE))
def test_a_dispatched_plan_drafts_what_the_traced_plan_drafts(name):
  """Token for token, round for round: the same drafts, the same acceptances, the same
  plans chosen from them; greedy equals AR (QuantSpec's AR reads its 8-bit cache)."""
  arch = "gemma3" if name == "clasp" else "qwen2" if name == "clasp+dynaspec" else "llama"
  cond, dispatch = _both(arch, ADAPTIVE[name](arch), threshold=0.5)
  _assert_same_rounds(cond, dispatch)
  assert len({tuple(p.to_bits().tolist()) for p in dispatch.plans}) >= 2  # plans changed
  assert_exercised(dispatch)
  if "quantspec" not in name:
    assert dispatch.tokens == ar_tokens(arch)[:40]


@pytest.mark.parametrize("name", ["knapspec", "clasp+quantspec"])
def test_a_dispatched_plan_samples_what_the_traced_plan_samples(name):
  """The same key splits per draft step: sampled rounds agree token for token."""
  cond, dispatch = _both("llama", ADAPTIVE[name]("llama"), sampling=SAMPLED, threshold=0.0)
  _assert_same_rounds(cond, dispatch)


def test_a_new_plan_compiles_nothing():
  """The sub-layer programs are the plan's for every plan: after one generation, plans
  of other values and another number of sub-layers compile no program."""
  config, graphdef, state = target("qwen3")
  run = lambda bits: speculative_generate(
      graphdef, state, config, PROMPT, StaticDrafter(DraftPlan.from_bits(bits)),
      max_new_tokens=24, eos_ids=(), gamma=4, plan_path="dispatch")
  first = run([1, 1, 0, 1, 1, 0, 1, 1])
  assert first.loop == "host" and first.tokens == ar_tokens("qwen3")[:24]
  for bits in ([1, 0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 1, 1, 0, 1]):
    again = run(bits)
    assert again.compiles == 0, bits
    assert again.tokens == first.tokens


def test_a_skipped_sub_layer_is_never_called(monkeypatch):
  """Dispatch calls the attention program once per step for each attention sub-layer the
  plan runs, and the MLP program for each MLP: a skipped sub-layer costs nothing."""
  config, graphdef, state = target("llama")
  calls = []
  real = DispatchedDraft._program

  def counting(self, fn, *args, **static):
    calls.append(fn.__name__)
    return real(self, fn, *args, **static)

  monkeypatch.setattr(DispatchedDraft, "_program", counting)
  plan = DraftPlan.from_masks([True, False, True, True], [True, True, False, False])
  draft = DispatchedDraft(graphdef, state, config.vocab_size, 3, 0.0, SamplingParams())
  cache = KVCache.create(config, 1, 64)
  out = draft(state, cache, jax.numpy.int32(5), plan, jax.random.key(0))
  assert int(out.n) == 3
  assert calls.count("_attention") == 3 * 3 and calls.count("_mlp") == 3 * 2
  assert calls.count("_embed") == calls.count("_choose_token") == 3


def test_one_layer_cuts_every_per_layer_field():
  config, _, _ = target("llama")
  cache = QuantKV(group=8, residual=16).create(config, 1, 64)
  cut = one_layer(cache, 2)
  assert len(cut.k_codes) == len(cut.buf_k) == len(cut.buf_v) == 1
  assert cut.buf_k[0] is cache.buf_k[2] and cut.quantized is cache.quantized


def test_bad_plan_paths_are_refused(monkeypatch):
  config, graphdef, state = target("llama")
  gen = lambda **kw: speculative_generate(graphdef, state, config, PROMPT,
                                          ClaspDrafter(skip=2), max_new_tokens=8, **kw)
  with pytest.raises(ConfigError, match=r"plan_path \(or SPECJAX_PLAN_PATH\) must be one "
                     r"of cond, dispatch, got 'scan'"):
    gen(plan_path="scan")
  with pytest.raises(ConfigError, match="loop='host'"):
    gen(plan_path="dispatch", loop="device")
  assert ops.plan_path() == "cond"  # a CPU's conditionals skip in place
  monkeypatch.setenv("SPECJAX_PLAN_PATH", "dispatch")  # a whole process's runs
  assert gen().loop == "host"
  monkeypatch.setenv("SPECJAX_PLAN_PATH", "scan")
  with pytest.raises(ConfigError, match="got 'scan'"):
    gen()
