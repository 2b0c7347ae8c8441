"""QuantSpec: hierarchical quantisation bounds and packing, the quantised KV cache (every
token kept exactly once across flushes and rollbacks, one cache read at two precisions),
4-bit draft weights, the drafter lossless over long generations, and clear errors."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from targets import assert_exercised, assert_plan_keeps_the_target_distribution, target

from specjax import cpu_kernels, ops, quant, quant_kv_cache
from specjax.config import tiny_config
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate, positions_for, prefill_prompt, prefill_step
from specjax.drafters import KnapSpecDrafter, QuantSpecDrafter, StaticDrafter
from specjax.kv_cache import ContextOverflowError, KVCache
from specjax.model import apply, init_model
from specjax.plan import DraftPlan, PlanError
from specjax.quant import Int4Matrix, QuantError
from specjax.quant_kv_cache import QuantKV, QuantKVCache
from specjax.sampling import SamplingParams


def grouped_scale(x, axis, group):
  """Each element's group scale, broadcast back to x's shape."""
  h = quant.quantize(x, axis, group)
  return np.repeat(np.asarray(h.scale), group, axis=axis % x.ndim), h


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), groups=st.integers(1, 4), group=st.sampled_from([2, 8, 32]),
       width=st.sampled_from([2, 6, 16]), axis=st.sampled_from([0, 1]),
       spread=st.floats(1e-3, 1e3))
def test_error_bounds_4_and_8_bit(seed, groups, group, width, axis, spread):
  rng = np.random.default_rng(seed)
  shape = (groups * group, width) if axis == 0 else (width, groups * group)  # even groups
  x = jnp.asarray(rng.normal(size=shape) * spread, jnp.float32)
  scale, h = grouped_scale(x, axis, group)
  eps = 1e-6 * spread + 1e-6  # float32 rounding of the reconstruction
  err4 = np.abs(np.asarray(quant.dequantize(h, axis, group, bits=4)) - np.asarray(x))
  err8 = np.abs(np.asarray(quant.dequantize(h, axis, group, bits=8)) - np.asarray(x))
  assert np.all(err4 <= scale / 2 + eps)
  assert np.all(err8 <= scale / 30 + eps)
  assert np.all(err8 <= err4 + eps)  # the lower nibble only refines
  if group >= 8 and x.size >= 64:  # uniform residuals: mean errors scale/4 vs scale/60
    assert err8.mean() < err4.mean() / 4


@pytest.mark.fusion_emitters  # bit for bit: both programs contract a·b + c as production does
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), shape=st.sampled_from([(1, 2, 32, 16), (1, 3, 64, 64),
                                                           (2, 24, 96), (1, 2, 16, 96)]),
       keys=st.booleans(), group=st.sampled_from([8, 16, 32, 96]), bits=st.sampled_from([4, 8]))
def test_dequantize_is_the_formula_in_every_layout(seed, shape, keys, group, bits):
  """`dequantize` widens each packed half on its own and broadcasts the group statistics;
  it must give, bit for bit, lo + upper·scale (+ (lower − 7)·scale/15) with the codes
  unpacked and the statistics repeated to full size: for groups of rows (keys), groups of
  channels within a packed half, and groups spanning both halves (its fallback)."""
  axis = -2 if keys else -1
  if shape[axis] % group:
    return
  x = jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)
  h = quant.quantize(x, axis, group)
  ax = axis % x.ndim

  @jax.jit  # XLA, as dequantize: it contracts a·b + c into one FMA, which numpy does not
  def formula(h):
    full = lambda a: jnp.repeat(a, group, axis=ax)
    codes = lambda p: quant.unpack(p).astype(jnp.float32)
    out = full(h.lo) + codes(h.upper) * full(h.scale)
    return out + (codes(h.lower) - 7.0) * (full(h.scale) / 15.0) if bits == 8 else out

  got = jax.jit(lambda h: quant.dequantize(h, axis, group, bits))(h)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(formula(h)))


def test_the_scale_over_16_formula_would_need_17_levels():
  """Why quant.py steps the residual by scale/15: with scale/16 and +8, residuals near
  +scale/2 round to code 16; clipped to 15 their error reaches scale/16 (> scale/32)."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(128, 8)), jnp.float32)
  g = x.reshape(1, 128, 8)
  lo, hi = g.min(1, keepdims=True), g.max(1, keepdims=True)
  s = (hi - lo) / 15
  upper = jnp.round((g - lo) / s)
  raw = jnp.round((g - lo - upper * s) / (s / 16)) + 8
  assert int(raw.max()) == 16
  approx = lo + upper * s + (jnp.clip(raw, 0, 15) - 8) * s / 16
  assert float(jnp.max(jnp.abs(approx - g) / s)) > 1 / 32


