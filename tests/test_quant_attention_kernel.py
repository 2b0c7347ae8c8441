"""The Pallas flash-decoding kernel over the packed quantised cache (interpret mode on
CPU), and the C++ kernels a CPU reads the codes with: kernel == C++ kernels == jnp
reference == plain softmax attention over the dequantised keys and values plus the
full-precision part, for odd lengths, GQA row counts, both precisions and a sliding
window; and the model's kernel path == its jnp path."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import merge, merge_splits, quant_attention, quant_partials, reference_partials
from pallas_kernels.quant_attention import default_splits, split_for
from specjax import ops, quant
from specjax.config import tiny_config
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.drafters import QuantSpecDrafter
from specjax.model import init_model
from specjax.quant_kv_cache import QuantKV


def case(seed, B=1, K=2, S=64, H=16, G=8, Gv=8, Rq=6, F=9):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  k, v, q = f(B, K, S, H), f(B, K, S, H), f(B, K, Rq, H)
  fp_k, fp_v = f(B, K, F, H), f(B, K, F, H)
  return q, quant.quantize(k, 2, G), quant.quantize(v, 3, Gv), fp_k, fp_v


def dense_attention(q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid, bits, G, Gv,
                    scale, window):
  """Softmax over [dequantised slots < length, valid causal fp keys], written plainly."""
  k = quant.dequantize(hk, 2, G, bits)
  v = quant.dequantize(hv, 3, Gv, bits)
  S = k.shape[2]
  keys = jnp.concatenate([k, fp_k], axis=2)
  vals = jnp.concatenate([v, fp_v], axis=2)
  pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(S), fp_pos.shape[:1] + (S,)), fp_pos], 1)
  ok = jnp.concatenate([jnp.broadcast_to(jnp.arange(S) < length, fp_pos.shape[:1] + (S,)),
                        fp_valid], 1)[:, None, None, :]
  ok = ok & (pos[:, None, None, :] <= q_pos[:, None, :, None])
  if window is not None:
    ok = ok & (q_pos[:, None, :, None] - pos[:, None, None, :] < window)
  s = jnp.einsum("bkrh,bkfh->bkrf", q, keys) * scale
  p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
  return jnp.einsum("bkrf,bkfh->bkrh", p, vals)


@settings(max_examples=12, deadline=None)
@given(bits=st.sampled_from([4, 8]), B=st.integers(1, 2), K=st.integers(1, 3),
       H=st.sampled_from([8, 16, 32]), G=st.sampled_from([4, 8, 16]),
       blocks=st.integers(1, 6), rq=st.integers(1, 9), window=st.sampled_from([None, 5, 40]),
       data=st.data())
def test_kernel_equals_reference_over_drawn_shapes(bits, B, K, H, G, blocks, rq, window,
                                                   data):
  """Batch, kv heads, head dim, key group, cache size, query rows, window, the filled
  length and the tiling all drawn: the kernel's merged partials equal the reference's."""
  S = G * blocks * 2
  gv = data.draw(st.sampled_from([g for g in (4, 8, H) if (H // 2) % g == 0 or g == H]))
  length = data.draw(st.integers(1, S))
  block = data.draw(st.sampled_from([b for b in (G, 2 * G) if S % b == 0]))
  splits = data.draw(st.integers(1, 4))
  q, hk, hv, _, _ = case(length + 31 * S, B=B, K=K, S=S, H=H, G=G, Gv=gv, Rq=rq)
  q_pos = jnp.asarray(np.broadcast_to(length + np.arange(rq) % 5, (B, rq)), jnp.int32)
  kw = dict(bits=bits, group=G, value_group=gv, scale=H ** -0.5, window=window)
  o, m, l = quant_partials(q, q_pos, length, hk, hv, block=block, splits=splits,
                           interpret=True, **kw)
  ro, rm, rl = reference_partials(q, q_pos, length, hk, hv, **kw)
  np.testing.assert_allclose(merge([merge_splits(o, m, l)]),
                             merge([(ro[:, :, 0], rm[:, :, 0], rl[:, :, 0])]), atol=5e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("length,rq,window,gv", [
    (37, 6, None, 8), (1, 1, None, 8), (64, 8, None, 8), (53, 4, 20, 8), (29, 3, None, 8),
    (37, 7, None, 16),  # one value group spans both nibble planes (Qwen: Gv = H = 64)
    (45, 5, None, 4)])  # two value groups per plane
def test_kernel_equals_reference_equals_dense(bits, length, rq, window, gv):
  q, hk, hv, fp_k, fp_v = case(length * 7 + bits, Rq=rq, Gv=gv)
  F = fp_k.shape[2]
  fp_pos = jnp.asarray([length + np.arange(F)], jnp.int32)
  fp_valid = jnp.asarray([np.arange(F) < 7])  # an odd number of buffered tokens
  q_pos = jnp.asarray([length + np.arange(rq) % 7], jnp.int32)  # queries among them
  kw = dict(bits=bits, group=8, value_group=gv, scale=0.3, window=window)
  o, m, l = quant_partials(q, q_pos, length, hk, hv, block=16, splits=3, interpret=True, **kw)
  ro, rm, rl = reference_partials(q, q_pos, length, hk, hv, **kw)
  kernel = merge([merge_splits(o, m, l)])
  unrolled = merge([(o[:, :, s], m[:, :, s], l[:, :, s]) for s in range(o.shape[2])])
  np.testing.assert_allclose(kernel, unrolled, atol=1e-6)
  ref = merge([(ro[:, :, 0], rm[:, :, 0], rl[:, :, 0])])
  np.testing.assert_allclose(kernel, ref, atol=2e-6)
  full = quant_attention(q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid,
                         block=16, splits=3, interpret=True, **kw)
  want = dense_attention(q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid, bits, 8, gv,
                         0.3, window)
  np.testing.assert_allclose(full, want, atol=2e-6)
  jnp_path = quant_attention(q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid,
                             use_kernel=False, **kw)
  np.testing.assert_allclose(jnp_path, want, atol=2e-6)
  cpu_path = ops.quant_attention(q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid,
                                 cpu=True, **kw)  # the C++ kernel
  np.testing.assert_allclose(cpu_path, want, atol=2e-6)
  pallas_path = ops.quant_attention(q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid,
                                    **kw)  # the Pallas kernel, interpreted on a CPU
  np.testing.assert_allclose(pallas_path, want, atol=2e-6)
  np.testing.assert_allclose(cpu_path, want, atol=2e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("H,gv", [(64, 64), (128, 64), (128, 32)])
def test_cpu_kernels_at_the_head_dims_they_fix_at_compile_time(bits, H, gv):
  """The C++ kernels' variants for H = 64 and 128 (the test above runs H = 16, the
  runtime-H variant): equal to attention over the dequantised cache."""
  length, rq = 45, 7
  q, hk, hv, fp_k, fp_v = case(H + bits, S=64, H=H, G=8, Gv=gv, Rq=rq)
  F = fp_k.shape[2]
  fp_pos = jnp.asarray([length + np.arange(F)], jnp.int32)
  fp_valid = jnp.asarray([np.arange(F) < 5])
  q_pos = jnp.asarray([length + np.arange(rq) % 5], jnp.int32)
  kw = dict(bits=bits, group=8, value_group=gv, scale=0.2, window=None)
  got = ops.quant_attention(q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid, cpu=True,
                            **kw)
  want = dense_attention(q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid, bits, 8, gv,
                         0.2, None)
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("window", [None, 300])
def test_cpu_kernels_split_a_long_context_into_spans_and_threads(bits, window):
  """Past 512 slots the C++ kernel splits each kv head's slots into spans of whole key
  groups, runs them on XLA's threads once a call has enough work, and merges the spans'
  softmax partials in span order: still attention over the dequantised cache, and the same
  bits twice. A window of 300 leaves the first span unseen by every row and cuts the
  second inside a key group."""
  length, rq, H = 1100, 7, 64  # three spans of 512, the last partial, in 9 key groups
  q, hk, hv, fp_k, fp_v = case(bits, K=2, S=1152, H=H, G=128, Gv=64, Rq=rq)
  F = fp_k.shape[2]
  fp_pos = jnp.asarray([length + np.arange(F)], jnp.int32)
  fp_valid = jnp.asarray([np.arange(F) < 5])
  q_pos = jnp.asarray([length + np.arange(rq) % 5], jnp.int32)
  kw = dict(bits=bits, group=128, value_group=64, scale=0.125, window=window)
  run = jax.jit(lambda *a: ops.quant_attention(*a, cpu=True, **kw))
  args = (q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid)
  got = run(*args)
  want = dense_attention(*args, bits, 128, 64, 0.125, window)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert np.array_equal(np.asarray(run(*args)), np.asarray(got))


def test_cpu_kernel_refuses_codes_of_other_heads():
  """A layer's codes with other kv heads than q's (or a batch of another size) would be
  read at the wrong heads, or past their end: the kernel refuses the call and names the
  shapes it expects."""
  q, hk, hv, *_ = case(7, K=2)
  two = jnp.concatenate([q, q])  # a batch of two against one sequence's codes
  for q_, rows in ((q[:, :1], 1), (two, 2)):
    with pytest.raises(Exception, match=r"quant_attention: q\[B, K, R, H\]"):
      jax.block_until_ready(ops.quant_partials_cpu(q_, jnp.zeros((rows, 6), jnp.int32), 10,
                                                   hk, hv, bits=8, scale=0.3))


@pytest.mark.parametrize("length,window", [(0, None), (40, 3)])
def test_cpu_kernel_rows_that_see_no_quantised_slot_weigh_it_nothing(length, window):
  """No quantised slot at all, or none inside the window of any row: the codes' partial
  (m masked, l = 0) leaves attention over the full-precision tokens alone."""
  q, hk, hv, fp_k, fp_v = case(5, Rq=4)
  F = fp_k.shape[2]
  fp_pos = jnp.asarray([length + np.arange(F)], jnp.int32)
  fp_valid = jnp.asarray([np.arange(F) < 6])
  q_pos = jnp.asarray([length + 2 + np.arange(4)], jnp.int32)  # slot length − 1 outside 3
  kw = dict(bits=8, group=8, value_group=8, scale=0.3, window=window)
  args = (q, q_pos, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid)
  o, m, l = ops.quant_partials_cpu(q, q_pos, length, hk, hv, bits=8, scale=0.3, window=window)
  assert float(jnp.abs(l).max()) == 0.0 and float(jnp.abs(o).max()) == 0.0
  np.testing.assert_allclose(ops.quant_attention(*args, cpu=True, **kw),
                             dense_attention(*args, 8, 8, 8, 0.3, window), atol=2e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,gv,window", [(7, 64, None), (35, 64, None), (2, 32, 512)])
def test_kernel_lowers_to_triton_for_cuda(bits, rows, gv, window):
  """No GPU in CI, but the Triton lowering is Python: lowering for the CUDA platform on a
  CPU host builds the kernel's Triton IR and fails on what Triton cannot express
  (non-power-of-two tensors, value slicing). Shapes of Qwen2.5-0.5B: 7 query rows per kv
  head at decode, 35 when verifying γ = 4, head dim 64."""
  K, H, S = 2, 64, 4096
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.normal(size=(1, K, S, H)), jnp.float32)
  hk, hv = quant.quantize(k, 2, 128), quant.quantize(k, 3, gv)
  q = jnp.zeros((1, K, rows, H), jnp.float32)
  q_pos = jnp.zeros((1, rows), jnp.int32)
  fn = jax.jit(lambda q, q_pos, hk, hv: quant_partials(
      q, q_pos, 1000, hk, hv, bits=bits, group=128, value_group=gv, scale=0.125,
      window=window))
  # From jax 0.11 the Triton lowering asks the device for its compute capability; on a
  # CPU host an abstract mesh names the GPU it lowers for (jax 0.10 ignores it).
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=h100)):
    text = fn.trace(q, q_pos, hk, hv).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text and f"quant_decode_attention_int{bits}" in text


def test_default_splits_fill_the_grid_but_never_split_a_key_group():
  # Qwen2.5-0.5B decoding (B = 1, K = 2): the tilings measured fastest on an H100.
  assert [default_splits(1, 2, S, 128) for S in (4096, 16384, 32768, 131072)] == [
      32, 128, 256, 256]
  assert default_splits(8, 8, 131072, 128) == 8  # a wide batch needs few splits
  assert default_splits(1, 2, 100, 128) == 1  # shorter than a group: one program per head
  for B, K, S in [(1, 1, 96), (3, 2, 4096), (1, 4, 1 << 17)]:
    block, splits = split_for(S, 32, 256, default_splits(B, K, S, 32))
    assert S % splits == 0 and (S // splits) % block == 0 and block % 32 == 0


def test_empty_splits_contribute_nothing():
  q, hk, hv, *_ = case(3)
  o, m, l = quant_partials(q, jnp.zeros((1, 6), jnp.int32), 10, hk, hv, bits=8, group=8,
                           value_group=8, scale=0.3, block=8, splits=4, interpret=True)
  assert o.shape[2] == 4
  assert float(jnp.abs(l[:, :, 1:]).max()) == 0.0 and float(jnp.abs(o[:, :, 1:]).max()) == 0.0


def test_model_kernel_path_matches_jnp_path_and_stays_lossless():
  config = tiny_config("gemma3", num_layers=3, vocab_size=97)  # sliding-window layers too
  graphdef, state = nnx.split(init_model(config, seed=1))
  prompt = list(range(3, 45))
  plain = QuantKV(group=8, residual=16)
  kernel = QuantKV(group=8, residual=16, kernel=True)
  a = generate(graphdef, state, config, prompt, max_new_tokens=40, eos_ids=(), kv_cache=plain)
  b = generate(graphdef, state, config, prompt, max_new_tokens=40, eos_ids=(), kv_cache=kernel)
  assert a.tokens == b.tokens
  model = types.SimpleNamespace(graphdef=graphdef, state=state, config=config)
  d = QuantSpecDrafter.for_model(model, weight_group=32, kv_cache=kernel)
  out = speculative_generate(graphdef, state, config, prompt, d, max_new_tokens=40, gamma=4,
                             eos_ids=())
  assert out.tokens == b.tokens


def test_cpu_kernels_fold_a_vmap_over_queries_into_rows():
  """Rounds vmapped over sampling keys share one cache layer: a vmap over the queries (and
  their positions) alone becomes more query rows of one kernel call; with the lengths
  batched too, a call per element. All equal attention over the dequantised cache."""
  length, rq, A = 37, 3, 5
  q, hk, hv, fp_k, fp_v = case(11, Rq=rq)
  qs = jnp.stack([q * (1.0 + 0.2 * i) for i in range(A)])
  F = fp_k.shape[2]
  fp_pos = jnp.asarray([length + np.arange(F)], jnp.int32)
  fp_valid = jnp.asarray([np.arange(F) < 7])
  q_pos = jnp.asarray([length + np.arange(rq) % 7], jnp.int32)
  kw = dict(bits=4, group=8, value_group=8, scale=0.3, window=None)
  attend = lambda q, n: ops.quant_attention(q, q_pos, n, hk, hv, fp_k, fp_v, fp_pos,
                                            fp_valid, cpu=True, **kw)
  want = lambda q, n: dense_attention(q, q_pos, n, hk, hv, fp_k, fp_v, fp_pos, fp_valid, 4, 8,
                                      8, 0.3, None)
  folded = jax.jit(jax.vmap(lambda q: attend(q, length)))
  np.testing.assert_allclose(folded(qs), jnp.stack([want(q, length) for q in qs]), atol=2e-6)
  hlo = folded.lower(qs).compile().as_text()
  assert hlo.count("specjax_quant_partials") == 1 and "while" not in hlo
  moved = jnp.stack([q_pos + i for i in range(A)])  # rounds at different positions
  windowed = dict(kw, window=30)
  at = lambda q, p: ops.quant_attention(q, p, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid,
                                        cpu=True, **windowed)
  folded = jax.jit(jax.vmap(at))
  want_at = lambda q, p: dense_attention(q, p, length, hk, hv, fp_k, fp_v, fp_pos, fp_valid,
                                         4, 8, 8, 0.3, 30)
  np.testing.assert_allclose(folded(qs, moved),
                             jnp.stack([want_at(q, p) for q, p in zip(qs, moved)]), atol=2e-6)
  assert folded.lower(qs, moved).compile().as_text().count("specjax_quant_partials") == 1
  lengths = jnp.asarray([37, 20, 5, 1, 30])
  each = jax.jit(jax.vmap(attend))(qs, lengths)
  np.testing.assert_allclose(each, jnp.stack([want(q, int(n)) for q, n in zip(qs, lengths)]),
                             atol=2e-6)


def test_bench_quant_steps_times_steps_and_kernels(monkeypatch, capsys):
  """experiments/bench_quant_steps.py on a tiny model past its quantised buffer: every
  step on both caches, QuantSpec's two drafts and the kernels alone, timed; one JSON line
  at the end."""
  import json
  import sys

  from experiments import bench_quant_steps

  monkeypatch.setattr(sys, "argv", ["bench_quant_steps.py", "--model", "tiny-llama",
                                    "--contexts", "300", "--repeats", "2"])
  bench_quant_steps.main()
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  row = figures["contexts"]["300"]
  assert row["quantized"] > 0
  assert len(row["steps_ms"]) == 6 and all(t > 0 for t in row["steps_ms"].values())
  assert row["over_fp_ar"]["AR, float32 cache"] == 1.0
  assert len(row["kernels_ms"]) == 6 and all(t > 0 for t in row["kernels_ms"].values())
