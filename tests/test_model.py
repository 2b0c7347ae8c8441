"""The decoder under draft plans: equals a plain reference, skips for real, never recompiles."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_forward

from specjax.config import tiny_config
from specjax.kv_cache import KVCache
from specjax.model import apply, init_model
from specjax.plan import DraftPlan

T = 12

_apply = jax.jit(apply, static_argnames=("graphdef", "logits", "return_residuals"))


def run(config, graphdef, state, tokens, plan, **kw):
  B, T = tokens.shape
  cache = KVCache.create(config, B, 32)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  return _apply(state, cache, tokens, pos, plan, graphdef=graphdef, **kw)


def tokens_for(config, B=2, seed=0):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, config.vocab_size)


def test_full_plan_equals_reference(tiny):
  config, graphdef, state = tiny
  toks = tokens_for(config)
  out, cache = run(config, graphdef, state, toks, DraftPlan.full(config.num_layers))
  ref, _ = reference_forward(nnx.merge(graphdef, state), toks)
  np.testing.assert_allclose(out.logits, ref, atol=2e-4, rtol=2e-4)
  assert int(cache.length) == T


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_plan_equals_reference_that_skips_the_same_sublayers(data):
  arch = data.draw(st.sampled_from(["llama", "qwen2", "qwen3", "gemma3"]))
  config = tiny_config(arch)
  L = config.num_layers
  attn = data.draw(st.lists(st.booleans(), min_size=L, max_size=L))
  mlp = data.draw(st.lists(st.booleans(), min_size=L, max_size=L))
  graphdef, state = _tiny_split(arch)
  toks = tokens_for(config, B=1, seed=L)
  out, _ = run(config, graphdef, state, toks, DraftPlan.from_masks(attn, mlp),
               return_residuals=True)
  ref, ref_res = reference_forward(nnx.merge(graphdef, state), toks, attn, mlp)
  np.testing.assert_allclose(out.logits, ref, atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(out.residuals, jnp.stack(ref_res), atol=2e-4, rtol=2e-4)


@functools.cache
def _tiny_split(arch):
  return nnx.split(init_model(tiny_config(arch), seed=3))


def test_residuals_cover_every_sublayer(tiny):
  config, graphdef, state = tiny
  toks = tokens_for(config)
  out, _ = run(config, graphdef, state, toks, DraftPlan.full(config.num_layers),
               return_residuals=True)
  assert out.residuals.shape == (2 * config.num_layers, 2, T, config.embed_dim)
  np.testing.assert_array_equal(out.residuals[-1], out.hidden)


def test_skipping_everything_leaves_the_embedding():
  config = tiny_config("llama")
  graphdef, state = _tiny_split("llama")
  toks = tokens_for(config)
  L = config.num_layers
  none = DraftPlan.from_masks([False] * L, [False] * L)
  out, _ = run(config, graphdef, state, toks, none, logits="none")
  np.testing.assert_array_equal(out.hidden, nnx.merge(graphdef, state).embed(toks))
  assert out.logits is None


def test_incremental_decoding_equals_one_pass(tiny):
  """Prefill, then one token at a time through the cache == the whole sequence at once.

  The tiny gemma3 has a sliding window of 8 < T, so the window mask is exercised.
  """
  config, graphdef, state = tiny
  toks = tokens_for(config, B=1, seed=7)
  plan = DraftPlan.full(config.num_layers)
  ref, _ = reference_forward(nnx.merge(graphdef, state), toks)
  cache = KVCache.create(config, 1, 32)
  logits = []
  for start, stop in [(0, 5)] + [(t, t + 1) for t in range(5, T)]:
    pos = jnp.arange(start, stop)[None]
    out, cache = _apply(state, cache, toks[:, start:stop], pos, plan, graphdef=graphdef)
    logits.append(out.logits)
  np.testing.assert_allclose(jnp.concatenate(logits, 1), ref, atol=2e-4, rtol=2e-4)


@settings(max_examples=25, deadline=None)
@given(width=st.integers(1, 2100), rows=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_tree_sum_sums_a_row_to_the_same_bits_alone_or_among_others(width, rows, seed):
  """`tree_sum` (the RMS norms' mean of squares) is a sum over the last axis, and a row's
  bits do not depend on the rows that come with it (XLA's reduce gave 896-wide rows other
  bits alone than among five)."""
  from specjax.model import tree_sum

  x = np.random.default_rng(seed).normal(size=(rows, width)).astype(np.float32)
  total = jax.jit(tree_sum)
  got = np.asarray(total(x))
  assert got.shape == (rows, 1)
  np.testing.assert_allclose(got, x.astype(np.float64).sum(-1, keepdims=True), rtol=1e-5,
                             atol=1e-5 * width)
  np.testing.assert_array_equal(np.asarray(total(x[1:2])), got[1:2])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_verification_gives_the_ar_steps_logits_bit_for_bit(arch):
  """Five tokens in one forward after a prefill == the same five as T = 1 steps, bit for
  bit, on a CPU with the C++ kernels: a greedy verification takes AR's tokens even on a
  near tie (`test_real_ssd.py` holds it on SmolLM2). Not gemma3 yet: with its embedding
  scale and post-norms, XLA's fusions at T = 1 and T = 5 still differ in the last bits."""
  from specjax import cpu_kernels

  if jax.default_backend() != "cpu" or not all(
      cpu_kernels.runs_here(k) for k in ("f32_matmul", "f32_attention")):
    pytest.skip("the bit-exact rows are the CPU kernels' property")
  config = tiny_config(arch)
  graphdef, state = nnx.split(init_model(config, seed=1))
  plan = DraftPlan.full(config.num_layers)
  toks = tokens_for(config, B=1, seed=3)
  _, cache = _apply(state, KVCache.create(config, 1, 32), toks[:, :7], jnp.arange(7)[None],
                    plan, graphdef=graphdef)
  rows, _ = _apply(state, cache, toks[:, 7:], jnp.arange(7, T)[None], plan, graphdef=graphdef)
  steps = []
  for t in range(7, T):
    out, cache = _apply(state, cache, toks[:, t:t + 1], jnp.asarray([[t]]), plan,
                        graphdef=graphdef)
    steps.append(out.logits)
  np.testing.assert_array_equal(np.asarray(rows.logits), np.concatenate(steps, axis=1))


def test_rollback_by_length_then_rewrite(tiny):
  """Setting the length back and processing other tokens gives what a fresh cache gives."""
  config, graphdef, state = tiny
  toks = tokens_for(config, B=1, seed=11)
  other = (toks + 1) % config.vocab_size
  plan = DraftPlan.full(config.num_layers)
  pos = lambda a, b: jnp.arange(a, b)[None]
  cache = KVCache.create(config, 1, 32)
  _, cache = _apply(state, cache, toks[:, :6], pos(0, 6), plan, graphdef=graphdef)
  _, cache = _apply(state, cache, toks[:, 6:], pos(6, T), plan, graphdef=graphdef)
  cache = cache.with_length(6)  # reject everything after position 5
  out, _ = _apply(state, cache, other[:, 6:], pos(6, T), plan, graphdef=graphdef)
  fresh = jnp.concatenate([toks[:, :6], other[:, 6:]], axis=1)
  ref, _ = reference_forward(nnx.merge(graphdef, state), fresh)
  np.testing.assert_allclose(out.logits, ref[:, 6:], atol=2e-4, rtol=2e-4)


def test_skipped_attention_keeps_the_cache_rows():
  """A draft that skips layer l's attention leaves layer l's cache slots as they were."""
  config = tiny_config("qwen3")
  graphdef, state = _tiny_split("qwen3")
  L = config.num_layers
  cache = KVCache.create(config, 1, 32)
  cache = cache.replace(k=tuple(k + 7.0 for k in cache.k))
  plan = DraftPlan.from_skips(L, skip_attn=[1, 2])
  toks = tokens_for(config, B=1)
  _, new = _apply(state, cache, toks, jnp.arange(T)[None], plan, graphdef=graphdef)
  for l in range(L):
    changed = not np.allclose(new.k[l][:, :, :T], 7.0)
    assert changed == (l not in (1, 2))


def test_new_plan_values_compile_nothing():
  config = tiny_config("gemma3")
  graphdef, state = _tiny_split("gemma3")
  L = config.num_layers
  f = jax.jit(lambda *args: apply(*args, graphdef=graphdef))  # a fresh executable cache
  toks = tokens_for(config, B=1)
  pos = jnp.arange(T)[None]
  rng = np.random.default_rng(0)
  for _ in range(5):
    plan = DraftPlan.from_masks(rng.random(L) < 0.5, rng.random(L) < 0.5)
    f(state, KVCache.create(config, 1, 32), toks, pos, plan)
  assert f._cache_size() == 1


def test_every_sublayer_of_a_draft_plan_is_a_conditional_and_a_dense_plan_has_none():
  """Skipping is real: every sub-layer of a (traced) draft plan compiles to conditionals
  (attention: write, read), even when it runs them all; the dense plan of the AR step and
  verification compiles to none (a GPU would sync with the host on each)."""
  config = tiny_config("llama")
  graphdef, state = _tiny_split("llama")
  toks = tokens_for(config, B=1)
  L = config.num_layers

  def count(plan):
    return _apply.lower(state, KVCache.create(config, 1, 32), toks, jnp.arange(T)[None], plan,
                        graphdef=graphdef).compile().as_text().count(" conditional(")

  assert count(DraftPlan.from_skips(L)) == 3 * L
  assert count(DraftPlan.full(L)) == 0


def test_a_draft_step_has_one_conditional_per_sub_layer():
  """A draft writes its K/V to its buffer, not the cache: each attention sub-layer is one
  conditional (projection and attention together), not the two of a cache writer."""
  from specjax.decode.round import draft_step
  from specjax.sampling import SamplingParams

  config = tiny_config("llama")
  graphdef, state = _tiny_split("llama")
  L = config.num_layers
  hlo = draft_step.lower(state, KVCache.create(config, 1, 32).with_length(T), jnp.int32(1),
                         DraftPlan.from_skips(L), jax.random.key(0), jnp.int32(2),
                         graphdef=graphdef, vocab=config.vocab_size, gamma=3, threshold=0.0,
                         sampling=SamplingParams()).compile().as_text()
  assert hlo.count(" conditional(") == 2 * L


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_forward_computes_each_rope_base_angles_once(arch):
  """The rotary cos and sin are computed once per forward and base (gemma3 has two), not
  once per layer, nor once per rotated element inside each layer's fusion."""
  config = tiny_config(arch)
  graphdef, state = _tiny_split(arch)
  toks = tokens_for(config, B=1)
  bases = {config.layer_rope_base(l) for l in range(config.num_layers)}
  for plan in (DraftPlan.full(config.num_layers), DraftPlan.from_skips(config.num_layers)):
    hlo = _apply.lower(state, KVCache.create(config, 1, 32), toks, jnp.arange(T)[None], plan,
                       graphdef=graphdef).compile().as_text()
    assert hlo.count(" cosine(") == hlo.count(" sine(") == len(bases) < config.num_layers


@pytest.mark.parametrize("dtype", ["mixed", "bfloat16"])
def test_float32_activations_ask_every_dot_for_float32_arithmetic(dtype):
  """`mixed` (bfloat16 weights, float32 activations) lowers every dot of a forward, draft
  plans' conditional branches included, with HIGHEST precision: JAX's default would let
  a GPU run them in TF32 and break mixed's token-exactness. bfloat16 keeps the default."""
  from specjax.models.loader import at_precision

  config, graphdef, state = at_precision(tiny_config("llama"), _tiny_split("llama")[1], dtype)
  toks = jnp.zeros((1, 20), jnp.int32)  # 20 rows: XLA dots, not the CPU few-row kernel
  L = config.num_layers
  cache = KVCache.create(config, 1, 32, dtype=config.activation_dtype or jnp.bfloat16)
  for plan in (DraftPlan.full(L), DraftPlan.from_skips(L, skip_attn=[0], skip_mlp=[1])):
    with jax.default_matmul_precision(None):  # JAX's default, not the suite's (conftest)
      hlo = _apply.lower(state, cache, toks, jnp.arange(20)[None], plan,
                         graphdef=graphdef).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) >= 4 * L  # q/k/v, scores, values, o, MLP, per layer
    highest = [d for d in dots if "precision = [HIGHEST, HIGHEST]" in d]
    assert len(highest) == (len(dots) if dtype == "mixed" else 0)