@settings(deadline=None)
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda c: len(c) % 2 == 0))
def test_packing_round_trips(codes):
  c = jnp.asarray(codes, jnp.uint8)
  packed = quant.pack(c)
  assert packed.shape == (len(codes) // 2,) and packed.dtype == jnp.uint8
  assert np.array_equal(quant.unpack(packed), c)


def test_constant_groups_are_exact_and_4bit_weights_bounded():
  x = jnp.full((16, 4), 2.5)
  h = quant.quantize(x, 0, 8)
  assert np.array_equal(quant.dequantize(h, 0, 8, bits=4), x)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(256, 64)), jnp.float32)
  m = Int4Matrix.quantize(w, group=128)
  scale = np.repeat(np.asarray(m.scale).T, 128, axis=0)  # [Out, groups] -> per [In, Out]
  assert np.all(np.abs(np.asarray(m.dequantize()) - np.asarray(w)) <= scale / 2 + 1e-6)
  assert m.nbytes < w.nbytes / 4  # 4-bit codes + f32 scales per 128 rows
  assert m.shape == (256, 64)
  odd = w[:200]  # 1.56 groups: the partial one is padded, then cut off again
  m = Int4Matrix.quantize(odd, group=128)
  scale = np.repeat(np.asarray(m.scale).T, 128, axis=0)[:200]
  assert m.dequantize().shape == odd.shape == m.shape
  assert np.all(np.abs(np.asarray(m.dequantize()) - np.asarray(odd)) <= scale / 2 + 1e-6)


def test_4bit_weights_are_stored_as_the_cpu_kernel_reads_them():
  """Output-major, each group's codes packed within the group: byte j of a group holds
  inputs j and j + G/2 (what `int4_matmul.cc` widens), the same codes as quantising the
  [In, Out] matrix over its rows."""
  w = jnp.asarray(np.random.default_rng(2).normal(size=(64, 6)), jnp.float32)
  m = Int4Matrix.quantize(w, group=16)
  h = quant.quantize(w, axis=0, group=16)  # codes packed along Out, groups along In
  codes = np.asarray(quant.unpack(h.upper))  # [In, Out]
  packed = np.asarray(m.codes).reshape(6, 4, 8)  # [Out, groups, G/2]
  assert np.array_equal(packed & 0xF, codes.T.reshape(6, 4, 16)[..., :8])
  assert np.array_equal(packed >> 4, codes.T.reshape(6, 4, 16)[..., 8:])
  assert np.array_equal(np.asarray(m.scale), np.asarray(h.scale).T)


@settings(max_examples=10, deadline=None)  # each example compiles: ~1 s
@given(rows=st.sampled_from([(1,), (5,), (2, 3)]), inner=st.integers(1, 300),
       outer=st.integers(1, 150), group=st.sampled_from([8, 32, 64, 128]),
       seed=st.integers(0, 2**16))
