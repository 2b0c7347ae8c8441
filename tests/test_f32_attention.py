"""The float32 attention CPU kernel (`cpu_kernels.f32_attention`): equal to numpy under
any mask, bound and head grouping, the same for a token whatever the others beside it,
batched and differentiated through XLA's form, and taken by a decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax import cpu_kernels, ops
from specjax.config import tiny_config
from specjax.kv_cache import KVCache
from specjax.model import apply, init_model
from specjax.plan import DraftPlan

pytestmark = pytest.mark.skipif(cpu_kernels.kernel_status("f32_attention") != "ready",
                                reason="no C++ compiler: the XLA path is the only one")


def partials(xp, q, q_pos, k, v, key_pos, valid, scale, window, bound=None):
  """(m, l, acc) in the array module `xp`: numpy over float64, the reference; jax.numpy,
  the kernel's XLA form as the model passes it (for vmap and tangents)."""
  B, T, N, H = q.shape
  K, S = k.shape[1], k.shape[2]
  s = xp.einsum("btkgh,bksh->btkgs", q.reshape(B, T, K, N // K, H), k) * scale
  ok = valid[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])
  if bound is not None:
    ok &= (xp.arange(S) < bound)[None, None, :]
  if window:
    ok &= q_pos[:, :, None] - key_pos[:, None, :] < window
  ok = ok[:, :, None, None, :]
  s = xp.where(ok, s, -1e30)
  m = s.max(-1)
  p = xp.where(ok, xp.exp(s - m[..., None]), 0.0)
  acc = xp.einsum("btkgs,bksh->btkgh", p, v)
  return m.reshape(B, T, N), p.sum(-1).reshape(B, T, N), acc.reshape(B, T, N, H)


def reference(q, q_pos, k, v, key_pos, valid, bound, scale, window):
  """(m, l, acc) in float64 numpy, slots past `bound` unread."""
  f64 = lambda a: a.astype(np.float64)
  return partials(np, f64(q), q_pos, f64(k), f64(v), key_pos, valid, scale, window, bound)


def xla(scale, window):
  return lambda *args: partials(jnp, *args, scale, window)


def inputs(rng, B, T, N, K, S, H, p_valid=0.8):
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, K, S, H)).astype(np.float32)
  v = rng.normal(size=(B, K, S, H)).astype(np.float32)
  key_pos = np.stack([rng.permutation(S) for _ in range(B)]).astype(np.int32)
  q_pos = rng.integers(0, S + 2, size=(B, T)).astype(np.int32)
  valid = rng.random((B, S)) < p_valid
  return q, q_pos, k, v, key_pos, valid


def kernel(q, q_pos, k, v, key_pos, valid, bound, scale=0.125, window=None):
  fn = lambda *a: cpu_kernels.f32_attention(*a, bound, scale=scale, window=window,
                                            xla=xla(scale, window))
  return jax.jit(fn)(q, q_pos, k, v, key_pos, valid)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 9), K=st.integers(1, 3),
       G=st.sampled_from([1, 3, 7]), H=st.sampled_from([16, 64, 128]),
       S=st.integers(1, 300), window=st.sampled_from([None, 1, 7, 64]),
       seed=st.integers(0, 2**16), data=st.data())
def test_kernel_equals_numpy(B, T, K, G, H, S, window, seed, data):
  """Random validity and key positions (any order), query positions before, inside and
  past the keys, sliding windows, a bound anywhere in the segment: every row's (m, l, acc)
  matches, rows that see no slot included (m = -1e30, l = 0, acc = 0)."""
  rng = np.random.default_rng(seed)
  args = inputs(rng, B, T, K * G, K, S, H)
  bound = data.draw(st.integers(0, S))
  got = kernel(*args, bound, window=window)
  want = reference(*args, bound, 0.125, window)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(2, 3), T=st.integers(1, 9), K=st.integers(1, 3),
       G=st.sampled_from([1, 3]), H=st.sampled_from([16, 64]), S=st.integers(1, 80),
       U=st.integers(1, 9), window=st.sampled_from([None, 5]), seed=st.integers(0, 2**16),
       data=st.data())
