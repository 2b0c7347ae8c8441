"""The device round loop (`round_loop`) against the host loop it replaces: the same tokens,
rounds and acceptance for every drafter whose plan is fixed, greedy and sampled, and for
CLaSp and SWIFT, which select between calls; stops at EOS and at the budget mid-round; no
cache copy in its executable; and AR in chunks."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from targets import PROMPT, ar_tokens, assert_exercised, target

from specjax import quant_kv_cache
from specjax.decode import round_loop
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.decode.round_loop import Decoding, decode_rounds
from specjax.drafters import (
  ClaspDrafter,
  DynaSpecDrafter,
  EarlyExitDrafter,
  FRSpecDrafter,
  KnapSpecDrafter,
  QuantSpecDrafter,
  StaticDrafter,
  SwiftDrafter,
)
from specjax.kv_cache import KVCache
from specjax.plan import DraftPlan
from specjax.quant_kv_cache import QuantKV
from specjax.sampling import SamplingParams
from specjax.selection.layer_probe import Window

SKIP = DraftPlan.from_skips(4, [1, 3], [2])
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


def _quantspec(arch):
  config, graphdef, state = target(arch)
  model = types.SimpleNamespace(graphdef=graphdef, state=state, config=config)
  return QuantSpecDrafter.for_model(model, base=StaticDrafter(SKIP), weight_group=32,
                                    kv_cache=QuantKV(group=8, residual=16))


def _dynaspec(arch):
  from test_dynaspec import bundle

  return DynaSpecDrafter(bundle(arch)[0], EarlyExitDrafter(k=3))


DRAFTERS = {
    "static": lambda arch: StaticDrafter(SKIP),
    "early_exit": lambda arch: EarlyExitDrafter(k=2),
    "frspec": lambda arch: FRSpecDrafter(np.arange(0, 97, 2), StaticDrafter(SKIP)),
    "quantspec": _quantspec,
}


def both(arch, drafter, **kw):
  config, graphdef, state = target(arch)
  run = lambda loop: speculative_generate(graphdef, state, config, PROMPT, drafter,
                                          max_new_tokens=48, eos_ids=(), loop=loop, **kw)
  return run("host"), run("device")


def assert_same(host, device):
  assert device.loop == "device" and host.loop == "host"
  assert device.tokens == host.tokens
  assert (device.rounds, device.drafted, device.accepted, device.committed) == (
      host.rounds, host.drafted, host.accepted, host.committed)
  assert device.round_drafted == host.round_drafted
  assert device.round_accepted == host.round_accepted


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_device_loop_commits_what_the_host_loop_commits(name, sampling):
  """Same key splits per round, so even sampled runs agree token for token."""
  host, device = both("llama", DRAFTERS[name]("llama"), gamma=4, threshold=0.0,
                      sampling=sampling)
  assert_same(host, device)
  if sampling.greedy and name != "quantspec":  # QuantSpec's AR reads its 8-bit cache
    assert device.tokens == ar_tokens("llama")
  assert_exercised(device, deep=True)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_device_loop_routed_shortlist_matches_the_host_loop(arch):
  """DynaSpec's per-step shortlists (the router inside the draft loop) commit the same
  tokens in the device loop as in the host loop."""
  host, device = both(arch, _dynaspec(arch), gamma=4, threshold=0.0)
  assert_same(host, device)
  assert device.tokens == ar_tokens(arch)


@pytest.mark.parametrize("per_call", [1, 3])
def test_rounds_per_call_and_streaming_change_nothing(per_call):
  config, graphdef, state = target("qwen3")
  seen = []
  out = speculative_generate(graphdef, state, config, PROMPT, StaticDrafter(SKIP),
                             max_new_tokens=48, eos_ids=(), gamma=4, threshold=0.0,
                             rounds_per_call=per_call, on_token=seen.append)
  assert out.tokens == seen == ar_tokens("qwen3")
  assert out.loop == "device"


@pytest.mark.parametrize("budget", [2, 17, 48])
def test_device_loop_stops_at_eos_and_at_the_budget_inside_a_round(budget):
  ref = ar_tokens("llama")
  eos = ref[20]
  config, graphdef, state = target("llama")
  run = lambda loop, eos_ids: speculative_generate(
      graphdef, state, config, PROMPT, EarlyExitDrafter(k=3), max_new_tokens=budget,
      eos_ids=eos_ids, gamma=5, threshold=0.0, loop=loop)
  for eos_ids in ((), (eos,)):
    host, device = run("host", eos_ids), run("device", eos_ids)
    assert_same(host, device)
    want = ref[:budget]
    if eos in eos_ids and eos in want:
      want = want[: want.index(eos) + 1]
    assert device.tokens == want
    assert device.stopped_on_eos == (eos in eos_ids and want[-1] == eos)


@dataclasses.dataclass(frozen=True)
class _EveryRound(StaticDrafter):
  """An adaptive drafter that is not `chunked`: its update would need the host after
  every round."""

  name = "every_round"
  adaptive = True


def test_adaptive_drafters_that_are_not_chunked_keep_the_host_loop():
  config, graphdef, state = target("llama")
  with pytest.raises(ValueError, match="loop='host'"):
    speculative_generate(graphdef, state, config, PROMPT, _EveryRound(SKIP), loop="device")
  out = speculative_generate(graphdef, state, config, PROMPT,
                             FRSpecDrafter(np.arange(97), _EveryRound(SKIP)),
                             max_new_tokens=8, eos_ids=())
  assert out.loop == "host"  # an overlay is as adaptive as its base


@pytest.mark.parametrize("realised, sampling", [
    (False, SamplingParams()), (True, SamplingParams()), (False, SAMPLED)],
    ids=["fixed-between", "realised", "fixed-between-sampled"])
def test_knapspec_runs_its_rounds_between_selections_on_the_device(realised, sampling):
  """KnapSpec's plan and draft length hold between selections (`realised` re-prices them
  after every round: a round a call). The device loop drafts at the chosen length and
  hands back each round's counts: the same selections, draft lengths and tokens as the
  host loop, whose draft executable is γ wide and stops at the chosen length (no
  selection budget, whose DP timings differ run to run). Sampled too: a draft step's key
  does not depend on the executable's width."""
  from test_knapspec import synthetic_profile

  config, graphdef, state = target("llama")
  drafter = KnapSpecDrafter(synthetic_profile(), interval=3, selection_budget=None,
                            realised=realised)
  run = lambda loop: speculative_generate(graphdef, state, config, PROMPT, drafter,
                                          max_new_tokens=48, eos_ids=(), gamma=5, loop=loop,
                                          sampling=sampling)
  host, device = run("host"), run("auto")
  assert_same(host, device)
  picks = lambda gen: [(s.round, s.gamma, s.chosen_bits.tolist())
                       for s in gen.drafter_state.selections]
  assert picks(device) == picks(host) and len(picks(host)) >= 4
  assert device.drafter_state.since_s == host.drafter_state.since_s
  assert device.drafter_state.tallies == host.drafter_state.tallies
  if sampling.greedy:
    assert device.tokens == ar_tokens("llama")