@example(rows=(5,), inner=200, outer=67, group=128, seed=0)  # a partial group, vectors
@example(rows=(2, 3), inner=40, outer=9, group=8, seed=1)  # the scalar loop
@example(rows=(1,), inner=576, outer=130, group=128, seed=2)  # SmolLM2's D: 4.5 groups
def test_int4_kernel_equals_the_dequantised_matmul(rows, inner, outer, group, seed):
  """x on its activation grid times the dequantised matrix, whichever path runs. Any
  leading shape; inner sizes that leave a partial group (padded) and groups too small for
  the vectors (the scalar loop); channel counts off the 64-channel chunk."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=rows + (inner,)), jnp.float32)
  m = Int4Matrix.quantize(jnp.asarray(rng.normal(size=(inner, outer)), jnp.float32), group)
  padded = jnp.pad(x, [(0, 0)] * len(rows) + [(0, -inner % group)])
  on_grid = np.asarray(quant.activation_grid(padded, group), np.float64)[..., :inner]
  want = on_grid @ np.asarray(m.dequantize(), np.float64)
  got = jax.jit(m.matmul)(x)
  assert got.shape == rows + (outer,)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-5 * np.sqrt(inner))


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 4), group=st.sampled_from([1, 8, 128]),
       spread=st.floats(-30, 30), zeros=st.booleans(), seed=st.integers(0, 2**16))
# A unit computed as max|x| / 32767: XLA multiplied three rows by the reciprocal and
# divided the row alone, an ulp apart (AMD EPYC, AVX-512).
@example(groups=1, group=1, spread=1.5954461787033978, zeros=False, seed=294)
def test_the_activation_grid_moves_an_input_at_most_half_a_step(groups, group, spread,
                                                                 zeros, seed):
  """Each group's step is its max|x| / 32767: a value moves at most half a step (2^-16 of
  the group's largest), the largest is kept exactly, an all-zero group stays zero, and a
  row's grid does not depend on the rows beside it."""
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(3, groups * group)) * 2.0**spread).astype(np.float32)
  if zeros:
    x[1, :group] = 0
  on_grid = np.asarray(quant.activation_grid(jnp.asarray(x), group))
  amax = np.repeat(np.abs(x.reshape(3, groups, group)).max(-1), group, axis=-1)
  assert np.all(np.abs(on_grid - x) <= amax * (2.0**-16 + 2.0**-23))
  largest = np.abs(x) == amax
  np.testing.assert_allclose(on_grid[largest], x[largest], rtol=2.0**-22)
  if zeros:
    assert np.all(on_grid[1, :group] == 0)
  alone = np.asarray(quant.activation_grid(jnp.asarray(x[2:]), group))
  assert np.array_equal(alone, on_grid[2:])


@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel needs a C++ compiler")
def test_int4_kernel_refuses_operands_that_do_not_match():
  """x must cover the padded rows (`Int4Matrix.matmul` pads it); lo/scale one per group."""

  m = Int4Matrix.quantize(jnp.ones((200, 8), jnp.float32), group=64)  # 256 padded rows
  with pytest.raises(Exception, match="int4_matmul: x"):
    cpu_kernels.int4_matmul(jnp.ones((1, 200)), m.codes, m.lo, m.scale)
  with pytest.raises(Exception, match="int4_matmul: x"):
    cpu_kernels.int4_matmul(jnp.ones((1, 256)), m.codes, m.lo[:, :3], m.scale)


def test_4bit_weights_take_the_kernel_on_a_cpu_and_xla_without_it(monkeypatch):

  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 200)), jnp.float32)
  m = Int4Matrix.quantize(jnp.asarray(rng.normal(size=(200, 96)), jnp.float32))
  if shutil.which("g++") is not None:  # CI and this machine: the fast path is really taken
    assert "specjax_int4_matmul" in jax.jit(m.matmul).lower(x).as_text()
  fast = np.asarray(m.matmul(x))
  monkeypatch.setattr(cpu_kernels.build, "kernel_status", lambda *a: "disabled by SPECJAX_CPU_KERNELS=0")
  assert "specjax_int4_matmul" not in jax.jit(m.matmul).lower(x).as_text()
  np.testing.assert_allclose(np.asarray(m.matmul(x)), fast, rtol=1e-5, atol=1e-4)


# --- the cache ---------------------------------------------------------------------------------


def tiny(arch: str = "llama", layers: int = 4):
  return target(arch, layers)


def test_flushes_keep_every_token_exactly_once_over_a_long_run():
  """Append 1..5 tokens at a time with random rollbacks (rejected drafts) past many
  flushes; the cache must read back exactly the committed tokens, in order, each once."""
  config = dataclasses.replace(tiny_config("llama", num_layers=1), max_context=2048)
  K, H, R, G = config.num_kv_heads, config.head_dim, 16, 8
  cache = QuantKVCache.create(config, 1, 1024, group=G, residual=R)
  append = jax.jit(lambda c, k, v: c.append([k], [v]))
  rng = np.random.default_rng(0)
  committed: list[int] = []
  next_id = 0

  def rows(ids):  # token t's K/V: value t in every channel, plus a small channel ramp
    base = jnp.asarray(ids, jnp.float32)[None, None, :, None] + 0.01 * jnp.arange(H)
    return jnp.broadcast_to(base, (1, K, len(ids), H))

  flushes = 0
  while len(committed) < 700:
    T = 40 if not committed else int(rng.integers(1, 6))  # a prefill, then rounds
    ids = list(range(next_id, next_id + T))
    next_id += T
    q0 = int(cache.quantized)
    cache = append(cache, rows(ids), rows(ids))
    flushed = int(cache.quantized) > q0
    flushes += flushed
    assert int(cache.buffered) <= 2 * R and (not flushed or int(cache.buffered) > R)
    keep = T if len(committed) == 0 else int(rng.integers(1, T + 1))  # accept a prefix
    committed += ids[:keep]
    cache = cache.with_length(len(committed))
  assert flushes >= 20 and int(cache.length) == len(committed)
  Q, b = int(cache.quantized), int(cache.buffered)
  keys = np.concatenate([np.asarray(cache.keys(0, 8))[0, :, :Q],
                         np.asarray(cache.buf_k[0])[0, :, :b]], axis=1)
  vals = np.concatenate([np.asarray(cache.values(0, 8))[0, :, :Q],
                         np.asarray(cache.buf_v[0])[0, :, :b]], axis=1)
  want = np.asarray(rows(committed))[0]
  # within 8-bit error of the committed tokens' own values, so no token is missing,
  # repeated or shifted (neighbouring tokens differ by 1, far above the error)
  np.testing.assert_allclose(keys, want, atol=0.35)
  np.testing.assert_allclose(vals, want, atol=0.35)
  assert np.array_equal(np.round(keys[0, :, 0]), np.asarray(committed, np.float32))