def test_the_tokens_own_segment_is_read_per_batch_row(B, T, K, G, H, S, U, window, seed,
                                                      data):
  """`own` (the tokens' own keys and values, read as slots after `bound`) at B > 1: each
  batch row reads its own cache slots and its own tokens' K/V, positions and validity,
  exactly as if they were one segment (the verification of a batch of sequences)."""
  rng = np.random.default_rng(seed)
  q, q_pos, k, v, key_pos, valid = inputs(rng, B, T, K * G, K, S, H)
  own_k, own_v = (rng.normal(size=(B, K, U, H)).astype(np.float32) for _ in range(2))
  own_pos = (S + rng.permutation(U)[None] + rng.integers(0, 3, (B, 1))).astype(np.int32)
  own_valid = rng.random((B, U)) < 0.8
  q_pos = rng.integers(0, S + U + 3, (B, T)).astype(np.int32)  # some rows see own tokens
  bound = data.draw(st.integers(0, S))
  fn = lambda *a: cpu_kernels.f32_attention(*a[:6], bound, scale=0.125, window=window,
                                            xla=xla(0.125, window), own=a[6:])
  got = jax.jit(fn)(q, q_pos, k, v, key_pos, valid, own_k, own_v, own_pos, own_valid)
  join = lambda cached, own, axis: np.concatenate(
      [np.take(cached, np.arange(bound), axis=axis), own], axis)
  want = reference(q, q_pos, join(k, own_k, 2), join(v, own_v, 2), join(key_pos, own_pos, 1),
                   join(valid, own_valid, 1), None, 0.125, window)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5)


def test_long_segments_split_over_threads_match_numpy():
  """A segment long enough that each thread takes part of its slots (1500 of 2048 read,
  2 kv heads of 64): the parts, merged, match."""
  rng = np.random.default_rng(0)
  args = inputs(rng, 1, 5, 14, 2, 2048, 64, p_valid=0.97)
  got = kernel(*args, 1500)
  for g, w in zip(got, reference(*args, 1500, 0.125, None)):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("S", [40, 700])
def test_a_token_gets_the_same_bits_beside_others(S):
  """Verification's row t is bit for bit the AR step's at the same inputs: each row is
  computed alone, whatever T (single-threaded and split over threads)."""
  rng = np.random.default_rng(S)
  q, q_pos, k, v, key_pos, valid = inputs(rng, 1, 5, 9, 3, S, 64)
  together = kernel(q, q_pos, k, v, key_pos, valid, S)
  for t in range(5):
    alone = kernel(q[:, t:t + 1], q_pos[:, t:t + 1], k, v, key_pos, valid, S)
    for a, b in zip(alone, together):
      np.testing.assert_array_equal(np.asarray(a)[:, 0], np.asarray(b)[:, t])


