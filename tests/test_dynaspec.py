"""DynaSpec: balanced spherical k-means invariants, training pairs that are the target's
own distributions, a router whose optax training lowers validation loss, a bit-exact
checkpoint, lossless drafting (alone, with a static core and on a layer drafter), and clear
errors for k > M, a router of another model and a router of an older design."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from targets import (
  assert_exercised,
  assert_round_distribution,
  sample_rounds,
  target,
  target_probs,
)

from specjax.config import tiny_config
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate, positions_for, prefill_step
from specjax.decode.round import draft_step, round_fn, shortlist_rows
from specjax.drafters import DynaSpecDrafter, EarlyExitDrafter
from specjax.kv_cache import KVCache
from specjax.model import apply, init_model
from specjax.offline.router import (
  RouterBundle,
  RouterMismatchError,
  collect_pairs,
  is_current,
  k_schedule,
  load_bundle,
  recall_at,
  save_bundle,
  train_router,
)
from specjax.offline.vocab_clusters import balanced_assignment, spherical_kmeans
from specjax.plan import DraftPlan, PlanError
from specjax.sampling import SamplingParams

V = 97
PROMPT = list(range(3, 40))


def core_ids(config, size: int = 12) -> np.ndarray:
  """A static core for the tiny models: EOS, then the lowest ids (what a frequency list
  would give is irrelevant to the mechanics)."""
  eos = list(config.eos_ids)
  return np.asarray(eos + [t for t in range(V) if t not in eos][: size - len(eos)])


def session_of(m):
  return type("S", (), {"config": m.config})()


@functools.cache
def tiny(arch: str = "llama"):
  config, graphdef, state = target(arch, 4, V)

  class M:
    name = f"tiny-{arch}"

  m = M()
  m.config, m.graphdef, m.state = config, graphdef, state
  return m


@functools.cache
def bundle(arch: str = "llama", k_max: int = 3, inputs: str = "embed_prev"
           ) -> tuple[RouterBundle, object]:
  """A router trained on the tiny model's own continuations; `inputs` the paper's
  [E(x_t), h̃_{t−1}] by default."""
  m = tiny(arch)
  rows = np.asarray(nnx.merge(m.graphdef, m.state).embedding[...])
  clusters = spherical_kmeans(rows, 8, iterations=10)
  rng = np.random.default_rng(0)
  seqs = []
  for i in range(24):  # random prompts and the model's own continuations of them
    prompt = rng.integers(1, V, 12).tolist()
    g = generate(m.graphdef, m.state, m.config, prompt, max_new_tokens=20, eos_ids=())
    seqs.append(prompt + g.tokens)
  pairs = collect_pairs(m, seqs, clusters, verbose=False)
  result = train_router(pairs, clusters, k_max=k_max, hidden=64, inputs=inputs, epochs=6,
                        batch=32, verbose=False)
  return RouterBundle(m.name, result.router, clusters, k_max, 64), (result, pairs)


def test_kmeans_invariants_on_clustered_vectors():
  rng = np.random.default_rng(1)
  centres = rng.normal(size=(6, 16))
  labels = rng.integers(0, 6, 600)
  x = centres[labels] + 0.05 * rng.normal(size=(600, 16))
  c = spherical_kmeans(x, 6, iterations=8, seed=2)
  assert np.allclose(np.linalg.norm(c.centroids, axis=1), 1.0, atol=1e-5)
  ids = c.table[c.table >= 0]
  assert np.array_equal(np.sort(ids), np.arange(600))  # every token exactly once
  assert c.sizes().max() <= c.capacity
  for k in range(6):  # table rows agree with the assignment
    assert set(c.table[k][c.table[k] >= 0]) == set(np.flatnonzero(c.assignment == k))
  assert all(b >= a - 1e-6 for a, b in zip(c.objective, c.objective[1:]))  # Lloyd: monotone
  # Well-separated clusters are recovered (up to renaming).
  for k in range(6):
    assert len(set(c.assignment[labels == k])) == 1


def test_balanced_assignment_respects_capacity():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(200, 8)), jnp.float32)
  cents = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
  cents = cents / jnp.linalg.norm(cents, axis=1, keepdims=True)
  a = balanced_assignment(x, cents, capacity=41)
  assert np.bincount(a, minlength=5).max() <= 41 and (a >= 0).all()
  with pytest.raises(ValueError, match="cannot hold"):
    balanced_assignment(x, cents, capacity=39)


def test_router_training_lowers_validation_loss():
  _, (result, pairs) = bundle()
  assert result.val_loss[-1] < result.val_loss[0] - 0.05
  assert result.val_recall[-1] >= result.val_recall[0]


def test_pair_weights_steer_the_router():
  """A pair's weight scales its loss: uniform weights change nothing, and a router trained
  with the weight on some positions fits them better than one trained without (what
  up-weighting the model's own continuations relies on)."""
  b, (plain, pairs) = bundle(inputs="hidden")
  kw = dict(k_max=3, hidden=64, inputs="hidden", epochs=6, batch=32, verbose=False)
  twice = train_router(pairs, b.clusters, weight=np.full(pairs.target.size, 2.0), **kw)
  for x, y in zip(jax.tree.leaves(nnx.state(plain.router)),
                  jax.tree.leaves(nnx.state(twice.router))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
  labels = b.clusters.assignment[pairs.target]
  focus = labels == np.bincount(labels).argmax()  # positions whose top token is in one cluster

  def loss_on_focus(router):
    ce = optax.softmax_cross_entropy(router(jnp.asarray(pairs.hidden[focus])),
                                     jnp.asarray(pairs.mass[focus], jnp.float32))
    return float(jnp.mean(ce))
  steered = train_router(pairs, b.clusters, weight=np.where(focus, 50.0, 1.0), **kw)
  assert loss_on_focus(steered.router) < 0.95 * loss_on_focus(plain.router)


def test_continuation_weights_mark_the_positions_that_predict_own_tokens():
  from specjax.offline.router import Pairs
  from specjax.offline.shortlists import continuation_weights, in_continuation

  group = np.asarray([0, 0, 0, 0, 1, 1, 2, 2], np.int32)
  pairs = Pairs(np.zeros((8, 2)), np.zeros((8, 1)), np.zeros(8, np.int32), group)
  # sequence 0: a prompt of 3 (its last position predicts the first own token), 1: of 1,
  # 2: a prompt without continuation
  np.testing.assert_array_equal(continuation_weights(pairs, [3, 1], 5.0),
                                [1, 1, 5, 5, 5, 5, 1, 1])
  assert continuation_weights(pairs, [3, 1], 1.0) is None
  np.testing.assert_array_equal(in_continuation(pairs, [3, 1]),
                                continuation_weights(pairs, [3, 1], 5.0) == 5)


def test_router_ablation_never_trains_on_its_held_out_sequences():

  from experiments import router_ablation as ra
  from specjax.offline.router import Pairs

  group = np.repeat(np.arange(12, dtype=np.int32), 3)
  pairs = Pairs(np.zeros((36, 2)), np.zeros((36, 1)), np.zeros(36, np.int32), group)
  held = ra.held_out(8)  # 8 continued sequences: 0 and 4 are held out
  np.testing.assert_array_equal(held, [0, 4])
  assert np.unique(ra.first_sequences(pairs, 5, held).group).tolist() == [1, 2, 3, 5, 6]
  assert np.unique(ra.first_sequences(pairs, 99, held).group).size == 10
  assert ra.variants([320, 160], [4.0, 1.0], ["embed_prev", "hidden"]) == [
      (160, 1.0, "embed_prev"), (320, 1.0, "embed_prev"), (320, 4.0, "embed_prev"),
      (320, 1.0, "hidden")]


@pytest.mark.parametrize("n", [1, 63, 64, 65, 128, 129, 520, 768, 769, 4000])
def test_pair_forwards_pad_to_the_next_multiple_of_128(n):
  from specjax.offline.router import _padded_length

  T = _padded_length(n)
  assert T >= n and (T == 64 if n <= 64 else T % 128 == 0 and T - n < 128)


def test_k_schedule():
  assert k_schedule(8, 3) == (8, 8, 8)
  assert k_schedule(8, 6, decay=True) == (8, 8, 1, 1, 1, 1)
  assert k_schedule(32, 5, decay=True) == (32, 32, 5, 4, 3)


def test_pair_collection_resumes_from_its_saved_chunks(tmp_path):
  """Chunks of pairs are written as they are done and read back on a rerun (a model with
  no weights proves nothing is recomputed); a chunk whose sequences changed is not."""
  m = tiny()
  b, _ = bundle()
  seqs = [PROMPT[:20], PROMPT[5:30], PROMPT[:12]]
  first = collect_pairs(m, seqs, b.clusters, verbose=False, save_dir=tmp_path, chunk=2)
  plain = collect_pairs(m, seqs, b.clusters, verbose=False)
  assert len(list(tmp_path.glob("pairs-*.npz"))) == 2
  weightless = type("M", (), {"name": m.name, "config": m.config, "graphdef": m.graphdef,
                              "state": None})()
  again = collect_pairs(weightless, seqs, b.clusters, verbose=False, save_dir=tmp_path,
                        chunk=2)
  for field in ("hidden", "mass", "target", "group", "embed"):
    np.testing.assert_array_equal(getattr(again, field), getattr(first, field))
    np.testing.assert_array_equal(getattr(plain, field), getattr(first, field))
  with pytest.raises(ValueError, match="number of leaves"):  # its first chunk is recomputed
    collect_pairs(weightless, [PROMPT[:21]] + seqs[1:], b.clusters, verbose=False,
                  save_dir=tmp_path, chunk=2)


def test_pairs_are_the_targets_own_distribution():
  """Each pair's label is the target's next-token distribution summed per cluster, and its
  top token; the hidden state is the final one the head reads, the embedding the one the
  draft step embeds."""
  m = tiny()
  b, (_, pairs) = bundle()
  seq = PROMPT[:20]
  one = collect_pairs(m, [seq], b.clusters, verbose=False)
  assert one.hidden.shape == (20, m.config.embed_dim) and one.mass.shape == (20, 8)
  cache = KVCache.create(m.config, 1, 64)
  out, _ = apply(m.state, cache, jnp.asarray([seq], jnp.int32), positions_for(cache, 20, 1),
                 DraftPlan.full(m.config.num_layers), graphdef=m.graphdef, write_cache=False)
  p = np.asarray(jax.nn.softmax(out.logits[0], -1), np.float64)
  want = np.stack([p[:, b.clusters.assignment == c].sum(1) for c in range(8)], 1)
  np.testing.assert_allclose(one.mass.astype(np.float64), want, atol=2e-3)
  np.testing.assert_array_equal(one.target, p.argmax(1))
  np.testing.assert_allclose(one.hidden, np.asarray(out.hidden[0]), rtol=1e-5, atol=1e-5)
  embed = nnx.merge(m.graphdef, m.state).embed(jnp.asarray([seq], jnp.int32))[0]
  np.testing.assert_allclose(one.embed, np.asarray(embed), rtol=1e-3, atol=1e-3)  # float16
  np.testing.assert_array_equal(one.usable("embed_prev"), np.arange(1, 20))  # h_{t-1} exists
  assert np.array_equal(np.unique(pairs.group), np.arange(24))  # every sequence, in order


@pytest.mark.parametrize("arch, inputs", [("llama", "embed_prev"), ("gemma3", "embed_prev"),
                                          ("qwen2", "embed_prev"),  # qwen2: an untied head
                                          ("llama", "hidden")])
def test_dynaspec_is_lossless(arch, inputs):
  m = tiny(arch)
  b, _ = bundle(arch, k_max=1, inputs=inputs)  # 1 cluster of 8: the shortlist misses tokens
  ar = generate(m.graphdef, m.state, m.config, PROMPT, max_new_tokens=40, eos_ids=()).tokens
  for drafter in (DynaSpecDrafter(b), DynaSpecDrafter(b, EarlyExitDrafter(k=2)),
                  DynaSpecDrafter(b, EarlyExitDrafter(k=2), core=core_ids(m.config))):
    for threshold in (None, 0.0):
      out = speculative_generate(m.graphdef, m.state, m.config, PROMPT, drafter,
                                 max_new_tokens=40, gamma=4, eos_ids=(), threshold=threshold)
      assert out.tokens == ar
      assert_exercised(out, deep=threshold == 0.0)


def reference_accepted(m, b, tokens, gamma, inputs, prev_offset=1):
  """Each round's accepted drafts, from one forward of the target over prompt + `tokens`
  (greedy AR's): a round starting at position p drafts at p, p+1, ... reading the router
  input there, [E(x_t), h_{t−1}] (h at p − `prev_offset`) or h_t, and the head's argmax
  over the routed shortlist, until a draft differs from AR's token (the all-layer draft's
  hidden states are the target's)."""
  seq = PROMPT + tokens
  cache = KVCache.create(m.config, 1, 128)
  out, _ = apply(m.state, cache, jnp.asarray([seq], jnp.int32),
                 positions_for(cache, len(seq), 1), DraftPlan.full(m.config.num_layers),
                 graphdef=m.graphdef, write_cache=False)
  H, logits = np.asarray(out.hidden[0], np.float32), np.asarray(out.logits[0])
  E = np.asarray(nnx.merge(m.graphdef, m.state).embed(jnp.asarray([seq], jnp.int32))[0])
  router = b.plan_field(8, decay=True)
  accepted, p = [], len(PROMPT)
  while p < len(seq) - 1:
    a = 0
    while a < gamma and p + a + 1 < len(seq):
      t = p + a
      x = H[t] if inputs == "hidden" else np.concatenate([E[t], H[t - prev_offset]])
      ids = np.asarray(router.shortlist(jnp.asarray(x), router.ks[a]))
      ids = ids[ids >= 0]
      if ids[np.argmax(logits[t, ids])] != seq[t + 1]:
        break
      a += 1
    accepted.append(a)
    p += a + 1
  return accepted


def reading_only_the_previous_state(b: RouterBundle) -> RouterBundle:
  """`b` with its router's weights on E(x_t) zeroed: its shortlist follows h̃_{t−1} alone,
  so a driver that carried a stale one into a round would draft otherwise."""
  router = nnx.clone(b.router)
  D = router.l1.kernel.shape[0] // 2
  router.l1.kernel[...] = router.l1.kernel[...].at[:D].set(0.0)
  return dataclasses.replace(b, router=router)


@pytest.mark.parametrize("inputs", ["embed_prev", "previous state alone", "hidden"])
def test_the_router_reads_its_own_inputs_on_every_path(inputs):
  """The paper's router reads [E(x_t), h̃_{t−1}]: at a round's first step the target's
  hidden state before `last` (the prefill's, then verification's at the last accepted
  position), later its own draft's; ours reads h_t. Each round's accepted count on the host
  loop, the device loop and the dispatched draft is the one a forward of the whole text
  predicts, and reading h one position off predicts other counts (the test can fail)."""
  m = tiny()
  b, _ = bundle(k_max=1, inputs="hidden" if inputs == "hidden" else "embed_prev")
  if inputs == "previous state alone":
    b = reading_only_the_previous_state(b)
  ar = generate(m.graphdef, m.state, m.config, PROMPT, max_new_tokens=40, eos_ids=()).tokens
  want = reference_accepted(m, b, ar, 4, b.inputs)
  if b.inputs == "embed_prev":
    assert reference_accepted(m, b, ar, 4, b.inputs, prev_offset=0) != want
  assert 0 < sum(want) < 4 * len(want)  # some drafts accepted, some not
  for loop, path in (("host", "cond"), ("device", "cond"), ("host", "dispatch")):
    out = speculative_generate(m.graphdef, m.state, m.config, PROMPT, DynaSpecDrafter(b),
                               max_new_tokens=40, gamma=4, eos_ids=(), threshold=0.0,
                               loop=loop, plan_path=path, record_rounds=True)
    assert out.tokens == ar
    n = len(out.round_accepted)  # the last round may stop at the budget, not a mismatch
    assert out.round_accepted[: n - 1] == want[: n - 1], (loop, path)


def test_a_paper_router_without_the_previous_hidden_state_is_refused():
  m = tiny()
  plan = DynaSpecDrafter(bundle()[0]).overlay_plan(session_of(m))
  cache = KVCache.create(m.config, 1, 64).with_length(8)
  kw = dict(graphdef=m.graphdef, vocab=V, gamma=2, threshold=0.0, sampling=SamplingParams())
  with pytest.raises(PlanError, match="needs `hidden`"):
    draft_step(m.state, cache, jnp.int32(3), plan, jax.random.key(0), None, **kw)
  with pytest.raises(PlanError, match=f"final hidden state \\[{m.config.embed_dim}\\]"):
    draft_step(m.state, cache, jnp.int32(3), plan, jax.random.key(0), None, jnp.zeros(5), **kw)


def test_an_untied_head_is_held_as_rows_for_the_routed_gathers(monkeypatch):
  """An untied head is [D, V]: a routed shortlist's rows are columns of it, 2976 of which
  took 36 ms on Qwen2.5-0.5B's head (twice a pass over all of it) against 0.7 ms as rows.
  The session holds its transpose once, for float drafts of untied models only, and the
  logits are those of the column gather."""
  from test_shortlist import count_head_row_gathers

  from specjax.drafters import Int8WeightsDrafter
  from specjax.quant import quantize_weights_int8

  m = tiny("qwen2")
  module = nnx.merge(m.graphdef, m.state)
  ids = jnp.asarray([5, -1, 40, 96, 0], jnp.int32)
  h = jax.random.normal(jax.random.key(1), (1, 1, m.config.embed_dim))
  np.testing.assert_allclose(module.head_shortlist(h, ids, head_rows=module.untied_head_rows()),
                             module.head_shortlist(h, ids), rtol=1e-6, atol=1e-6)
  assert tiny("llama").config.tie_embeddings and not m.config.tie_embeddings

  held = count_head_row_gathers(monkeypatch, "untied_head_rows")

  def decode(arch, drafter, prompt=PROMPT):
    t = tiny(arch)
    out = speculative_generate(t.graphdef, t.state, t.config, prompt, drafter,
                               max_new_tokens=12, gamma=4, eos_ids=())
    assert out.tokens == generate(t.graphdef, t.state, t.config, prompt, max_new_tokens=12,
                                  eos_ids=()).tokens
    return out

  routed = DynaSpecDrafter(bundle("qwen2")[0])
  decode("qwen2", routed)
  decode("qwen2", routed, PROMPT[4:])
  assert held == ["untied_head_rows"]  # once, across generations
  decode("llama", DynaSpecDrafter(bundle("llama")[0]))  # tied: the embedding's rows
  int8 = quantize_weights_int8(m.state, m.config.num_layers)
  decode("qwen2", DynaSpecDrafter(bundle("qwen2")[0], Int8WeightsDrafter(weights=int8)))
  assert held == ["untied_head_rows"]  # the 8-bit head is output-major already


def test_k_is_a_decoding_setting():
  """One router serves every k: the shortlist grows with it, the output never changes.
  The paper's shrinking schedule is the default; a flat k is its DynaSpec-F ablation."""
  m = tiny()
  b, _ = bundle(k_max=1)
  session = type("S", (), {"config": m.config})()
  assert DynaSpecDrafter(b, k=8).overlay_plan(session).router.ks == k_schedule(8, 8, decay=True)
  assert DynaSpecDrafter(b, k=8).overlay_plan(session).router.ks[:3] == (8, 8, 1)
  ar = generate(m.graphdef, m.state, m.config, PROMPT, max_new_tokens=24, eos_ids=()).tokens
  alphas = []
  for k in (1, 4):
    drafter = DynaSpecDrafter(b, k=k, decay=False)
    plan = drafter.overlay_plan(session)
    assert plan.router.ks == (k,) * drafter.positions
    out = speculative_generate(m.graphdef, m.state, m.config, PROMPT, drafter,
                               max_new_tokens=24, gamma=4, eos_ids=(), threshold=0.0)
    assert out.tokens == ar
    alphas.append(out.accepted / out.drafted)
  assert alphas[1] >= alphas[0]


def test_dynaspec_defaults_are_the_papers(tmp_path, monkeypatch):
  """The paper's router reads [E(x_t), h̃_{t−1}], and k shrinks after the second draft
  position: what a router trained with no input named reads (the library, `specjax router
  train`, the drafter factory's artefact), where specjax keeps it, and the drafter's k."""
  import inspect

  from specjax.cli import build_parser
  from specjax.offline import router, shortlists
  from specjax.offline.artefacts import ARTEFACT_OPTIONS

  assert router.DEFAULT_INPUTS == "embed_prev"
  assert inspect.signature(train_router).parameters["inputs"].default == "embed_prev"
  assert inspect.signature(shortlists.build).parameters["inputs"].default == "embed_prev"
  assert ARTEFACT_OPTIONS["dynaspec"]["inputs"] == "embed_prev"
  args = build_parser().parse_args(["router", "train", "--model", "tiny-llama"])
  assert args.inputs == "embed_prev"
  with pytest.raises(SystemExit):  # the CLI's choices are the library's (it imports no jax)
    build_parser().parse_args(["router", "train", "--model", "tiny-llama", "--inputs", "h_t"])
  for choice in router.INPUTS:
    build_parser().parse_args(["router", "train", "--model", "tiny-llama", "--inputs", choice])
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  assert shortlists.folder(tiny()) == shortlists.folder(tiny(), 1024, "embed_prev")
  assert shortlists.folder(tiny(), 1024, "hidden").name == "input-hidden"
  assert DynaSpecDrafter.decay and k_schedule(16, 4, decay=True) == (16, 16, 2, 2)
  assert bundle()[0].inputs == "embed_prev"


def test_a_core_is_scored_beside_the_routed_clusters():
  """With a core the draft's shortlist is core ∪ routed clusters, each token once: the
  router's table leaves the core out, and the draft's greedy token is the full head's
  argmax over that union, whether the core's rows are gathered per step or held."""
  m = tiny()
  b, _ = bundle(k_max=1)
  core = core_ids(m.config)
  plan = DynaSpecDrafter(b, core=core).overlay_plan(session_of(m))
  table = np.asarray(plan.router.table)
  np.testing.assert_array_equal(np.asarray(plan.vocab), core)
  assert not np.isin(table, core).any()
  np.testing.assert_array_equal(np.sort(np.concatenate([table[table >= 0], core])),
                                np.arange(V))  # every token exactly once
  assert b.clusters.sizes(core).sum() == V - core.size

  L = m.config.num_layers
  cache = KVCache.create(m.config, 1, 64)
  prompt = jnp.asarray([PROMPT], jnp.int32)
  first, cache, _, prev = prefill_step(m.state, cache, prompt, jnp.int32(len(PROMPT)),
                                       DraftPlan.full(L), jax.random.key(0), graphdef=m.graphdef,
                                       sampling=SamplingParams(), return_pooled=True)
  o, _ = apply(m.state, cache, first.reshape(1, 1), positions_for(cache, 1, 1),
               DraftPlan.full(L), graphdef=m.graphdef, write_cache=False)
  embed = nnx.merge(m.graphdef, m.state).embed(first.reshape(1, 1))[0, 0]
  x = plan.router.features(o.hidden[0, -1], embed, prev)  # [E(x_t), h_{t-1}]
  routed = np.asarray(plan.router.shortlist(x, 1))
  union = np.concatenate([core, routed[routed >= 0]])
  logits = np.asarray(o.logits[0, -1])
  want = int(union[np.argmax(logits[union])])
  held = plan.replace(head_rows=shortlist_rows(m.state, plan.vocab, None, graphdef=m.graphdef))
  for p in (plan, held):
    got = draft_step(m.state, cache, first[0], p, jax.random.key(2), jnp.int32(1), prev,
                     graphdef=m.graphdef, vocab=V, gamma=1, threshold=0.0,
                     sampling=SamplingParams())
    assert int(got.tokens[0]) == want


@pytest.mark.parametrize("with_core", [False, True])
def test_dynaspec_sampling_round_keeps_the_target_distribution(with_core):
  """Rounds whose draft scores only the router's clusters (q zero outside them, k shrinking
  with the position), and a core beside them, keep the target's distribution, first and
  second committed token."""
  m = tiny()
  b, _ = bundle()
  sampling = SamplingParams(temperature=2.0, top_p=1.0)
  L = m.config.num_layers
  cache = KVCache.create(m.config, 1, 64)
  prompt = jnp.asarray([PROMPT], jnp.int32)
  first, cache, _, prev = prefill_step(m.state, cache, prompt, jnp.int32(len(PROMPT)),
                                       DraftPlan.full(L), jax.random.key(0), graphdef=m.graphdef,
                                       sampling=sampling, return_pooled=True)
  plan = DynaSpecDrafter(b, core=core_ids(m.config, 6) if with_core else None
                         ).overlay_plan(session_of(m))
  kw = dict(graphdef=m.graphdef, vocab=V, threshold=0.0, sampling=sampling)
  out = sample_rounds(lambda k: round_fn(m.state, cache, first[0], plan, k, prev, gamma=3,
                                         **kw)[0])
  q1 = draft_step(m.state, cache, first[0], plan, jax.random.key(2), jnp.int32(1), prev,
                  gamma=1, **kw).q_rows[0]
  p = target_probs(m.state, m.graphdef, m.config, cache, sampling)
  f = int(first[0])
  q1 = np.asarray(q1, np.float64)
  assert (q1 == 0).sum() > V // 4  # the shortlist really left tokens out
  assert_round_distribution(out, p([f]), q1, lambda t: p([f, t]), gamma=3)


def test_bundle_round_trips_bit_exactly_and_is_checked(tmp_path):
  b, (_, pairs) = bundle()
  save_bundle(tmp_path / "r", b)
  back = load_bundle(tmp_path / "r", model=b.model)
  for x, y in zip(jax.tree.leaves(nnx.state(b.router)), jax.tree.leaves(nnx.state(back.router))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_array_equal(back.clusters.table, b.clusters.table)
  assert recall_at(back.router, pairs, back.clusters, 3) == recall_at(b.router, pairs,
                                                                     b.clusters, 3)
  with pytest.raises(RouterMismatchError, match="trained for tiny-llama, not other"):
    load_bundle(tmp_path / "r", model="other")
  assert is_current(tmp_path / "r") and not is_current(tmp_path / "none")


def test_a_cached_router_trained_otherwise_is_reused_with_a_warning(tmp_path):
  import warnings

  from specjax.offline.shortlists import _warn_if_other_settings

  b, _ = bundle()
  save_bundle(tmp_path / "r", b)  # no continuation weight recorded: an older router, 1.0
  same = dict(clusters=8, k_max=3, hidden=64, continuation_weight=1.0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _warn_if_other_settings(tmp_path / "r", **same)
  with pytest.warns(UserWarning, match="continuation_weight 1.0 \\(asked 8.0\\): delete"):
    _warn_if_other_settings(tmp_path / "r", **{**same, "continuation_weight": 8.0})


def test_a_router_of_the_older_design_is_refused(tmp_path):
  """Version 1 kept no record of its input and learned hard labels: refused. Version 2 read
  h_t, and loads as a "hidden" router; a router of other inputs is not the current one
  for a store asking for these."""
  b, (_, pairs) = bundle(inputs="hidden")
  save_bundle(tmp_path / "r", b)
  meta_path = tmp_path / "r" / "meta.json"
  meta = json.loads(meta_path.read_text())
  assert is_current(tmp_path / "r", "hidden") and not is_current(tmp_path / "r", "embed_prev")
  meta_path.write_text(json.dumps({**meta, "version": 2, "inputs": None}))
  back = load_bundle(tmp_path / "r", model=b.model)
  assert back.inputs == "hidden" and is_current(tmp_path / "r", "hidden")
  assert recall_at(back.router, pairs, back.clusters, 3) == recall_at(b.router, pairs,
                                                                     b.clusters, 3)
  meta.pop("version")
  meta_path.write_text(json.dumps(meta))
  assert not is_current(tmp_path / "r")
  with pytest.raises(RouterMismatchError, match="older design.*specjax router train"):
    load_bundle(tmp_path / "r", model=b.model)


def test_built_shortlists_are_reused_without_the_training_data(tmp_path):
  """Counts and a current router at hand: `shortlists.build` loads them and reads no
  training prompts. It used to read GSM8K anyway, which needs `datasets`, so a GPU
  machine without that package could not run FR-Spec or DynaSpec from carried artefacts."""
  from specjax.offline import shortlists
  from specjax.offline.token_counts import save_counts

  b, _ = bundle()
  counts = np.arange(V, dtype=np.int64)
  save_counts(tmp_path / "counts.npz", counts, model=b.model)
  save_bundle(tmp_path / "router", b)
  got, back, _ = shortlists.build(tiny(), tmp_path, clusters=8, k_max=3, hidden=64,
                                  data_dir=tmp_path / "no-data-here", verbose=False)
  np.testing.assert_array_equal(got, counts)
  np.testing.assert_array_equal(back.clusters.table, b.clusters.table)
  assert not (tmp_path / "sequences.json").exists()


def test_bad_router_settings_are_clear_errors():
  b, _ = bundle()
  with pytest.raises(ValueError, match="k = 9 clusters, but there are only 8"):
    DynaSpecDrafter(RouterBundle(b.model, b.router, b.clusters, 9, 64))
  with pytest.raises(ValueError, match="k = 12 clusters, but there are only 8"):
    DynaSpecDrafter(b, k=12)
  with pytest.raises(ValueError, match="k = 0 clusters"):
    DynaSpecDrafter(b, k=0)
  with pytest.raises(TypeError, match="'bundle'"):  # a required constructor argument
    DynaSpecDrafter()
  with pytest.raises(ValueError, match="needs a trained router"):
    DynaSpecDrafter(None)
  other = tiny_config("llama", num_layers=4, vocab_size=120)
  g, s = nnx.split(init_model(other, seed=0))
  with pytest.raises(RouterMismatchError, match="covers 97 tokens"):
    speculative_generate(g, s, other, PROMPT, DynaSpecDrafter(b), max_new_tokens=8)
  with pytest.raises(RouterMismatchError, match="the clusters cover 97 tokens"):
    collect_pairs(type("M", (), {"name": "other", "config": other})(), [PROMPT], b.clusters)
  with pytest.raises(ValueError, match="reads one of embed_prev, hidden, not 'h_t'"):
    train_router(bundle()[1][1], b.clusters, k_max=3, inputs="h_t", verbose=False)


def test_router_ablation_findings_follow_the_numbers():

  from experiments import router_ablation as ra

  row = lambda n, w, r, i="embed_prev": {"sequences": n, "weight": w, "outputs": {"16": r},
                                         "inputs": i}
  text = ra.findings([row(320, 1.0, 0.95), row(160, 1.0, 0.93), row(320, 4.0, 0.94),
                      row(320, 1.0, 0.97, "hidden")])
  assert text == ("Recall@16 at the outputs goes 0.930 (160 sequences) → 0.950 (320 "
                  "sequences). Weighing the continuations 4× moves it by -0.010. A router "
                  "reading hidden instead of embed_prev moves it by +0.020.")


def test_router_ablation_without_a_router_names_the_command(tmp_path, monkeypatch):
  """No router built yet: the script says which `router train` to run, before it loads
  the model or makes its results folder."""

  from experiments import router_ablation as ra

  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  with pytest.raises(SystemExit, match="specjax router train --model gemma3-270m --prompts "
                     "48 --router-prompts 320 --keep-pairs"):
    ra.main(["--model", "gemma3-270m", "--out", str(tmp_path / "runs")])
  assert not (tmp_path / "runs").exists()
