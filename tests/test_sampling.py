"""`sampling.argmax` and `sampling.top_probability`: the fast forms the decode loops use
must give what `jnp.argmax` and `max(softmax)` give, ties and NaNs included."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specjax.sampling import argmax, top_probability

_argmax = jax.jit(argmax)

# Few distinct values, so ties are common; NaN and ±inf now and then.
_values = st.sampled_from([-np.inf, -2.0, -0.5, 0.0, 0.5, 3.0, np.inf, np.nan])
_logits = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9),
                     elements=_values)


@settings(max_examples=200, deadline=None)
@given(_logits)
def test_argmax_is_jnp_argmax(logits):
  got = np.asarray(_argmax(jnp.asarray(logits)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(logits, axis=-1)))
  assert got.dtype == np.int32


def test_argmax_on_a_vocabulary_row():
  logits = jax.random.normal(jax.random.key(0), (5, 49152))
  logits = logits.at[2, 7].set(9.0).at[2, 900].set(9.0)  # a tie: the first index wins
  np.testing.assert_array_equal(_argmax(logits), jnp.argmax(logits, axis=-1))
  assert int(_argmax(logits)[2]) == 7


def test_top_probability_is_max_softmax():
  logits = 4.0 * jax.random.normal(jax.random.key(1), (3, 1000))
  np.testing.assert_allclose(top_probability(logits), jnp.max(jax.nn.softmax(logits), -1),
                             rtol=1e-6)