def test_decode_step_writes_the_cache_in_place():
  """The donated cache aliases the output (the step updates it in place)."""
  from specjax.decode.generate import decode_step
  from specjax.sampling import SamplingParams

  config = tiny_config("gemma3")
  graphdef, state = _tiny_split("gemma3")
  cache = KVCache.create(config, 1, 128)
  hlo = decode_step.lower(
      state, cache, jnp.ones((1,), jnp.int32), DraftPlan.full(config.num_layers),
      jax.random.key(0), graphdef=graphdef, sampling=SamplingParams(),
  ).compile().as_text()
  assert _layer_copies(hlo, config, 128) == []
  aliases = hlo.split("input_output_alias={", 1)[1].split("}\n", 1)[0]
  assert aliases.count("may-alias") + aliases.count("must-alias") >= 2 * config.num_layers


def test_a_decode_step_reads_every_weight_where_it_lies():
  """On a CPU each layer's matmuls are kernel calls on the weights as stored: qkv and
  gate_up output-major ([(N + 2K)·H, D] and [2F, D], the layout the few-row kernel streams
  fastest), and no weight is copied or transposed into another layout first."""
  from specjax import cpu_kernels
  from specjax.decode.generate import decode_step
  from specjax.sampling import SamplingParams

  if cpu_kernels.kernel_status("f32_matmul") != "ready":
    pytest.skip(f"f32_matmul: {cpu_kernels.kernel_status('f32_matmul')}")
  config = tiny_config("llama")
  graphdef, state = _tiny_split("llama")
  L, D, F = config.num_layers, config.embed_dim, config.hidden_dim
  QKV = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
  assert state["blocks"][0]["mlp"]["gate_up"].shape == (2 * F, D)
  assert state["blocks"][0]["attn"]["qkv"].shape == (QKV, D)
  hlo = decode_step.lower(
      state, KVCache.create(config, 1, 32), jnp.ones((1,), jnp.int32),
      DraftPlan.full(L), jax.random.key(0), graphdef=graphdef, sampling=SamplingParams(),
  ).compile().as_text()
  output_major = [line for line in hlo.splitlines()
                  if 'custom_call_target="specjax_f32_matmul_oi"' in line]
  for rows in (2 * F, QKV):
    calls = [line for line in output_major if f"f32[{rows},{D}]" in line]
    assert len(calls) == L, (rows, calls)
  assert copies_of(hlo, _weight_layouts(state)) == []


