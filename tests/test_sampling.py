"""`sampling.argmax` and `sampling.top_probability`: the fast forms the decode loops use
(`cpu_kernels.f32_argmax` on a CPU, two plain reductions elsewhere) must give what
`jnp.argmax` and `max(softmax)` give, ties and NaNs included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from specjax import cpu_kernels, ops
from specjax.errors import SpecjaxError
from specjax.sampling import argmax, argmax_and_top_probability, top_probability

_argmax = jax.jit(argmax)
_argmax_xla = jax.jit(ops._argmax_xla)
_both = jax.jit(argmax_and_top_probability)
kernel_built = pytest.mark.skipif(cpu_kernels.kernel_status("f32_argmax") != "ready",
                                  reason="no C++ compiler: the XLA path is the only one")

# Few distinct values, so ties are common; NaN and ±inf now and then.
_values = st.sampled_from([-np.inf, -2.0, -0.5, 0.0, 0.5, 3.0, np.inf, np.nan])
_logits = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9),
                     elements=_values)
# Rows long enough for the kernel's vector loop and its tail; distinct values mostly.
_rows = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 70)),
                   elements=st.one_of(st.floats(-30, 30, width=32), _values))


@settings(max_examples=200, deadline=None)
@given(_logits)
def test_argmax_is_jnp_argmax(logits):
  want = np.asarray(jnp.argmax(logits, axis=-1))
  for fn in (_argmax, _argmax_xla):  # the kernel where it runs; the other backends' form
    got = np.asarray(fn(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32


@settings(max_examples=200, deadline=None)
@given(_rows)
def test_argmax_and_top_probability_are_the_two_apart(logits):
  ids, p = _both(jnp.asarray(logits))
  np.testing.assert_array_equal(ids, jnp.argmax(logits, axis=-1))
  np.testing.assert_allclose(p, top_probability(jnp.asarray(logits)), rtol=2e-6)


def test_argmax_on_a_vocabulary_row():
  logits = jax.random.normal(jax.random.key(0), (5, 49152))
  logits = logits.at[2, 7].set(9.0).at[2, 900].set(9.0)  # a tie: the first index wins
  np.testing.assert_array_equal(_argmax(logits), jnp.argmax(logits, axis=-1))
  assert int(_argmax(logits)[2]) == 7


def test_top_probability_is_max_softmax():
  logits = 4.0 * jax.random.normal(jax.random.key(1), (3, 1000))
  want = jnp.max(jax.nn.softmax(logits), -1)
  np.testing.assert_allclose(top_probability(logits), want, rtol=1e-6)
  np.testing.assert_allclose(_both(logits)[1], want, rtol=1e-6)


@kernel_built
def test_the_kernel_batches_differentiates_and_takes_a_steps_few_rows():
  logits = 3.0 * jax.random.normal(jax.random.key(2), (4, 2, 999))
  ids, p = jax.vmap(argmax_and_top_probability)(logits)  # a vmap adds rows
  np.testing.assert_array_equal(ids, jnp.argmax(logits, axis=-1))
  np.testing.assert_allclose(p, top_probability(logits), rtol=1e-6)
  grad = jax.grad(lambda l: argmax_and_top_probability(l)[1].sum())(logits)
  np.testing.assert_allclose(grad, jax.grad(lambda l: top_probability(l).sum())(logits),
                             rtol=1e-5, atol=1e-12)
  assert jax.grad(lambda l: (argmax(l) * l[..., 0]).sum())(logits).shape == logits.shape
  hlo = jax.jit(argmax_and_top_probability).lower(logits).as_text()
  assert "specjax_f32_argmax" in hlo and "reduce" not in hlo
  for rows, kernel in ((cpu_kernels.FEW_ROWS, True), (cpu_kernels.FEW_ROWS + 1, False)):
    hlo = jax.jit(argmax).lower(jnp.zeros((rows, 10))).as_text()  # many rows: XLA's threads
    assert ("specjax_f32_argmax" in hlo) == kernel


def test_without_the_kernel_the_xla_forms_answer(monkeypatch):
  monkeypatch.setenv("SPECJAX_CPU_KERNELS", "f32_matmul")
  cpu_kernels.kernel_status.cache_clear()
  try:
    logits = jax.random.normal(jax.random.key(3), (2, 300))
    hlo = jax.jit(argmax_and_top_probability).lower(logits).as_text()
    assert "specjax_f32_argmax" not in hlo
    with pytest.raises(SpecjaxError, match="f32_argmax"):
      cpu_kernels.f32_argmax(logits)
  finally:
    monkeypatch.undo()
    cpu_kernels.kernel_status.cache_clear()
