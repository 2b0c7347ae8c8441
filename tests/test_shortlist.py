"""Vocabulary shortlists for the draft head (FR-Spec, DynaSpec): shortlisted logits are
the full logits restricted to the shortlist, choices map back to vocabulary ids, every
drafter stays lossless, and bad shortlists are clear errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from targets import assert_exercised, target

from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.decode.round import draft_step
from specjax.drafters import ClaspDrafter, EarlyExitDrafter, Int8WeightsDrafter
from specjax.drafters.frspec import FRSpecDrafter
from specjax.kv_cache import DraftBuffer, KVCache
from specjax.model import apply
from specjax.offline.token_counts import (
  CountsMismatchError,
  frequent_shortlist,
  load_counts,
  save_counts,
)
from specjax.plan import DraftPlan, PlanError
from specjax.quant import Int8Matrix, quantize_weights_int8
from specjax.sampling import SamplingParams

PROMPT = list(range(3, 40))
V = 97


@functools.cache
def tiny(arch: str = "llama", layers: int = 4):
  return target(arch, layers, V)


@functools.cache
def ar(arch="llama", n=40):
  config, graphdef, state = tiny(arch)
  return generate(graphdef, state, config, PROMPT, max_new_tokens=n, eos_ids=()).tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_shortlisted_logits_are_the_full_logits_restricted(arch):
  config, graphdef, state = tiny(arch)
  ids = np.asarray([5, 0, 96, 41, 17])
  full = DraftPlan.full(config.num_layers)
  plan = full.with_shortlist(ids, V, size=8)  # 3 padding slots
  tokens = jnp.asarray([PROMPT[:9]], jnp.int32)
  pos = jnp.arange(9)[None]
  cache = KVCache.create(config, 1, 16)
  ref, _ = apply(state, cache, tokens, pos, full, graphdef=graphdef)
  out, _ = apply(state, cache, tokens, pos, plan, graphdef=graphdef)
  assert out.logits.shape == (1, 9, 8)
  np.testing.assert_allclose(np.asarray(out.logits[..., :5]), np.asarray(ref.logits[..., ids]),
                             rtol=1e-5, atol=1e-5)
  assert np.all(np.isneginf(np.asarray(out.logits[..., 5:])))
  # The same logits from rows gathered once ahead (the engine's `with_head_rows`).
  rows = nnx.merge(graphdef, state).shortlist_rows(plan.vocab)
  held, _ = apply(state, cache, tokens, pos, plan.replace(head_rows=rows), graphdef=graphdef)
  np.testing.assert_array_equal(np.asarray(held.logits), np.asarray(out.logits))


def test_shortlisted_8bit_head_is_the_8bit_head_restricted():
  """Under 8-bit draft weights the shortlist reads the 8-bit head's channels (still int8,
  gathered per step or once ahead), not the float head's rows."""
  config, graphdef, state = tiny("qwen2")
  weights = quantize_weights_int8(state, config.num_layers)
  ids = np.asarray([5, 0, 96, 41, 17])
  full = DraftPlan.full(config.num_layers).replace(weights=weights)
  plan = full.with_shortlist(ids, V, size=8)
  rows = nnx.merge(graphdef, state).shortlist_rows(plan.vocab, weights)
  assert isinstance(rows, Int8Matrix) and rows.codes.dtype == jnp.int8
  tokens, pos = jnp.asarray([PROMPT[:9]], jnp.int32), jnp.arange(9)[None]
  buffer = DraftBuffer.like(KVCache.create(config, 1, 16), 9)
  cache = KVCache.create(config, 1, 16)
  ref, _ = apply(state, cache, tokens, pos, full, graphdef=graphdef, buffer=buffer)
  for p in (plan, plan.replace(head_rows=rows)):
    out, _ = apply(state, cache, tokens, pos, p, graphdef=graphdef, buffer=buffer)
    np.testing.assert_allclose(np.asarray(out.logits[..., :5]),
                               np.asarray(ref.logits[..., ids]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_frspec_is_lossless_and_drafts_only_shortlisted_ids(arch):
  config, graphdef, state = tiny(arch)
  # The target's greedy tokens but its most frequent one, plus others: some drafts match.
  toks = ar(arch)
  common = max(set(toks) - {2}, key=toks.count)  # EOS (2) must stay in any shortlist
  shortlist = np.asarray(sorted((set(toks) | {1, 2}) - {common}))
  out = speculative_generate(graphdef, state, config, PROMPT, FRSpecDrafter(shortlist),
                             max_new_tokens=40, gamma=4, eos_ids=(), record_rounds=True,
                             threshold=0.0)
  assert out.tokens == toks
  assert_exercised(out, deep=True)  # the missing token is never drafted: some drafts are rejected
  # The draft step itself proposes shortlisted ids only.
  cache = KVCache.create(config, 1, 64)
  plan = out.plans[0]
  draft = draft_step(state, cache.with_length(0), jnp.int32(7), plan, jax.random.key(0),
                     jnp.int32(4), graphdef=graphdef, vocab=V, gamma=4, threshold=0.0,
                     sampling=SamplingParams())
  assert set(np.asarray(draft.tokens).tolist()) <= set(shortlist.tolist())
  # The engine gathered the shortlist's head rows once, for the whole generation.
  assert plan.head_rows is not None and plan.head_rows.shape == (shortlist.size, config.embed_dim)


def test_frspec_on_a_layer_drafter_is_lossless():
  config, graphdef, state = tiny()
  shortlist = np.arange(0, V, 2)
  int8 = Int8WeightsDrafter(quantize_weights_int8(state, config.num_layers), EarlyExitDrafter(k=3))
  for base in (EarlyExitDrafter(k=2), ClaspDrafter(skip=1, interval=3), int8):
    out = speculative_generate(graphdef, state, config, PROMPT, FRSpecDrafter(shortlist, base),
                               max_new_tokens=40, gamma=4, eos_ids=(), threshold=0.0,
                               record_rounds=True)
    assert out.tokens == ar()
    assert_exercised(out, deep=True)
    # CLaSp changes its layers every round (host loop); the rows are gathered once.
    assert all(p.head_rows is out.plans[0].head_rows for p in out.plans)
    assert isinstance(out.plans[0].head_rows, Int8Matrix) == (base is int8)


def count_head_row_gathers(monkeypatch, name: str = "shortlist_rows") -> list:
  """The session's calls of its jitted `name` (a head-row gather), as they happen (its
  `compiled`, wrapped); none held from an earlier test."""
  from specjax.decode import session

  gathers = []
  real = session.compiled

  def counting(fn, *args, **kw):
    if fn is getattr(session, name):
      gathers.append(name)
    return real(fn, *args, **kw)

  monkeypatch.setattr(session, "compiled", counting)
  monkeypatch.setattr(session, "_HEAD_ROWS", [])
  return gathers


def test_frspec_gathers_its_head_rows_once_across_generations(monkeypatch):
  """One drafter over several prompts (a bench run) gathers its shortlist's head rows
  once: they cost 30-35 ms a prompt on SmolLM2 on the CPU. Another model, or that model's
  state dropped, gathers again; the tokens stay AR's."""
  from specjax.decode import session

  gathers = count_head_row_gathers(monkeypatch)
  config, graphdef, state = tiny()
  drafter = FRSpecDrafter(np.arange(0, V, 2))
  run = lambda st, prompt: speculative_generate(graphdef, st, config, prompt, drafter,
                                                max_new_tokens=12, gamma=4, eos_ids=())
  first, second = run(state, PROMPT), run(state, PROMPT[5:])
  assert len(gathers) == 1
  assert first.tokens == ar(n=12)
  assert second.tokens == generate(graphdef, state, config, PROMPT[5:], max_new_tokens=12,
                                   eos_ids=()).tokens
  copy = jax.tree.map(lambda x: x, state)  # the same weights, another state object
  assert run(copy, PROMPT).tokens == first.tokens and len(gathers) == 2
  del copy
  assert not session._HEAD_ROWS  # dropped with the state it was gathered from


def test_shortlist_drafters_taking_turns_gather_their_head_rows_once_each(monkeypatch):
  """A bench run alternates drafters prompt by prompt: `frspec` (float32 rows) and
  `8bit+frspec` (int8 rows) keep both sets, where holding one re-gathered at every turn."""
  gathers = count_head_row_gathers(monkeypatch)
  config, graphdef, state = tiny()
  short = np.arange(0, V, 2)
  int8 = quantize_weights_int8(state, config.num_layers)
  drafters = [FRSpecDrafter(short), FRSpecDrafter(short, Int8WeightsDrafter(weights=int8))]
  want = ar(n=8)
  for _ in range(2):
    for d in drafters:
      out = speculative_generate(graphdef, state, config, PROMPT, d, max_new_tokens=8,
                                 gamma=4, eos_ids=())
      assert out.tokens == want
  assert len(gathers) == 2


# Sampling with a shortlist (q scattered onto vocabulary ids) is tested for distribution,
# with asserted power, in test_engine.test_sampling_round_keeps_the_target_distribution.


def test_frequent_shortlist_and_counts_round_trip(tmp_path):
  counts = np.asarray([5, 0, 9, 9, 1, 7])
  np.testing.assert_array_equal(frequent_shortlist(counts, 3), [2, 3, 5])
  np.testing.assert_array_equal(frequent_shortlist(counts, 3, eos_ids=[1]), [1, 2, 3])
  save_counts(tmp_path / "c.npz", counts, model="m", prompts=3)
  np.testing.assert_array_equal(load_counts(tmp_path / "c.npz", model="m"), counts)
  with pytest.raises(CountsMismatchError, match="of m, not other"):
    load_counts(tmp_path / "c.npz", model="other")
  with pytest.raises(ValueError, match="shortlist size"):
    frequent_shortlist(counts, 7)


def test_bad_shortlists_are_clear_errors():
  full = DraftPlan.full(4)
  with pytest.raises(PlanError, match="missing EOS id"):
    full.with_shortlist([3, 4, 5], V, eos_ids=[2])
  with pytest.raises(PlanError, match=r"in \[0, 97\)"):
    full.with_shortlist([3, 97], V)
  with pytest.raises(PlanError, match="distinct"):
    full.with_shortlist([3, 3], V)
  with pytest.raises(PlanError, match="does not fit"):
    full.with_shortlist([1, 2, 3], V, size=2)
  rows = jnp.zeros((3, 8))
  with pytest.raises(PlanError, match="3 rows for a shortlist of None"):
    full.replace(head_rows=rows).check(4)
  with pytest.raises(PlanError, match="3 rows for a shortlist of 4 ids"):
    full.with_shortlist([1, 2, 3], V, size=4).replace(head_rows=rows).check(4)
  # A new shortlist drops the rows gathered for the old one.
  assert full.with_shortlist([1, 2, 3], V).replace(head_rows=rows).with_shortlist(
      [4, 5, 6], V).head_rows is None
  config, graphdef, state = tiny()
  with pytest.raises(PlanError, match="missing EOS"):
    speculative_generate(graphdef, state, config, PROMPT,
                         FRSpecDrafter(np.asarray([5, 6])), max_new_tokens=8)