@pytest.mark.parametrize("skip_cheaply", [True, False])
def test_settle_flushes_as_a_general_write_would(monkeypatch, skip_cheaply):
  """`settle` flushes the oldest R tokens in place, in a `lax.cond` where conditionals
  skip cheaply (a CPU) and unconditionally, writing nothing unless due, elsewhere (a GPU).
  Either way it must leave the cache that the general write (`_write`, which scatters a
  stream of any length) leaves: the same codes and scales in every slot, the same counts,
  the same buffered tokens (buffer rows past them are dead)."""
  monkeypatch.setattr(quant_kv_cache, "conditionals_skip_cheaply", lambda: skip_cheaply)
  config = dataclasses.replace(tiny_config("llama", num_layers=2), max_context=1024)
  K, H, R = config.num_kv_heads, config.head_dim, 16
  limit = 2 * R - 8
  rng = np.random.default_rng(0)
  fill = jax.jit(lambda c, kv: c.append([kv, -kv], [kv * 0.5, kv], settled=False))
  for buffered in (limit - 1, limit, limit + 1, 2 * R):
    n = 3 * R + buffered  # three flushes during the fill, then `buffered` in the buffer
    kv = jnp.asarray(rng.normal(size=(1, K, n, H)), jnp.float32)
    cache = fill(QuantKVCache.create(config, 1, 256, group=8, residual=R, headroom=8), kv)
    cache = cache.with_length(n)  # a fill leaves R..2R buffered; put `buffered` there
    assert int(cache.buffered) == buffered, int(cache.buffered)
    got = jax.jit(lambda c: c.settle())(cache)
    want = jax.jit(lambda c: c._write(None, None, 0, limit=limit))(cache)
    assert int(got.quantized) == int(cache.quantized) + (R if buffered > limit else 0)
    assert (int(got.quantized), int(got.buffered)) == (int(want.quantized), int(want.buffered))
    for g, w in zip(jax.tree.leaves((got.k_codes, got.v_codes)),
                    jax.tree.leaves((want.k_codes, want.v_codes))):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    b = int(want.buffered)
    for g, w in zip(got.buf_k + got.buf_v, want.buf_k + want.buf_v):
      np.testing.assert_array_equal(np.asarray(g)[:, :, :b], np.asarray(w)[:, :, :b])