def test_swift_optimises_a_round_a_call_then_runs_the_rest_in_one():
  """SWIFT's update scores a candidate on the session after each round, until its plan is
  frozen: the device loop runs a round per call while it optimises, then all the rest.
  The same tokens and the same search (candidates, scores) as the host loop, and across
  prompts (the second starts where the first stopped, frozen)."""
  config, graphdef, state = target("llama")
  drafter = SwiftDrafter(trials=4, window=16)
  run = lambda loop, prior: speculative_generate(
      graphdef, state, config, PROMPT, drafter, max_new_tokens=48, eos_ids=(), gamma=4,
      threshold=0.0, loop=loop, drafter_state=prior)
  host, device = run("host", None), run("auto", None)
  assert_same(host, device)
  assert device.drafter_state.trials == host.drafter_state.trials == 4
  assert device.drafter_state.ys == host.drafter_state.ys
  again = run("host", host.drafter_state), run("auto", device.drafter_state)
  assert_same(*again)
  assert again[1].tokens == ar_tokens("llama")


def test_where_conditionals_cost_swift_plan_is_frozen_once_its_search_ends(monkeypatch):
  """On an accelerator (patched in here) each traced conditional is a host round trip, so
  the device loop compiles a plan in once it holds for the rest of the generation: SWIFT's
  after its search (`rounds_left` None), traced while it searches. Same tokens and search as
  the host loop; the next prompt starts frozen, and its executable is the one compiled."""
  monkeypatch.setattr(round_loop, "conditionals_skip_cheaply", lambda: False)
  assert round_loop.freezes(None, False, None) and round_loop.freezes(None, True, None)
  assert not round_loop.freezes(None, True, 3) and not round_loop.freezes(False, False, None)
  assert round_loop.freezes(True, True, 3)
  config, graphdef, state = target("llama")
  drafter = SwiftDrafter(trials=4, window=16)
  run = lambda loop, prior: speculative_generate(
      graphdef, state, config, PROMPT, drafter, max_new_tokens=48, eos_ids=(), gamma=4,
      threshold=0.0, loop=loop, drafter_state=prior, record_rounds=True)
  host, device = run("host", None), run("auto", None)
  assert_same(host, device)
  assert device.drafter_state.ys == host.drafter_state.ys
  frozen = [p.frozen is not None for p in device.plans]
  assert frozen[0] is False and frozen[-1] is True and frozen == sorted(frozen)
  assert device.plans[-1].frozen == device.drafter_state.best.freeze().frozen
  again = run("auto", device.drafter_state)
  assert all(p.frozen is not None for p in again.plans) and again.compiles == 0
  assert again.tokens == run("host", host.drafter_state).tokens == ar_tokens("llama")


