"""AR generation: greedy equals argmax of a cache-free reference; sampling is seeded and
draws from the warped distribution; bad requests get clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_forward

from specjax.config import tiny_config
from specjax.decode.generate import TextStream, generate
from specjax.kv_cache import ContextOverflowError
from specjax.model import init_model
from specjax.sampling import SamplingParams, probs


def test_greedy_equals_reference_argmax_loop(tiny):
  config, graphdef, state = tiny
  model = nnx.merge(graphdef, state)
  prompt, n = [1, 5, 9, 13, 17], 10
  out = generate(graphdef, state, config, prompt, max_new_tokens=n, eos_ids=())
  # The reference reads one padded length throughout (its mask is causal, so the padding
  # after the last token changes no logit before it): its eager ops compile once, not once
  # per sequence length.
  seq = list(prompt)
  for _ in range(n):
    padded = seq + [0] * (len(prompt) + n - len(seq))
    logits, _ = reference_forward(model, jnp.asarray([padded]))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  assert out.tokens == seq[len(prompt):]


def test_stops_at_eos():
  config = tiny_config("llama")
  graphdef, state = nnx.split(init_model(config, seed=3))
  first = generate(graphdef, state, config, [1, 2, 3], max_new_tokens=6, eos_ids=())
  eos = first.tokens[2]
  out = generate(graphdef, state, config, [1, 2, 3], max_new_tokens=6, eos_ids=(eos,))
  assert out.tokens == first.tokens[: first.tokens.index(eos) + 1]
  assert out.stopped_on_eos


def test_sampling_is_seeded():
  config = tiny_config("qwen3")
  graphdef, state = nnx.split(init_model(config, seed=3))
  s = SamplingParams(temperature=50.0, top_p=0.9)  # random-init logits are very peaked
  run = lambda seed: generate(graphdef, state, config, [1, 4], max_new_tokens=12,
                              sampling=s, seed=seed, eos_ids=()).tokens
  assert run(0) == run(0)
  assert run(0) != run(1)


@settings(max_examples=30, deadline=None)
@given(
    logits=st.lists(st.floats(-5, 5), min_size=2, max_size=30),
    temperature=st.floats(0.1, 3.0),
    top_p=st.floats(0.05, 1.0),
)
def test_nucleus_properties(logits, temperature, top_p):
  x = jnp.asarray(logits, jnp.float32)
  p = np.asarray(probs(x, SamplingParams(temperature, top_p)))
  full = np.asarray(jax.nn.softmax(x / temperature))
  assert p.sum() == pytest.approx(1.0, abs=1e-5)
  assert p[np.argmax(full)] > 0  # the mode survives
  kept = p > 0
  assert full[kept].sum() >= min(top_p, 1.0) - 1e-5  # the nucleus reaches top_p
  # Every kept token is at least as likely as every dropped one.
  if (~kept).any():
    assert full[kept].min() >= full[~kept].max() - 1e-7


def test_sampled_frequencies_match_the_distribution():
  logits = jnp.asarray([2.0, 1.0, 0.5, -1.0])
  s = SamplingParams(temperature=0.8, top_p=1.0)
  from specjax.sampling import sample

  keys = jax.random.split(jax.random.key(0), 20_000)
  draws = jax.vmap(lambda k: sample(k, logits, s))(keys)
  freq = np.bincount(np.asarray(draws), minlength=4) / len(keys)
  np.testing.assert_allclose(freq, probs(logits, s), atol=0.015)


def test_bad_requests():
  config = tiny_config("gemma3")
  graphdef, state = nnx.split(init_model(config))
  with pytest.raises(ValueError, match="empty"):
    generate(graphdef, state, config, [], max_new_tokens=4)
  with pytest.raises(ContextOverflowError, match="exceeds the model's context"):
    generate(graphdef, state, config, [1] * (config.max_context - 2), max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(graphdef, state, config, [1], max_new_tokens=0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(temperature=1.0, top_p=0.0)


def test_text_stream_holds_back_partial_characters():
  from specjax.models.tokenizer import ByteTokenizer

  tok = ByteTokenizer()
  ids = tok.encode("né€", add_bos=False)
  stream = TextStream(tok.decode)
  assert "".join(stream.push(i) for i in ids) == "né€"