@pytest.mark.parametrize("skip_cheaply", [True, False], ids=["cpu", "gpu"])
def test_no_step_or_round_copies_the_quantised_cache(monkeypatch, skip_cheaply):
  """The AR step and QuantSpec's device loop (drafting at 4 bits, then verification
  settling and appending), with the flush in a conditional (CPU) or not (GPU), and the
  prefill: no executable copies a code plane or a layer's buffer. The flush writes in
  place once the verified tokens are known (a flush that wrote fresh buffers made the
  conditional copy every buffer on every step; one ordered before the draft's reads made
  every round copy what the draft reads), and each layer's rows are appended after that
  layer's read. (A prefill on the GPU path flushes, then writes fresh buffers from its
  stream: it copies the buffers, once per prompt chunk, never a code plane.)"""
  from test_model import copies_of

  from specjax.decode.generate import decode_step
  from specjax.decode.round_loop import Decoding, decode_rounds

  monkeypatch.setattr(quant_kv_cache, "conditionals_skip_cheaply", lambda: skip_cheaply)
  config, graphdef, state = target("llama")
  K, H, L, R, S = config.num_kv_heads, config.head_dim, config.num_layers, 16, 256
  cache = QuantKVCache.create(config, 1, S, group=8, residual=R)
  planes = {("u8", (1, K, S, H // 2))}
  layers = planes | {("f32", (1, K, 2 * R, H))}  # and a layer's buffer
  plan, key, greedy = DraftPlan.full(L), jax.random.key(0), SamplingParams()
  prefill = prefill_step.lower(state, cache, jnp.ones((1, 64), jnp.int32), jnp.int32(40),
                               plan, key, graphdef=graphdef, sampling=greedy)
  step = decode_step.lower(state, cache, jnp.ones((1,), jnp.int32), plan, key,
                           graphdef=graphdef, sampling=greedy)
  carry = Decoding.start(cache, jnp.asarray([1]), key, 64)
  rounds = decode_rounds.lower(state, carry, plan.replace(kv_bits=4), jnp.int32(40),
                               jnp.asarray([-1]), jnp.int32(8), graphdef=graphdef,
                               vocab=config.vocab_size, gamma=4, threshold=0.0,
                               sampling=greedy)
  assert copies_of(prefill.compile().as_text(), layers if skip_cheaply else planes) == []
  for lowered in (step, rounds):
    assert copies_of(lowered.compile().as_text(), layers) == []


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), gamma=st.integers(1, 7))
def test_the_target_reads_the_same_cache_in_ar_and_at_any_gamma(seed, gamma):
  """Forward passes settle, read, then append. Decoding one token a step (AR) and γ + 1
  a step with random rejections (SSD) must leave the target reading the same cache at
  every committed length — same flushes, same codes, same buffer — or SSD would verify
  against a different target than AR's whenever γ moved a flush."""
  config = dataclasses.replace(tiny_config("llama", num_layers=1), max_context=1024)
  K, H = config.num_kv_heads, config.head_dim
  rng = np.random.default_rng(seed)
  true = rng.normal(size=(1, K, 400, H)).astype(np.float32)
  create = lambda: QuantKVCache.create(config, 1, 512, group=8, residual=16, headroom=8)
  settle = jax.jit(lambda c: c.settle())
  append = jax.jit(lambda c, kv: c.append([kv], [kv * 0.5], settled=True))

  def seen(cache):  # what a reader at 8 bits gets: the quantised part, then the buffer
    Q, b = int(cache.quantized), int(cache.buffered)
    return (Q, np.asarray(cache.keys(0, 8))[..., :Q, :], np.asarray(cache.values(0, 8))[..., :Q, :],
            np.asarray(cache.buf_k[0])[..., :b, :], np.asarray(cache.buf_v[0])[..., :b, :])

  prompt = append(settle(create()), jnp.asarray(true[:, :, :40]))
  ar, cache = {}, prompt
  for n in range(40, 360):
    cache = settle(cache)
    ar[n] = seen(cache)
    cache = append(cache, jnp.asarray(true[:, :, n:n + 1]))
  c, cache, checked = 40, prompt, 0
  while c < 350:
    cache = settle(cache)
    for want, got in zip(ar[c], seen(cache)):
      np.testing.assert_array_equal(got, want)
    checked += 1
    accepted = int(rng.integers(0, gamma + 1))  # drafts kept; the rest are junk K/V
    rows = true[:, :, c:c + gamma + 1].copy()
    rows[:, :, 1 + accepted:] = rng.normal(size=rows[:, :, 1 + accepted:].shape) * 9
    cache = append(cache, jnp.asarray(rows)).with_length(c + 1 + accepted)
    c += 1 + accepted
  assert checked > 300 // (gamma + 1) and ar[349][0] >= 16 * 16  # many flushes crossed


@pytest.mark.parametrize("codes", [True, False], ids=["read-codes", "dequantise"])
def test_draft_and_target_read_one_cache_at_4_and_8_bits(monkeypatch, codes):
  """A forward with kv_bits=4 / 8 on the quantised cache equals the same forward on a
  full-precision cache holding the 4- / 8-bit dequantised tokens plus the fp buffer,
  whether it reads the codes (a CPU's C++ kernels) or dequantises them (jnp, a GPU's
  default). Reading the codes, the buffer and the token's own K/V take `f32_attention`."""

  assert ops.quant_codes_on_cpu() or not codes, "the quant_attention kernel did not build"
  monkeypatch.setattr(ops, "quant_codes_on_cpu", lambda: codes)  # for the caches made here
  config, graphdef, state = tiny()
  L = config.num_layers
  prompt = jnp.asarray([list(range(3, 80))], jnp.int32)
  qc = QuantKVCache.create(config, 1, 256, group=16, residual=16)
  assert qc.cpu_reads == codes
  _, qc = apply(state, qc, prompt, positions_for(qc, prompt.shape[1], 1), DraftPlan.full(L),
                graphdef=graphdef)
  Q, b = int(qc.quantized), int(qc.buffered)
  assert Q > 0 and b > 0
  token = jnp.asarray([[5]], jnp.int32)
  for bits in (4, 8):
    plan = DraftPlan.full(L).replace(kv_bits=bits)
    out_q, _ = apply(state, qc, token, positions_for(qc, 1, 1), plan, graphdef=graphdef,
                     write_cache=False)
    step = jax.jit(functools.partial(apply, graphdef=graphdef, write_cache=False))
    hlo = step.lower(state, qc, token, positions_for(qc, 1, 1), plan).as_text()
    if codes and cpu_kernels.runs_here("f32_attention"):
      assert "specjax_f32_attention" in hlo and "specjax_quant_partials" in hlo
    dense = KVCache.create(config, 1, 256)
    fill = lambda deq, buf: deq.at[:, :, Q:Q + b].set(buf[:, :, :b])
    dense = dense.replace(
        k=tuple(fill(qc.keys(l, bits), qc.buf_k[l]) for l in range(L)),
        v=tuple(fill(qc.values(l, bits), qc.buf_v[l]) for l in range(L)), length=Q + b)
    out_d, _ = apply(state, dense, token, positions_for(dense, 1, 1), DraftPlan.full(L),
                     graphdef=graphdef, write_cache=False)
    np.testing.assert_allclose(out_q.logits, out_d.logits, atol=2e-5)
  # and the two precisions differ: the draft really reads less
  four, _ = apply(state, qc, token, positions_for(qc, 1, 1),
                  DraftPlan.full(L).replace(kv_bits=4), graphdef=graphdef, write_cache=False)
  eight, _ = apply(state, qc, token, positions_for(qc, 1, 1), DraftPlan.full(L),
                   graphdef=graphdef, write_cache=False)
  assert not np.allclose(four.logits, eight.logits, atol=1e-6)


# --- the drafter -------------------------------------------------------------------------------

KV = QuantKV(group=8, residual=16)
PROMPT = list(range(3, 45))


def drafter_for(arch, base=None):
  config, graphdef, state = tiny(arch)
  model = types.SimpleNamespace(graphdef=graphdef, state=state, config=config)
  return QuantSpecDrafter.for_model(model, base=base, weight_bits=4, weight_group=32,
                                    kv_cache=KV)


@pytest.mark.parametrize("arch, codes", [("llama", True), ("qwen3", True), ("gemma3", True),
                                         ("llama", False)])
def test_quantspec_is_lossless_across_many_flushes(monkeypatch, arch, codes):
  """Greedy QuantSpec == greedy AR on the same quantised cache, read from its codes (a
  CPU's kernels) or dequantised (jnp, a GPU's default path)."""

  built = ops.quant_codes_on_cpu()
  monkeypatch.setattr(ops, "quant_codes_on_cpu", lambda: codes and built)  # caches made now
  config, graphdef, state = tiny(arch)
  ar = generate(graphdef, state, config, PROMPT, max_new_tokens=160, eos_ids=(), kv_cache=KV)
  # Over a base that skips layer 1: QuantSpec's own draft agrees with some
  # trained targets on every token, and this test is about rolling rejections back.
  skip = StaticDrafter(DraftPlan.from_skips(config.num_layers, [1], [1]))
  out = speculative_generate(graphdef, state, config, PROMPT, drafter_for(arch, base=skip),
                             max_new_tokens=160, gamma=4, eos_ids=(), record_rounds=True,
                             threshold=0.0)
  assert out.tokens == ar.tokens  # 42 + 160 tokens through a 2R = 32 buffer: ~10 flushes
  assert len(set(ar.tokens)) >= 8
  assert out.plans[0].kv_bits == 4 and out.plans[0].weight_bits == 4
  assert_exercised(out, deep=True)  # rejected drafts rolled back across the flushes


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9)])
def test_one_prefill_serves_ar_and_every_drafter_unchanged(sampling):
  """The benchmark prefills a long prompt once per cache type: runs started from that
  prefill (several times: each decodes on a copy) give what they give on their own."""
  config, graphdef, state = tiny("llama")
  kw = dict(max_new_tokens=50, eos_ids=(), sampling=sampling, seed=3)
  pre = prefill_prompt(graphdef, state, config, PROMPT, kv_cache=KV, max_new_tokens=50 + 5,
                       sampling=sampling, seed=3)
  ar = generate(graphdef, state, config, PROMPT, kv_cache=KV, **kw)
  for _ in range(2):
    assert generate(graphdef, state, config, PROMPT, kv_cache=KV, prefilled=pre,
                    **kw).tokens == ar.tokens
  alone = speculative_generate(graphdef, state, config, PROMPT, drafter_for("llama"), gamma=4,
                               **kw)
  for _ in range(2):
    shared = speculative_generate(graphdef, state, config, PROMPT, drafter_for("llama"),
                                  gamma=4, prefilled=pre, **kw)
    assert (shared.tokens, shared.accepted) == (alone.tokens, alone.accepted)
  if sampling.temperature == 0:
    assert alone.tokens == ar.tokens