def test_vmap_and_grad_take_xla_form():
  """A vmap over the queries (the sampling tests' rounds) or the cache, and gradients,
  go through the XLA form and agree with the kernel's values."""
  rng = np.random.default_rng(1)
  q, q_pos, k, v, key_pos, valid = inputs(rng, 1, 2, 6, 2, 50, 16)
  qs = np.stack([q, 2 * q, -q])
  fn = lambda q, k: cpu_kernels.f32_attention(q, q_pos, k, v, key_pos, valid, 50, scale=0.3,
                                              window=None, xla=xla(0.3, None))
  batched = jax.jit(jax.vmap(fn, in_axes=(0, None)))(qs, k)
  for i in range(3):
    for b, w in zip(batched, reference(qs[i], q_pos, k, v, key_pos, valid, 50, 0.3, None)):
      np.testing.assert_allclose(np.asarray(b[i]), w, rtol=2e-5, atol=2e-5)
  over_k = jax.jit(jax.vmap(fn, in_axes=(None, 0)))(q, np.stack([k, -k]))
  np.testing.assert_allclose(np.asarray(over_k[2][1]),
                             reference(q, q_pos, -k, v, key_pos, valid, 50, 0.3, None)[2],
                             rtol=2e-5, atol=2e-5)
  loss = lambda f: lambda q: jnp.sum(f(q)[2] / f(q)[1][..., None])
  ref = lambda q: xla(0.3, None)(q, q_pos, k, v, key_pos, valid)
  np.testing.assert_allclose(np.asarray(jax.grad(loss(lambda q: fn(q, k)))(q)),
                             np.asarray(jax.grad(loss(ref))(q)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_verification_forward_takes_kernel_and_equals_xla(arch, monkeypatch):
  """A 5-token forward after a prefill calls the kernel (its HLO says so; the prefill's 24
  tokens keep XLA's dots) and gives XLA's logits to float32 rounding, gemma3's sliding
  windows included."""
  config = tiny_config(arch)
  graphdef, state = nnx.split(init_model(config, seed=1))
  plan = DraftPlan.full(config.num_layers)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (1, 29)))
  fwd = jax.jit(lambda c, t, p: apply(state, c, t, p, plan, graphdef=graphdef))
  prompt, at = (tokens[:, :24], jnp.arange(24)[None]), (tokens[:, 24:], jnp.arange(24, 29)[None])

  def logits():
    _, cache = fwd(KVCache.create(config, 1, 48), *prompt)
    return np.asarray(fwd(cache, *at)[0].logits)

  cache = KVCache.create(config, 1, 48)
  assert "specjax_f32_attention" not in fwd.lower(cache, *prompt).as_text()
  assert "specjax_f32_attention" in fwd.lower(cache, *at).as_text()
  fast = logits()
  monkeypatch.setattr(ops, "f32_attention_takes", lambda *a: False)
  fwd = jax.jit(lambda c, t, p: apply(state, c, t, p, plan, graphdef=graphdef))
  np.testing.assert_allclose(fast, logits(), rtol=1e-4, atol=1e-4)


def test_bench_attention_times_both_paths(monkeypatch, capsys):
  """experiments/bench_attention.py on a tiny model: the AR step and the verification
  compiled with and without the kernel (it checks their HLO), timed, and one JSON line
  at the end."""
  import json
  import sys

  from experiments import bench_attention

  monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--model", "tiny-llama",
                                    "--contexts", "24", "--repeats", "2"])
  bench_attention.main()
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert set(figures["contexts"]) == {"24"}
  for row in figures["contexts"].values():
    assert all(t > 0 for step in ("ar_ms", "verify_ms") for t in row[step].values())
  assert cpu_kernels.kernel_status("f32_matmul") == "ready"  # the kernels' choice restored


def test_bench_attention_refuses_another_dtype(monkeypatch):
  """--dtype other than float32 stops with a message (the kernel takes float32 only)."""
  import sys

  from experiments import bench_attention

  monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--model", "tiny-llama",
                                    "--dtype", "bfloat16"])
  with pytest.raises(SystemExit, match="float32 steps"):
    bench_attention.main()


def test_kernel_unavailable_says_why(monkeypatch):
  """Called with the kernel disabled, `f32_attention` raises with the reason, not an
  unknown FFI target at compile time."""
  from specjax.errors import SpecjaxError

  monkeypatch.setenv("SPECJAX_CPU_KERNELS", "int8_matmul")
  cpu_kernels.kernel_status.cache_clear()
  try:
    args = inputs(np.random.default_rng(0), 1, 1, 2, 1, 8, 16)
    with pytest.raises(SpecjaxError, match="disabled by SPECJAX_CPU_KERNELS"):
      kernel(*args, 8)
  finally:
    cpu_kernels.kernel_status.cache_clear()
