"""Chunked prefill: a long prompt processed a chunk at a time leaves the same cache, first
token and hidden states as one call over the whole prompt (full-precision and quantised
caches), and a padded prompt never flushes padding into quantised codes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax.decode import generate as gen
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import Prefill, check_prompt, generate
from specjax.drafters import EarlyExitDrafter
from specjax.plan import DraftPlan
from specjax.quant_kv_cache import QuantKV, create_cache
from specjax.sampling import SamplingParams

SMALL_KV = QuantKV(group=16, residual=16)  # R smaller than the 64-token prompt bucket


def _prompt(config, n: int, seed: int = 0) -> list[int]:
  return np.random.default_rng(seed).integers(1, config.vocab_size, n).tolist()


def _prefill(tiny, ids, chunk, kv=None):
  config, graphdef, state = tiny
  cache = create_cache(config, check_prompt(ids, 8, config.max_context), kv)
  plan, key = DraftPlan.full(config.num_layers), jax.random.key(0)
  p = Prefill.build(state, cache, ids, plan, key, graphdef=graphdef, sampling=SamplingParams(),
                    return_pooled=True, chunk=chunk)
  return len(p.calls), p(state, cache, plan, key)


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_one_call(tiny):
  ids = _prompt(tiny[0], 150)
  calls, (tok, cache, pooled, hidden) = _prefill(tiny, ids, chunk=64)
  one, (tok1, cache1, pooled1, hidden1) = _prefill(tiny, ids, chunk=None)
  assert (calls, one) == (3, 1)
  assert int(tok[0]) == int(tok1[0]) and int(cache.length) == int(cache1.length) == 150
  for a, b in zip(cache.k + cache.v, cache1.k + cache1.v):
    _close(a[:, :, :150], b[:, :, :150])
  _close(pooled, pooled1)
  _close(hidden, hidden1)  # the final hidden state that gave `tok`


def test_chunked_prefill_on_the_quantised_cache(tiny):
  ids = _prompt(tiny[0], 150, seed=1)
  _, (tok, cache, pooled, _) = _prefill(tiny, ids, chunk=64, kv=SMALL_KV)
  _, (tok1, cache1, pooled1, _) = _prefill(tiny, ids, chunk=None, kv=SMALL_KV)
  assert int(tok[0]) == int(tok1[0])
  assert (int(cache.quantized), int(cache.buffered)) == (int(cache1.quantized),
                                                          int(cache1.buffered))
  # Later chunks read earlier ones at 8 bits (as decoding does), one call reads them in
  # full precision: the two differ by 8-bit error carried through the layers, no more.
  d, d1 = cache.dense(8), cache1.dense(8)
  for a, b in zip(d.k + d.v, d1.k + d1.v):
    a, b = np.asarray(a[:, :, :150]), np.asarray(b[:, :, :150])
    np.testing.assert_allclose(a, b, atol=0.02 * np.abs(b).max())
  np.testing.assert_allclose(np.asarray(pooled), np.asarray(pooled1),
                             atol=0.02 * np.abs(pooled1).max())


@pytest.mark.parametrize("n", [70, 100, 130])
def test_padding_is_never_quantised(tiny, n):
  """70 real tokens pad to 128: flushing by the padded length would quantise 96 slots,
  26 of them padding, and leave the buffered count negative."""
  config = tiny[0]
  ids = _prompt(config, n, seed=n)
  _, (_, cache, _, _) = _prefill(tiny, ids, chunk=None, kv=SMALL_KV)
  _, (_, fp, _, _) = _prefill(tiny, ids, chunk=None)
  q, b = int(cache.quantized), int(cache.buffered)
  assert q + b == n and 0 < b <= 2 * SMALL_KV.residual and q % SMALL_KV.residual == 0
  # The buffered tail is the last real tokens' K/V (layer 0: nothing quantised upstream).
  _close(cache.buf_k[0][:, :, :b], fp.k[0][:, :, q:n])
  _close(cache.buf_v[0][:, :, :b], fp.v[0][:, :, q:n])


def test_generation_is_the_same_with_small_chunks(tiny, monkeypatch):
  config, graphdef, state = tiny
  ids = _prompt(config, 140, seed=2)
  kw = dict(max_new_tokens=12, eos_ids=())
  ar = generate(graphdef, state, config, ids, **kw).tokens
  ssd = speculative_generate(graphdef, state, config, ids, EarlyExitDrafter(k=2), **kw).tokens
  monkeypatch.setattr(gen, "PREFILL_CHUNK", 64)
  assert generate(graphdef, state, config, ids, **kw).tokens == ar
  assert speculative_generate(graphdef, state, config, ids, EarlyExitDrafter(k=2),
                              **kw).tokens == ar == ssd


def test_chunk_must_be_a_bucket_multiple(tiny):
  config, graphdef, state = tiny
  cache = create_cache(config, 128)
  with pytest.raises(ValueError, match="multiple of 64"):
    Prefill.build(state, cache, [1, 2, 3], DraftPlan.full(config.num_layers),
                  jax.random.key(0), graphdef=graphdef, sampling=SamplingParams(), chunk=100)