def test_a_prefill_made_for_another_run_is_refused():
  config, graphdef, state = tiny("llama")
  pre = prefill_prompt(graphdef, state, config, PROMPT, kv_cache=KV, max_new_tokens=20)
  run = functools.partial(generate, graphdef, state, config, max_new_tokens=20, kv_cache=KV)
  with pytest.raises(ValueError, match="another prompt"):
    run(PROMPT[:-1], prefilled=pre)
  with pytest.raises(ValueError, match="another kv_cache"):
    run(PROMPT, prefilled=pre, kv_cache=None)
  with pytest.raises(ValueError, match="another seed"):
    run(PROMPT, prefilled=pre, seed=1)
  with pytest.raises(ValueError, match="needs"):
    run(PROMPT, prefilled=pre, max_new_tokens=400)
  with pytest.raises(ValueError, match="another sampling"):
    speculative_generate(graphdef, state, config, PROMPT, drafter_for("llama"), gamma=4,
                         max_new_tokens=10, prefilled=pre,
                         sampling=SamplingParams(temperature=0.5))


def test_quantspec_composes_with_knapspec_and_samples():
  from test_knapspec import synthetic_profile

  config, graphdef, state = tiny("llama")
  ks = KnapSpecDrafter(profile=synthetic_profile(layers=config.num_layers), interval=2, window=4)
  d = drafter_for("llama", base=ks)
  ar = generate(graphdef, state, config, PROMPT, max_new_tokens=60, eos_ids=(), kv_cache=KV)
  out = speculative_generate(graphdef, state, config, PROMPT, d, max_new_tokens=60, gamma=4,
                             eos_ids=(), record_rounds=True)
  assert out.tokens == ar.tokens
  assert all(p.kv_bits == 4 for p in out.plans)
  assert any(not np.all(p.attn) or not np.all(p.mlp) for p in out.plans)
  sampled = speculative_generate(graphdef, state, config, PROMPT, drafter_for("llama"),
                                 max_new_tokens=40, gamma=3, eos_ids=(),
                                 sampling=SamplingParams(temperature=0.9))
  assert len(sampled.tokens) == 40


