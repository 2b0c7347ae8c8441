"""The sparse-KV draft (`streaming_kv`, QuantSpec's baseline): it reads only the sink and
recent slots of the cache, and the output stays the target's on every path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from targets import (
  PROMPT,
  ar_tokens,
  assert_exercised,
  assert_skip_draft_keeps_the_target_distribution,
  target,
)

from specjax.decode.engine import speculative_generate
from specjax.decode.generate import positions_for, prefill_prompt
from specjax.drafters import StaticDrafter, StreamingKVDrafter
from specjax.drafters.names import DrafterNameError, parse
from specjax.kv_cache import DraftBuffer, KVCache
from specjax.model import apply
from specjax.plan import DraftPlan, PlanError
from specjax.quant_kv_cache import QuantKVCache

WINDOW = (2, 8)  # far below the 37-token prompt: the draft really loses context


def _draft_logits(arch, cache, plan, token):
  """One draft step's logits (through a draft buffer, as a round drafts) from `cache`."""
  config, graphdef, state = target(arch)
  buffer = DraftBuffer.like(cache, 4)
  tokens = jnp.asarray([[token]], jnp.int32)
  out, _ = apply(state, cache, tokens, positions_for(cache, 1, 1), plan, graphdef=graphdef,
                 buffer=buffer)
  return np.asarray(out.logits[0, -1])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_draft_reads_only_the_sink_and_recent_slots(arch):
  """Noise in every slot between the sinks and the recent window leaves the draft's
  logits as they were; noise in one sink or one recent slot moves them. The full-model
  draft sees all three."""
  config, graphdef, state = target(arch)
  pre = prefill_prompt(graphdef, state, config, PROMPT, max_new_tokens=8)
  cache, n = pre.cache, len(PROMPT)
  sinks, recent = WINDOW
  plan = DraftPlan.full(config.num_layers).replace(kv_window=WINDOW)
  full = DraftPlan.full(config.num_layers)

  def noised(slots):
    noise = lambda a: a.at[:, :, slots].add(
        jax.random.normal(jax.random.key(3), a[:, :, slots].shape, a.dtype))
    return cache.replace(k=tuple(map(noise, cache.k)), v=tuple(map(noise, cache.v)))

  token = PROMPT[-1]
  base = _draft_logits(arch, cache, plan, token)
  middle = np.arange(sinks, n - recent)
  np.testing.assert_array_equal(_draft_logits(arch, noised(middle), plan, token), base)
  for slot in (0, n - 1):  # a sink, the newest verified token
    assert not np.allclose(_draft_logits(arch, noised(np.array([slot])), plan, token), base)
  assert not np.allclose(_draft_logits(arch, noised(middle), full, token),
                         _draft_logits(arch, cache, full, token))


@pytest.mark.parametrize("arch,loop,plan_path", [
    ("llama", "host", "cond"), ("llama", "device", "cond"), ("llama", "host", "dispatch"),
    ("gemma3", "host", "cond")])
def test_streaming_kv_is_lossless(arch, loop, plan_path):
  """Greedy SSD == greedy AR with the draft reading 10 of 37+ slots, alone and over a
  skip plan, on the host loop, the device loop and the dispatched draft (on tiny gemma3
  the window cuts only the global layers: its local ones read 8 slots)."""
  config, graphdef, state = target(arch)
  alone = StreamingKVDrafter(sinks=WINDOW[0], recent=WINDOW[1])
  over = StreamingKVDrafter(StaticDrafter(DraftPlan.from_skips(4, [2], [1])), *WINDOW)
  for drafter in (alone, over):
    out = speculative_generate(graphdef, state, config, PROMPT, drafter, max_new_tokens=48,
                               gamma=4, eos_ids=(), loop=loop, plan_path=plan_path)
    assert out.tokens == ar_tokens(arch)
    if drafter is over or arch == "llama":  # tiny gemma3's local layers see 8 slots anyway
      assert_exercised(out)


def test_streaming_kv_keeps_the_target_distribution():
  """Sampled rounds drafted over a 2 + 6 slot window of the 30-token prompt: committed
  tokens ~ p."""
  assert_skip_draft_keeps_the_target_distribution(lambda state, L, cache: {"kv_window": (2, 6)})


def test_bad_windows_and_compositions_are_refused():
  config, _, _ = target("llama")
  full = DraftPlan.full(4)
  for bad in ((2,), (-1, 8), (2, 0), (2.0, 8)):
    with pytest.raises(PlanError, match="kv_window must be"):
      full.replace(kv_window=bad).check(4)
  with pytest.raises(PlanError, match="reads a full-precision cache as stored"):
    full.replace(kv_window=(2, 8), kv_bits=4).check(4)
  with pytest.raises(PlanError, match="sinks >= 0 and recent >= 1"):
    StreamingKVDrafter(recent=0)
  cache = KVCache.create(config, 1, 64)
  with pytest.raises(PlanError, match="a forward that writes the cache is the target's"):
    cache.view(jnp.zeros((1, 1), jnp.int32), write=True, dense=True, window=(2, 8))
  quant = QuantKVCache.create(config, 1, 256, group=8, residual=16)
  with pytest.raises(PlanError, match="don't compose it with quantspec"):
    quant.view(jnp.zeros((1, 1), jnp.int32), write=False, window=(2, 8))
  with pytest.raises(DrafterNameError, match="quantspec and streaming_kv both set"):
    parse("quantspec+streaming_kv")
  assert parse("self_sd+streaming_kv") == ("self_sd", ["streaming_kv"])