def test_a_prefill_at_real_shapes_reads_every_weight_where_it_lies():
  """XLA's dots of a prompt's rows read the weights as stored too, output-major ones
  included, at the shapes of SmolLM2 and Qwen2.5-0.5B (one layer each, a small vocabulary;
  lowered from abstract shapes, nothing allocated). A tiny model's would not: under the
  suite's single-threaded Eigen, XLA:CPU copies a [128, 64] qkv to [64, 128] first (a
  [256, 64] gate_up it reads in place; with multi-threaded Eigen it reads both in place)."""
  import dataclasses

  from specjax.decode.generate import prefill_step
  from specjax.models.params import abstract_model
  from specjax.sampling import SamplingParams

  for family, shape in (("llama", dict(embed_dim=576, num_heads=9, num_kv_heads=3,
                                        head_dim=64, hidden_dim=1536)),
                        ("qwen2", dict(embed_dim=896, num_heads=14, num_kv_heads=2,
                                       head_dim=64, hidden_dim=4864))):
    config = dataclasses.replace(tiny_config(family, num_layers=1), **shape)
    graphdef, state = abstract_model(config)
    hlo = prefill_step.lower(
        state, KVCache.create(config, 1, 64), jnp.ones((1, 32), jnp.int32), jnp.int32(9),
        DraftPlan.full(1), jax.random.key(0), graphdef=graphdef, sampling=SamplingParams(),
    ).compile().as_text()
    assert copies_of(hlo, _weight_layouts(state)) == [], family