@pytest.mark.parametrize("overlay, sampling, per_call", [
    (False, SamplingParams(), None), (True, SAMPLED, 2)], ids=["greedy", "shortlist-sampled"])
def test_clasp_runs_the_rounds_between_its_selections_on_the_device(overlay, sampling,
                                                                    per_call):
  """CLaSp's plan holds for `interval` rounds, and between selections its update only
  extends its window of verified rows: the device loop runs those rounds (at most
  `per_call` a call), extending the window itself, and the host selects between calls.
  The same selections, plans and tokens as the host loop, under an overlay too."""
  config, graphdef, state = target("llama")
  drafter = ClaspDrafter(skip=2, interval=3)
  if overlay:
    drafter = FRSpecDrafter(np.arange(0, 97, 2), drafter)
  run = lambda loop: speculative_generate(
      graphdef, state, config, PROMPT, drafter, max_new_tokens=48, eos_ids=(), gamma=4,
      threshold=0.0, sampling=sampling, loop=loop, rounds_per_call=per_call,
      record_rounds=True)
  host, device = run("host"), run("auto")
  assert_same(host, device)
  own = lambda gen: gen.drafter_state.base if overlay else gen.drafter_state
  selections = own(device).plans
  assert len(selections) == len(own(host).plans) >= 4
  for a, b in zip(own(host).plans, selections):
    np.testing.assert_array_equal(a, b)
  assert len({tuple(np.asarray(p.attn)) for p in device.plans}) > 1  # plans did change
  assert device.selection_s > 0 and device.rounds_s > 0
  # Calls run 1 to 3 rounds (2 and 1 under per_call=2), and the round count is traced:
  # one compiled loop (the host loop before it compiled the prefill and the DP).
  assert device.compiles == 1
  if sampling.greedy:
    assert device.tokens == ar_tokens("llama")


def test_device_loop_copies_no_cache_layer():
  """Draft (reading the cache in conditionals) and verification (writing it) in one loop
  body, with a chunked drafter's window too: XLA still updates the cache in place."""
  from test_model import _layer_copies

  config, graphdef, state = target("gemma3")
  cache = KVCache.create(config, 1, 512)
  L, W = config.num_layers, 2
  clasp_window = Window(tokens=jnp.zeros((W,), jnp.int32),
                        positions=jnp.zeros((W,), jnp.int32),
                        next_tokens=jnp.zeros((W,), jnp.int32),
                        residuals=jnp.zeros((2 * L, W, config.embed_dim)),
                        valid=jnp.zeros((W,), bool))
  for sampling, window in ((SamplingParams(), None), (SAMPLED, None),
                           (SamplingParams(), clasp_window)):  # a chunked drafter's carry
    carry = Decoding.start(cache, jnp.asarray([1]), jax.random.key(0), 64, window=window)
    hlo = decode_rounds.lower(state, carry, SKIP, jnp.int32(40), jnp.asarray([-1]),
                              jnp.int32(8), graphdef=graphdef, vocab=config.vocab_size,
                              gamma=4, threshold=0.5, sampling=sampling).compile().as_text()
    assert _layer_copies(hlo, config, 512) == []


