"""Vocabulary shortlists for the draft head (FR-Spec, DynaSpec): shortlisted logits are
the full logits restricted to the shortlist, choices map back to vocabulary ids, every
drafter stays lossless, and bad shortlists are clear errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from targets import assert_exercised, target

from specjax.decode.engine import draft_step, speculative_generate
from specjax.decode.generate import generate
from specjax.drafters import ClaspDrafter, EarlyExitDrafter
from specjax.drafters.frspec import FRSpecDrafter
from specjax.kv_cache import KVCache
from specjax.model import apply
from specjax.offline.token_counts import (
  CountsMismatchError,
  frequent_shortlist,
  load_counts,
  save_counts,
)
from specjax.plan import DraftPlan, PlanError
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


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_frspec_is_lossless_and_drafts_only_shortlisted_ids(arch):
  config, graphdef, state = tiny(arch)
  # The target's greedy tokens but its most frequent one, plus others: some drafts match.
  toks = ar(arch)
  common = max(set(toks) - {2}, key=toks.count)  # EOS (2) must stay in any shortlist
  shortlist = np.asarray(sorted((set(toks) | {1, 2}) - {common}))
  out = speculative_generate(graphdef, state, config, PROMPT, FRSpecDrafter(shortlist),
                             max_new_tokens=40, gamma=4, eos_ids=(), keep_plans=True,
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


def test_frspec_on_a_layer_drafter_is_lossless():
  config, graphdef, state = tiny()
  shortlist = np.arange(0, V, 2)
  for base in (EarlyExitDrafter(k=2), ClaspDrafter(skip=1, interval=3)):
    out = speculative_generate(graphdef, state, config, PROMPT, FRSpecDrafter(shortlist, base),
                               max_new_tokens=40, gamma=4, eos_ids=(), threshold=0.0)
    assert out.tokens == ar()
    assert_exercised(out, deep=True)


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
  config, graphdef, state = tiny()
  with pytest.raises(PlanError, match="missing EOS"):
    speculative_generate(graphdef, state, config, PROMPT,
                         FRSpecDrafter(np.asarray([5, 6])), max_new_tokens=8)
