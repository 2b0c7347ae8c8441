"""The SnapKV-style sparse draft (`snapkv`, QuantSpec's second sparse-KV baseline): it
selects what SnapKV's public code selects, reads only those slots and the recent ones, and
the output stays the target's on every path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from targets import (
  PROMPT,
  SAMPLED_PROMPT,
  ar_tokens,
  assert_exercised,
  assert_skip_draft_keeps_the_target_distribution,
  target,
)

from specjax.decode.engine import speculative_generate
from specjax.decode.generate import positions_for, prefill_prompt
from specjax.drafters import SnapKVDrafter, StaticDrafter
from specjax.drafters.names import DrafterNameError, parse
from specjax.drafters.snapkv import pooled_scores, select, top_slots
from specjax.kv_cache import DraftBuffer, KVCache
from specjax.model import apply, rotation
from specjax.plan import DraftPlan, PlanError
from specjax.quant_kv_cache import QuantKVCache

KEEP, RECENT, WINDOW = 6, 10, 8  # of the 37-token prompt, the draft reads 16 slots


def _reference_scores(q, k, q_pos, end, scale, kernel, window=None):
  """SnapKV's scoring as its public code writes it, head by head in numpy: softmax of each
  window query over the keys it may see, summed over the queries, the prefix [0, end)
  kept, averaged over the query heads that share a kv head, then `avg_pool1d` (zero
  padding counted) over the prefix alone."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, W, N, H = q.shape
  K, S = k.shape[1], k.shape[2]
  out = np.zeros((B, K, end))
  for b in range(B):
    for n in range(N):
      kv = n // (N // K)
      s = q[b, :, n] @ k[b, kv].T * scale  # [W, S]
      seen = np.arange(S)[None] <= np.asarray(q_pos)[b][:, None]
      if window is not None:
        seen &= np.asarray(q_pos)[b][:, None] - np.arange(S)[None] < window
      s = np.where(seen, s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      out[b, kv] += p.sum(0)[:end] / (N // K)
  pad = kernel // 2
  padded = np.pad(out, ((0, 0), (0, 0), (pad, pad)))
  return np.stack([padded[..., i:i + kernel].mean(-1) for i in range(end)], -1)


@pytest.mark.parametrize("window", [None, 6])
def test_scores_and_choice_are_snapkvs(window):
  """`pooled_scores` and `top_slots` against the public code's steps, written out head by
  head, with grouped queries (4 query heads over 2 kv heads) and a sliding window."""
  B, W, N, K, S, H = 2, 5, 4, 2, 40, 8
  kq, kk = jax.random.split(jax.random.key(0))
  q = jax.random.normal(kq, (B, W, N, H))
  k = jax.random.normal(kk, (B, K, S, H))
  length = 30  # the cache holds 30 tokens; the window is its last 5
  q_pos = jnp.broadcast_to(length - W + jnp.arange(W), (B, W)).astype(jnp.int32)
  got = pooled_scores(q, k, q_pos, jnp.int32(length - W), scale=H**-0.5, kernel=5,
                      window=window)
  want = _reference_scores(q, k, q_pos, length - W, H**-0.5, 5, window)
  np.testing.assert_allclose(np.asarray(got)[..., :length - W], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got)[..., length - W + 2:], 0.0)
  for limit, keep in ((20, 6), (4, 6)):  # enough slots, and fewer than the budget
    idx, valid = top_slots(got, jnp.int32(limit), keep)
    n = min(limit, keep)
    np.testing.assert_array_equal(np.asarray(valid), np.tile(np.arange(keep) < n, (B, 1)))
    for b in range(B):
      for h in range(K):
        best = np.sort(np.argsort(-want[b, h, :limit], kind="stable")[:n])
        np.testing.assert_array_equal(np.asarray(idx)[b, h, :n], best)


def test_select_keeps_the_rows_of_the_slots_the_prefill_window_attended_to():
  """`select` recomputes the window's queries from the cache; the same queries taken
  from a whole-prompt forward, scored by the reference, name the rows it keeps."""
  config, graphdef, state = target("llama")
  pre = prefill_prompt(graphdef, state, config, PROMPT, max_new_tokens=8)
  cache, n = pre.cache, len(PROMPT)
  kept = select(state, cache, jnp.asarray([PROMPT[-WINDOW:]], jnp.int32), graphdef=graphdef,
                keep=KEEP, recent=RECENT, kernel=5)
  empty = KVCache.create(config, 1, cache.size)
  pos = jnp.arange(n, dtype=jnp.int32)[None]
  out, _ = apply(state, empty, jnp.asarray([PROMPT], jnp.int32), pos,
                 DraftPlan.full(config.num_layers), graphdef=graphdef, logits="none",
                 return_residuals=True)
  model = nnx.merge(graphdef, state)
  q_pos = pos[:, -WINDOW:]
  np.testing.assert_array_equal(np.asarray(kept.valid), np.ones((1, KEEP), bool))
  for l, block in enumerate(model.blocks):
    x = model.embed(jnp.asarray([PROMPT], jnp.int32)) if l == 0 else out.residuals[2 * l - 1]
    rot = rotation(q_pos, block.attn.rope_base, config.head_dim, block.attn.rope_scaling)
    q = block.attn.project(block.attn_norm(x[:, -WINDOW:]), rot)[0]
    want = _reference_scores(q, cache.k[l], q_pos, n - WINDOW, config.scale, 5)
    for h in range(config.num_kv_heads):
      best = np.sort(np.argsort(-want[0, h, :n - RECENT], kind="stable")[:KEEP])
      for got, layer in ((kept.k[l], cache.k[l]), (kept.v[l], cache.v[l])):
        np.testing.assert_array_equal(np.asarray(got[0, h]), np.asarray(layer[0, h, best]))


def test_the_draft_reads_only_its_kept_and_recent_slots():
  """Noise in every cache slot before the recent window leaves the draft's logits as they
  were (the kept rows are a copy); noise in the newest slot, or in one kept row, moves them."""
  config, graphdef, state = target("llama")
  pre = prefill_prompt(graphdef, state, config, PROMPT, max_new_tokens=8)
  cache, n = pre.cache, len(PROMPT)
  kept = select(state, cache, jnp.asarray([PROMPT[-WINDOW:]], jnp.int32), graphdef=graphdef,
                keep=KEEP, recent=RECENT, kernel=5)
  plan = DraftPlan.full(config.num_layers).replace(kv_window=(0, RECENT), kv_keep=kept)
  plan.check(config.num_layers)
  noise = lambda a, slots: a.at[:, :, slots].add(
      jax.random.normal(jax.random.key(3), a[:, :, slots].shape, a.dtype))

  def logits(cache, plan):
    out, _ = apply(state, cache, jnp.asarray([[PROMPT[-1]]], jnp.int32),
                   positions_for(cache, 1, 1), plan, graphdef=graphdef,
                   buffer=DraftBuffer.like(cache, 4))
    return np.asarray(out.logits[0, -1])

  noised = lambda slots: cache.replace(k=tuple(noise(a, slots) for a in cache.k),
                                       v=tuple(noise(a, slots) for a in cache.v))
  base = logits(cache, plan)
  np.testing.assert_array_equal(logits(noised(np.arange(n - RECENT)), plan), base)
  assert not np.allclose(logits(noised(np.array([n - 1])), plan), base)
  row = kept.replace(k=tuple(noise(a, np.array([0])) for a in kept.k))
  assert not np.allclose(logits(cache, plan.replace(kv_keep=row)), base)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_snapkv_is_lossless_and_drafts_alike_on_every_path(arch):
  """Greedy SSD == greedy AR with the draft reading 16 of 37+ slots, alone and over a
  skip plan, on the host loop, the device loop and the dispatched draft; every path drafts
  from the same slots, so their rounds accept alike (a path that read other slots, or
  none of the kept ones, would accept differently)."""
  config, graphdef, state = target(arch)
  knobs = dict(keep=KEEP, recent=RECENT, window=WINDOW)
  alone = SnapKVDrafter(**knobs)
  over = SnapKVDrafter(StaticDrafter(DraftPlan.from_skips(4, [1], [2])), **knobs)
  paths = [("host", "cond"), ("device", "cond"), ("host", "dispatch")]
  for drafter in (alone, over):
    accepted = set()
    for loop, plan_path in paths if arch == "llama" else paths[:1]:
      out = speculative_generate(graphdef, state, config, PROMPT, drafter, max_new_tokens=48,
                                 gamma=4, eos_ids=(), loop=loop, plan_path=plan_path)
      assert out.tokens == ar_tokens(arch)
      accepted.add(tuple(out.round_accepted))
      if drafter is over or arch == "llama":  # tiny gemma3's local layers see 8 slots anyway
        assert_exercised(out)
    assert len(accepted) == 1, accepted


def test_snapkv_keeps_the_target_distribution():
  """Sampled rounds drafted over 4 selected + 8 recent slots of the 30-token prompt:
  committed tokens ~ p."""
  def fields(state, L, cache):
    _, graphdef, _ = target("llama", 4, 12)
    window = jnp.asarray([SAMPLED_PROMPT[-8:]], jnp.int32)
    kept = select(state, cache, window, graphdef=graphdef, keep=4, recent=8, kernel=5)
    return {"kv_window": (0, 8), "kv_keep": kept}

  assert_skip_draft_keeps_the_target_distribution(fields)


def test_bad_settings_and_compositions_are_refused():
  config, graphdef, state = target("llama")
  full = DraftPlan.full(4)
  pre = prefill_prompt(graphdef, state, config, PROMPT, max_new_tokens=8)
  kept = select(state, pre.cache, jnp.asarray([PROMPT[-WINDOW:]], jnp.int32),
                graphdef=graphdef, keep=KEEP, recent=RECENT, kernel=5)
  with pytest.raises(PlanError, match="set kv_window=\\(0, recent\\)"):
    full.replace(kv_keep=kept).check(4)
  with pytest.raises(PlanError, match="set kv_window=\\(0, recent\\)"):
    full.replace(kv_keep=kept, kv_window=(2, 8)).check(4)
  with pytest.raises(PlanError, match="selected on another model"):
    DraftPlan.full(6).replace(kv_keep=kept, kv_window=(0, 8)).check(6)
  for bad in (dict(keep=0), dict(recent=4, window=8), dict(kernel=4)):
    with pytest.raises(PlanError, match="snapkv"):
      SnapKVDrafter(**bad)
  cache = KVCache.create(config, 1, 64)
  with pytest.raises(PlanError, match="a forward that writes the cache is the target's"):
    cache.view(jnp.zeros((1, 1), jnp.int32), write=True, dense=True, kept=kept)
  quant = QuantKVCache.create(config, 1, 256, group=8, residual=16)
  with pytest.raises(PlanError, match="don't compose it with quantspec"):
    quant.view(jnp.zeros((1, 1), jnp.int32), write=False, kept=kept)
  for name in ("quantspec+snapkv", "streaming_kv+snapkv"):
    with pytest.raises(DrafterNameError, match="both set"):
      parse(name)
  assert parse("knapspec+snapkv") == ("knapspec", ["snapkv"])