@pytest.mark.parametrize("threshold, trip_count", [(0.0, 4), (0.5, None)])
def test_a_draft_without_early_stop_is_a_loop_of_known_length(threshold, trip_count):
  """8bit, 4bit and quantspec draft γ tokens, no early stop: the draft loop inside the
  round's body then has a trip count XLA knows (a GPU runs a loop of unknown length with a
  host round trip per step for its predicate). An early stop keeps the predicate."""
  import re

  config, graphdef, state = target("llama")
  carry = Decoding.start(KVCache.create(config, 1, 192), jnp.asarray([1]), jax.random.key(0),
                         64)
  hlo = decode_rounds.lower(state, carry, SKIP, jnp.int32(40), jnp.asarray([-1]),
                            jnp.int32(8), graphdef=graphdef, vocab=config.vocab_size, gamma=4,
                            threshold=threshold, sampling=SamplingParams()).compile().as_text()
  counts = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)]
  assert (4 in counts) == (trip_count == 4)


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_ar_chunks_change_no_token(sampling):
  config, graphdef, state = target("qwen2")
  run = lambda chunk: generate(graphdef, state, config, PROMPT, max_new_tokens=30, eos_ids=(),
                               sampling=sampling, seed=3, chunk=chunk).tokens
  one = run(1)
  assert run(7) == run(None) == one
  assert len(set(one)) >= 8


@pytest.mark.parametrize("arch, precision", [("llama", "bfloat16"), ("gemma3", "bfloat16"),
                                             ("llama", "mixed")])
def test_bfloat16_weights_are_lossless_on_tiny_models(arch, precision):
  """bfloat16 weights, computed in bfloat16 (the GPU default) or float32 (`mixed`): greedy
  SSD (device and host loop) equals greedy AR on tiny models. On real models only `mixed`
  keeps that token for token (test_real_ssd: bfloat16 activations round verification's
  rows apart from the AR step's)."""
  from specjax.models.loader import at_precision

  config, graphdef, state = at_precision(*target(arch)[::2], precision)
  ar = generate(graphdef, state, config, PROMPT, max_new_tokens=48, eos_ids=())
  assert len(set(ar.tokens)) >= 8
  for loop in ("host", "device"):
    out = speculative_generate(graphdef, state, config, PROMPT, StaticDrafter(SKIP),
                               max_new_tokens=48, eos_ids=(), gamma=4, threshold=0.0, loop=loop)
    assert out.tokens == ar.tokens
    assert_exercised(out, deep=True)


@pytest.mark.parametrize("name", ["static", "frspec", "quantspec"])
def test_a_frozen_plan_commits_the_same_tokens_without_conditionals(name, monkeypatch):
  """`static_plan=True` (the accelerator default) compiles the plan in: same rounds as
  the traced plan, and the round loop's executable holds no per-layer conditional. The
  one conditional a quantised cache adds on a CPU (a flush once every R tokens) is gone
  where conditionals are host round trips."""
  config, graphdef, state = target("llama")
  drafter = DRAFTERS[name]("llama")
  run = lambda static: speculative_generate(graphdef, state, config, PROMPT, drafter,
                                            max_new_tokens=48, eos_ids=(), gamma=4,
                                            threshold=0.0, static_plan=static, record_rounds=True)
  traced, frozen = run(False), run(True)
  assert frozen.tokens == traced.tokens and frozen.round_accepted == traced.round_accepted
  plan = frozen.plans[0]
  assert plan.frozen is not None and traced.plans[0].frozen is None
  cache = KVCache.create(config, 1, 192) if drafter.kv_cache is None else \
      drafter.kv_cache.create(config, 1, 192)
  carry = Decoding.start(cache, jnp.asarray([1]), jax.random.key(0), 64)
  conditionals = lambda: decode_rounds.lower(
      state, carry, plan, jnp.int32(40), jnp.asarray([-1]), jnp.int32(8), graphdef=graphdef,
      vocab=config.vocab_size, gamma=4, threshold=0.5,
      sampling=SamplingParams()).compile().as_text().count(" conditional(")
  assert conditionals() == (1 if drafter.kv_cache is not None else 0)  # CPU: the flush
  monkeypatch.setattr(quant_kv_cache, "conditionals_skip_cheaply", lambda: False)
  jax.clear_caches()  # trace again
  assert conditionals() == 0  # as on a GPU
  monkeypatch.undo()
  jax.clear_caches()  # later tests trace the CPU flush again