def test_quantspec_sampling_round_keeps_the_target_distribution():
  """Sampling: rounds drafted at 4-bit KV + 4-bit weights, verified at 8 bits. Over many
  rounds from one state the first committed token ~ p and the second ~ p(. | first),
  where p is the target as it reads the quantised cache; the test has the power to see
  the classic acceptance bugs with this draft (asserted)."""
  config, graphdef, state = target("llama", 4, 12)
  L, sampling = config.num_layers, SamplingParams(temperature=2.0, top_p=1.0)
  # Words of the tiny model's language, ending with one: the next word is uncertain.
  prompt = jnp.asarray([[9, 8, 10, 4, 3, 11, 9, 5, 8, 3, 5, 8, 10, 4, 6, 3, 8, 11, 7, 10, 3,
                         9, 8, 10, 4, 3, 11, 9, 5, 8]], jnp.int32)
  cache = QuantKVCache.create(config, 1, 64, group=8, residual=8)
  first, cache = prefill_step(state, cache, prompt, jnp.int32(30), DraftPlan.full(L),
                              jax.random.key(0), graphdef=graphdef, sampling=sampling)
  # 4-bit KV and weights alone stay within TV 0.017 of the target, too close for 40k
  # samples to see a wrong acceptance rule; skipping layer 1 as well (QuantSpec over a layer
  # drafter) moves q to TV 0.09, where the test sees each classic bug with power ~1.
  plan = DraftPlan.from_skips(L, [1], [1]).replace(
      kv_bits=4, weights=quant.quantize_mlp_weights(state, L, 32))
  target_cache = cache.settle()  # what verification reads: 24 tokens quantised, 6 buffered
  assert int(target_cache.quantized) == 24
  assert_plan_keeps_the_target_distribution(state, graphdef, config, cache, first[0], plan,
                                            sampling, target_cache=target_cache, vocab=12)