def _weight_layouts(state) -> set[tuple[str, tuple[int, ...]]]:
  """Every block matrix's shape in any order of its axes: a copy into another layout."""
  import itertools

  return {("f32", dims) for w in jax.tree.leaves(state["blocks"]) if len(w.shape) >= 2
          for dims in itertools.permutations(w.shape)}


def _layer_copies(hlo: str, config, size: int) -> list[str]:
  """Instructions producing a whole float32 layer of a `KVCache` of `size` slots by copy or
  transpose, in any layout (`copies_of`)."""
  K, H = config.num_kv_heads, config.head_dim
  layer = {(1, K, size, H), (1, size, K, H), (K, size, H), (size, K, H), (1, K, H, size),
           (K, H, size)}
  return copies_of(hlo, {("f32", dims) for dims in layer})


def copies_of(hlo: str, shapes: set[tuple[str, tuple[int, ...]]]) -> list[str]:
  """Instructions producing an array of one of `shapes` ((dtype, dims) pairs) by copy or
  transpose.

  A fusion whose root is the in-place dynamic-update-slice may be named after the small
  copy it fuses (the new rows' transpose): that one writes in place and is not listed."""
  import re

  found = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(", line)
    if m and (m.group(2), tuple(int(d) for d in m.group(3).split(",") if d)) in shapes:
      name, op = m.group(1), m.group(4)
      fused_copy = op == "fusion" and name.startswith(("copy", "transp")) and \
          "dynamic-update-slice" not in name
      if op in ("copy", "transpose") or fused_copy:
        found.append(line.strip()[:120])
  return found


def test_no_step_or_round_copies_any_cache_layer():
  """Prefill, AR step, draft and verification: no executable copies or transposes a cache
  layer (writes are in place, the draft only reads), in greedy and in sampling mode."""
  from specjax.decode.generate import decode_step, prefill_step
  from specjax.decode.round import draft_fn, draft_step, verify_step
  from specjax.sampling import SamplingParams

  config = tiny_config("gemma3")
  graphdef, state = _tiny_split("gemma3")
  cache = KVCache.create(config, 1, 512)  # prefixes of 256, 512; S != the prefill's G·T rows
  plan, key, last = DraftPlan.full(config.num_layers), jax.random.key(0), jnp.int32(1)
  for sampling in (SamplingParams(), SamplingParams(1.0, 0.9)):
    step = decode_step.lower(state, cache, jnp.ones((1,), jnp.int32), plan, key,
                             graphdef=graphdef, sampling=sampling).compile().as_text()
    static = dict(graphdef=graphdef, vocab=config.vocab_size, gamma=4, threshold=0.8,
                  sampling=sampling)
    limit = jnp.int32(4)
    draft = draft_step.lower(state, cache, last, plan, key, limit, **static).compile().as_text()
    proto = jax.eval_shape(functools.partial(draft_fn, **static), state, cache, last, plan, key,
                           limit)
    verify = verify_step.lower(state, cache, last, proto, plan, key, graphdef=graphdef,
                               sampling=sampling).compile().as_text()
    prefill = prefill_step.lower(state, cache, jnp.ones((1, 64), jnp.int32), jnp.int32(9), plan,
                                 key, graphdef=graphdef, sampling=sampling).compile().as_text()
    for hlo in (step, draft, verify, prefill):
      assert _layer_copies(hlo, config, 512) == []


@pytest.mark.parametrize("filled", [0, 200, 256, 257, 400])
def test_attention_reads_a_filled_prefix_of_a_large_cache_exactly(filled):
  """On a CPU a step over a cache of S >= 512 slots reads the shortest prefix (S/8 .. S,
  at least 256) that holds the context: its output equals the same step over a small
  cache (read whole), on both sides of a prefix boundary, writing and drafting."""
  from specjax.kv_cache import DraftBuffer

  config = tiny_config("qwen2")
  graphdef, state = _tiny_split("qwen2")
  L = config.num_layers
  n = filled + 3
  toks = jax.random.randint(jax.random.key(filled), (1, n), 0, config.vocab_size)
  pos = jnp.arange(n)[None]

  def last_logits(size, plan, buffer=None):
    cache = KVCache.create(config, 1, size)
    if filled:
      _, cache = _apply(state, cache, toks[:, :filled], pos[:, :filled], DraftPlan.full(L),
                        graphdef=graphdef, logits="none")
    out, _ = _apply(state, cache, toks[:, filled:], pos[:, filled:], plan, graphdef=graphdef,
                    logits="all", **({} if buffer is None else {"buffer": buffer}))
    return np.asarray(out.logits)

  small = -(-(n + 1) // 64) * 64  # read whole: below two minimal prefixes
  for plan in (DraftPlan.full(L), DraftPlan.from_skips(L, [1], [0])):
    np.testing.assert_allclose(last_logits(512, plan), last_logits(small, plan),
                               rtol=1e-5, atol=1e-5)
  big = KVCache.create(config, 1, 512)
  np.testing.assert_allclose(
      last_logits(512, DraftPlan.from_skips(L, [1]), DraftBuffer.like(big, 4)),
      last_logits(small, DraftPlan.from_skips(L, [1]),
                  DraftBuffer.like(KVCache.create(config, 1, small), 4)), rtol=1e-5, atol=1e-5)