def test_a_new_token_budget_compiles_nothing():
  """Buffer and chunk sizes are bucketed, not the budget itself: a run of another length
  reuses the device loops' executables."""
  config, graphdef, state = target("qwen3")
  ssd = lambda n: speculative_generate(graphdef, state, config, PROMPT, StaticDrafter(SKIP),
                                       max_new_tokens=n, eos_ids=(), gamma=4)
  ar = lambda n: generate(graphdef, state, config, PROMPT, max_new_tokens=n, eos_ids=())
  ssd(40), ar(40)
  again, ar_again = ssd(33), ar(33)
  assert again.tokens == ar_again.tokens == ar_tokens("qwen3")[:33]
  assert again.compiles == ar_again.compiles == 0


def test_bad_loop_settings_are_clear_errors():
  from specjax.models.loader import resolve_dtype

  config, graphdef, state = target("llama")
  run = lambda **kw: speculative_generate(graphdef, state, config, PROMPT, StaticDrafter(SKIP),
                                          max_new_tokens=8, eos_ids=(), **kw)
  with pytest.raises(ValueError, match="loop must be"):
    run(loop="gpu")
  with pytest.raises(ValueError, match="rounds_per_call"):
    run(rounds_per_call=-1)
  with pytest.raises(ValueError, match="chunk"):
    generate(graphdef, state, config, PROMPT, max_new_tokens=8, chunk=-2)
  with pytest.raises(ValueError, match="unknown dtype 'float8'"):
    resolve_dtype("float8")


def test_device_loop_sampled_rounds_keep_the_target_distribution():
  """The device loop itself under the powered χ² test: 40 000 runs of `decode_rounds` from
  one prefilled state (one key each, vmapped), each committing two tokens in one round or
  over two. The first is drawn from the target's p(· | prompt), the second from
  p(· | prompt, first) for the most frequent first. The loop-against-loop tests above
  cannot see a bug both loops share (a key split, the carry of `last` from one round to
  the next); the χ² tests of `round_fn` never run this loop."""
  from targets import assert_powered, chi2_matches, sample_rounds, target_probs

  from specjax.decode.generate import prefill_step
  from specjax.decode.round import draft_step

  config, graphdef, state = target("llama", 4, 12)
  L, V, gamma = config.num_layers, 12, 3
  sampling = SamplingParams(temperature=2.0, top_p=1.0)
  prompt = jnp.asarray([[9, 8, 10, 4, 3, 11, 9, 5, 8, 3, 5, 8, 10, 4, 6, 3, 8, 11, 7, 10]],
                       jnp.int32)
  first, cache = prefill_step(state, KVCache.create(config, 1, 48), prompt, jnp.int32(20),
                              DraftPlan.full(L), jax.random.key(0), graphdef=graphdef,
                              sampling=sampling)
  # q far from p (the test must see the classic bugs), and a first draft rejected often
  plan = DraftPlan.from_skips(L, [1, 2, 3], [0, 1, 2, 3])
  no_eos = jnp.asarray([-1], jnp.int32)

  def run(key):
    carry = Decoding.start(cache, first, key, capacity=16)
    out = decode_rounds(state, carry, plan, jnp.int32(3), no_eos, jnp.int32(3),
                        graphdef=graphdef, vocab=V, gamma=gamma, threshold=0.0,
                        sampling=sampling)
    return out.tokens[1:3], out.count, out.rounds

  tokens, count, rounds = map(np.asarray, sample_rounds(run))
  assert (count == 3).all()
  assert 0.2 < np.mean(rounds == 2) < 0.8  # the second token came across rounds and within
  p = target_probs(state, graphdef, config, cache, sampling)
  f = int(first[0])
  q1 = draft_step(state, cache, first[0], plan, jax.random.key(2), jnp.int32(1),
                  graphdef=graphdef, vocab=V, gamma=1, threshold=0.0,
                  sampling=sampling).q_rows[0]
  assert_powered(p([f]), np.asarray(q1, np.float64), len(tokens))
  counts = np.bincount(tokens[:, 0], minlength=V)
  chi2_matches(counts, p([f]))
  top = int(np.argmax(counts))
  chi2_matches(np.bincount(tokens[tokens[:, 0] == top, 1], minlength=V), p([f, top]))