# --- bad input ---------------------------------------------------------------------------------


def test_bad_shapes_and_overflow_are_refused():
  config = tiny_config("llama")  # head_dim 16
  with pytest.raises(QuantError, match="R=20 .* G=8"):
    QuantKVCache.create(config, 1, 256, group=8, residual=20)
  with pytest.raises(QuantError, match="value groups of 5 channels do not divide head_dim 16"):
    QuantKVCache.create(config, 1, 256, group=8, residual=16, value_group=5)
  wide = dataclasses.replace(config, head_dim=24)
  with pytest.raises(QuantError, match="value groups of 16 channels do not divide head_dim 24"):
    QuantKVCache.create(wide, 1, 256, group=16, residual=16)
  with pytest.raises(QuantError, match="value groups of 8 must be 24 or divide 12"):
    QuantKVCache.create(wide, 1, 256, group=16, residual=16, value_group=8, kernel=True)
  with pytest.raises(QuantError, match="does not split into groups of 3"):
    quant.quantize(jnp.ones((8, 4)), 0, 3)
  with pytest.raises(ContextOverflowError):
    QuantKVCache.create(config, 1, config.max_context + 1)
  cache = QuantKVCache.create(config, 1, 32, group=8, residual=8)
  kv = jnp.ones((1, config.num_kv_heads, 30, config.head_dim))
  cache = cache.append([kv] * config.num_layers, [kv] * config.num_layers)
  with pytest.raises(ContextOverflowError, match="30 cached \\+ 5 new tokens exceed"):
    cache.append([kv[:, :, :5]] * config.num_layers, [kv[:, :, :5]] * config.num_layers)
  graphdef, state = nnx.split(init_model(config))
  four_bit = DraftPlan.full(config.num_layers).replace(kv_bits=4)
  with pytest.raises(PlanError, match="kv_bits=4 reads a quantised KV cache"):
    apply(state, KVCache.create(config, 1, 64), jnp.ones((1, 1), jnp.int32),
          jnp.zeros((1, 1), jnp.int32), four_bit, graphdef=graphdef)
  with pytest.raises(PlanError, match="kv_bits must be 4, 8 or 16"):
    DraftPlan.full(3).replace(kv_bits=2).check(3)
  config, graphdef, state = tiny("llama")
  with pytest.raises(ValueError, match="appends gamma \\+ 1 = 5 tokens .* room for 4"):
    speculative_generate(graphdef, state, config, PROMPT, drafter_for("llama"), gamma=4,
                         kv_cache=QuantKV(group=2, residual=4))
  with pytest.raises(ValueError, match="room for 3"):
    speculative_generate(graphdef, state, config, PROMPT, drafter_for("llama"), gamma=4,
                         kv_cache=QuantKV(group=8, residual=16, headroom=3))
  with pytest.raises(QuantError, match="headroom .* must be in \\[1, R=16\\], got 17"):
    QuantKVCache.create(config, 1, 64, group=8, residual=16, headroom=17)


def test_nan_keys_and_values_raise_instead_of_garbage():
  config = tiny_config("llama")
  cache = QuantKVCache.create(config, 1, 64, group=8, residual=8)
  kv = jnp.ones((1, config.num_kv_heads, 4, config.head_dim)).at[0, 0, 2, 3].set(jnp.nan)
  cache = cache.append([kv] * config.num_layers, [kv] * config.num_layers)
  with pytest.raises(QuantError, match="NaN/inf keys or values"):
    cache.check_finite()
  graphdef, state = tiny("llama")[1:]
  bad = jax.tree.map(lambda x: x * jnp.inf if x.ndim == 3 else x, state)  # o weights
  with pytest.raises(QuantError, match="NaN/inf"):
    generate(graphdef, bad, tiny("llama")[0], PROMPT, max_new_tokens=3, kv_cache=KV)
