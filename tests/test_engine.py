"""The SSD engine: lossless for every drafter, exact in distribution when sampling, one
executable per round whatever the plan, and clear errors for bad requests."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_forward
from targets import (
  PROMPT,
  ar_tokens,
  assert_exercised,
  assert_round_distribution,
  sample_rounds,
  target,
)

from specjax.bench.results_store import ResultsStore
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import prefill_step
from specjax.decode.round import draft_step, round_fn
from specjax.drafters import (
  EarlyExitDrafter,
  SelfSDDrafter,
  StaticDrafter,
  SwiftDrafter,
  UnknownDrafterError,
  drafter_class,
)
from specjax.drafters.overlay import OverlayState
from specjax.errors import ConfigError
from specjax.kv_cache import KVCache
from specjax.offline import self_sd_search as self_sd
from specjax.plan import DraftPlan, PlanError, load_plan, save_plan
from specjax.sampling import SamplingParams, probs


def ssd(arch, drafter, n=48, **kw):
  config, graphdef, state = target(arch)
  return speculative_generate(graphdef, state, config, PROMPT, drafter, max_new_tokens=n,
                              eos_ids=(), **kw)


@settings(max_examples=16, deadline=None)
@given(data=st.data())
def test_greedy_static_random_plans_are_lossless(data):
  arch = data.draw(st.sampled_from(["llama", "qwen2", "qwen3", "gemma3"]))
  attn = data.draw(st.lists(st.booleans(), min_size=4, max_size=4))
  mlp = data.draw(st.lists(st.booleans(), min_size=4, max_size=4))
  threshold = data.draw(st.sampled_from([0.0, 0.5]))
  out = ssd(arch, StaticDrafter(DraftPlan.from_masks(attn, mlp)), gamma=3, threshold=threshold)
  assert out.tokens == ar_tokens(arch)
  assert out.committed == len(out.tokens) - 1
  assert 1.0 <= out.mean_accepted <= 4
  assert max(out.round_drafted) <= 3


@pytest.mark.parametrize("gamma,threshold", [(1, 0.0), (6, 0.0), (6, 0.8), (6, 0.95)])
def test_lossless_for_any_draft_length_and_threshold(gamma, threshold):
  plan = DraftPlan.from_skips(4, [1, 2, 3], [2])
  out = ssd("qwen2", StaticDrafter(plan), gamma=gamma, threshold=threshold)
  assert out.tokens == ar_tokens("qwen2")
  assert max(out.round_drafted) <= gamma
  assert_exercised(out, deep=gamma > 1 and threshold < 0.9)
  if threshold == 0.0:  # no early stop: every round drafts gamma, unless near the end
    assert out.round_drafted[0] == gamma


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("drafter", [
    EarlyExitDrafter(k=2),
    # Three of the four sub-layers SWIFT may skip here (the middle layers): its default two
    # leave a draft qwen2 accepts in full, testing no rejection.
    SwiftDrafter(trials=12, bo_every=5, window=16, skip_ratio=0.75),
    SelfSDDrafter(DraftPlan.from_skips(4, [2], [1])),
])
@pytest.mark.parametrize("threshold", [None, 0.0])  # the drafter's own, and no early stop
def test_every_drafter_is_lossless(arch, drafter, threshold):
  out = ssd(arch, drafter, gamma=4, threshold=threshold)
  assert out.tokens == ar_tokens(arch)
  assert_exercised(out, deep=threshold == 0.0)


def test_swift_changes_plan_without_recompiling():
  ssd("qwen3", SwiftDrafter(trials=4, window=16), gamma=3)  # compiles what it needs
  out = ssd("qwen3", SwiftDrafter(trials=20, bo_every=6, window=16, seed=5), gamma=3,
            record_rounds=True)
  assert out.compiles == 0
  distinct = {json.dumps(p.to_json()) for p in out.plans}
  assert len(distinct) > 1  # it did switch plans mid-generation
  assert out.tokens == ar_tokens("qwen3")


def test_swift_replays_from_its_state(tmp_path):
  """All of SWIFT's randomness is a jax key in its state: one seed proposes the same plans
  every time, and a finished generation's state, continued twice as a prior, gives the
  same run twice (continuing from it never changes it)."""
  plans = lambda out: [p.to_json() for p in out.plans]
  # max_score 2: no plan ends the search early, so every continuation adds trials
  drafter = SwiftDrafter(trials=60, bo_every=5, window=16, seed=3, max_score=2.0)
  first = ssd("qwen3", drafter, gamma=3, record_rounds=True)
  assert plans(first) == plans(ssd("qwen3", drafter, gamma=3, record_rounds=True))
  prior = first.drafter_state
  runs = [ssd("qwen3", drafter, gamma=3, record_rounds=True, drafter_state=prior) for _ in "ab"]
  assert plans(runs[0]) == plans(runs[1])
  # A resumed benchmark goes on from the state its results store kept (an overlay's part
  # dropped: the overlay hands its base the base's state).
  ResultsStore(tmp_path, {"m": 1}, resume=False).save_carried(
      {"frspec+swift": OverlayState(prior, None), "static": None})
  kept = ResultsStore(tmp_path, {"m": 1}, resume=True).load_carried()
  assert list(kept) == ["frspec+swift"]
  resumed = ssd("qwen3", drafter, gamma=3, record_rounds=True, drafter_state=kept["frspec+swift"])
  assert plans(resumed) == plans(runs[0])
  assert prior.trials == first.drafter_state.trials and runs[0].drafter_state.trials > prior.trials
  for bits in prior.xs:  # plan bits: the first and last layers always run
    assert bits[:2].all() and bits[-2:].all()


def test_swift_defaults_and_stopping_rules_are_the_papers():
  """SWIFT's public constants (eval_llama.sh): skip ratio 0.45, a BO proposal every 25th,
  a 32-token window, and a search that ends at a plan scoring 0.9, after 300 candidates
  without a better one, or after 1,000."""
  import jax

  from specjax.drafters.swift import SwiftState
  from specjax.plan import DraftPlan

  d = SwiftDrafter()
  assert (d.skip_ratio, d.bo_every, d.window, d.trials, d.tolerance, d.max_score) == (
      0.45, 25, 32, 1000, 300, 0.9)
  st = lambda **kw: SwiftState(**{**dict(best=DraftPlan.full(4), best_score=0.5, trials=10,
                                         xs=(), ys=(), key=jax.random.key(0),
                                         best_trial=5), **kw})
  assert d.searching(st())
  assert not d.searching(st(best_score=0.9))  # good enough
  assert not d.searching(st(trials=306, best_trial=6))  # 300 without a better plan
  assert d.searching(st(trials=305, best_trial=6))
  assert not d.searching(st(trials=1000, best_trial=999))  # the most it tries
  assert d.rounds_left(st(best_score=0.95), None) is None  # frozen: the loop runs them all
  assert d.rounds_left(st(), None) == 1


def test_self_sd_objective_ranks_an_agreeing_plan_above_a_cheap_useless_one():
  """SmolLM2's figures: a plan of agreement 0.39 at cost 0.81 against one of 0.02 at 0.35.
  At a fixed γ = 4 the useless one scored higher (and decoded at 0.55× with α = 0.01);
  at each plan's best γ the agreeing one does."""
  from specjax.selection.cost import expected_speedup

  agreeing, useless = (0.39, 0.81), (0.02, 0.35)
  assert expected_speedup(*useless[:1], 4, useless[1]) > expected_speedup(*agreeing[:1], 4,
                                                                          agreeing[1])
  assert self_sd.predicted_speedup(*agreeing, 4)[0] > self_sd.predicted_speedup(*useless, 4)[0]
  assert self_sd.predicted_speedup(0.95, 0.3, 8)[1] == 8  # a cheap, agreeable draft wants a long γ


def test_self_sd_search_finds_a_plan_and_is_lossless(tmp_path):
  config, graphdef, state = target("gemma3")
  res = self_sd.search(graphdef, state, config, [PROMPT, list(range(40, 70))], iterations=12,
                       init_points=6, new_tokens=12, verbose=False, drafter_of=SelfSDDrafter)
  assert len({h["objective"] for h in res.history}) > 1  # the target tells plans apart
  assert len(res.history) == 12
  eligible = [h["objective"] for h in res.history if h["skipped"] >= 0.2 * 2 * config.num_layers]
  assert res.objective == max(eligible)
  assert res.plan.active_fraction <= 0.8
  path = tmp_path / "plan.json"
  save_plan(path, res.plan, model="tiny-gemma3")
  plan = load_plan(path, model="tiny-gemma3")
  out = ssd("gemma3", SelfSDDrafter(plan))
  assert out.tokens == ar_tokens("gemma3")
  assert_exercised(out)


def test_self_sd_search_scores_each_candidate_by_its_measured_speedup(monkeypatch):
  """The paper's objective by default: every candidate decodes each search prompt as a
  Self-SD draft (after one unscored warm-up), scored AR's decode time over its own. The
  draft's clock is replaced by one charging each run its plan's active share, so the
  expected scores are exact: AR's time over prompts × active share, and the most skipping
  eligible candidate wins."""
  import dataclasses

  config, graphdef, state = target("gemma3")
  real, runs = self_sd.speculative_generate, []

  def charged(*args, **kw):
    out = real(*args, **kw)
    plan = args[4].fixed
    runs.append((plan, out))
    return dataclasses.replace(out, draft_s=0.0, verify_s=0.0, selection_s=0.0, other_s=0.0,
                               rounds_s=plan.active_fraction)

  monkeypatch.setattr(self_sd, "speculative_generate", charged)
  prompts = [PROMPT, list(range(40, 70))]
  res = self_sd.search(graphdef, state, config, prompts, iterations=6, init_points=6,
                       new_tokens=10, verbose=False, drafter_of=SelfSDDrafter)
  assert res.kind == "measured" and len(runs) == (6 + 1) * len(prompts)
  for h, i in zip(res.history, range(1, 7)):
    (plan, first), (_, second) = runs[2 * i], runs[2 * i + 1]
    assert h["skipped"] == 2 * config.num_layers - int(plan.attn.sum() + plan.mlp.sum())
    assert h["alpha"] == pytest.approx((first.accepted + second.accepted)
                                       / (first.drafted + second.drafted))
    # AR's summed time over the candidate's: the same numerator for every candidate
    assert h["objective"] * len(prompts) * plan.active_fraction == pytest.approx(
        res.history[0]["objective"] * len(prompts) * runs[2][0].active_fraction)
  eligible = [h for h in res.history if h["skipped"] >= 0.2 * 2 * config.num_layers]
  assert res.objective == max(h["objective"] for h in eligible)
  assert int((~res.plan.attn).sum() + (~res.plan.mlp).sum()) == max(
      h["skipped"] for h in eligible)
  with pytest.raises(ConfigError, match="objective must be one of measured, predicted"):
    self_sd.search(graphdef, state, config, prompts, objective="timed", verbose=False)
  with pytest.raises(ConfigError, match="pass drafter_of=specjax.drafters.SelfSDDrafter"):
    self_sd.search(graphdef, state, config, prompts, verbose=False)


def test_a_measured_search_reports_how_the_predicted_objective_ranks_its_candidates():
  """With `rank_check`, a measured search also scores every candidate by the predicted
  objective (teacher-forced on AR's own continuations) and reports Spearman's ρ of the
  two columns: KNN-SSD's libraries quote it, as they time far fewer candidates than the
  paper."""
  from specjax.offline.self_sd_search import plan_agreement, predicted_speedup, spearman

  config, graphdef, state = target("gemma3")
  prompts = [PROMPT, list(range(40, 70))]
  res = self_sd.search(graphdef, state, config, prompts, iterations=5, init_points=5,
                       new_tokens=8, verbose=False, drafter_of=SelfSDDrafter, rank_check=True)
  seqs = self_sd._reference_sequences(graphdef, state, config, prompts, 8)
  for h in res.history[:2]:
    plan = DraftPlan.from_bits(np.asarray(h["bits"]))
    alpha = plan_agreement(graphdef, state, seqs, plan)
    assert h["predicted_alpha"] == pytest.approx(alpha)
    assert h["predicted"] == pytest.approx(predicted_speedup(alpha, h["cost"], 4)[0])
  assert res.rank_agreement == pytest.approx(spearman(
      np.array([h["objective"] for h in res.history]),
      np.array([h["predicted"] for h in res.history])))
  plain = self_sd.search(graphdef, state, config, prompts, iterations=3, init_points=3,
                         new_tokens=8, verbose=False, drafter_of=SelfSDDrafter)
  assert plain.rank_agreement is None and "predicted" not in plain.history[0]
  assert spearman(np.array([1., 2, 3, 4]), np.array([10., 20, 30, 40])) == pytest.approx(1)
  assert spearman(np.array([1., 2, 3, 4]), np.array([4., 3, 2, 1])) == pytest.approx(-1)
  assert spearman(np.array([1., 2, 3, 4]), np.array([1., 3, 2, 4])) == pytest.approx(0.8)
  assert spearman(np.array([1., 1, 2]), np.array([5., 6, 7])) == pytest.approx(0.866, abs=1e-3)
  assert spearman(np.array([1., 1, 1]), np.array([5., 6, 7])) == 0.0


@pytest.mark.parametrize("loop,plan_path", [("host", "cond"), ("device", "cond"),
                                            ("host", "dispatch")])
def test_a_plans_stop_overrides_the_engines_threshold(loop, plan_path):
  """`DraftPlan.stop` is the round's early stop on every path: above any probability it
  ends each draft after one token though the engine's threshold is 0, and at 0 the drafts
  run their full γ though the engine's is 0.99. Output stays the target's."""
  config, graphdef, state = target("llama")
  base = DraftPlan.from_skips(4, [2], [1])
  run = lambda stop, threshold: speculative_generate(
      graphdef, state, config, PROMPT, StaticDrafter(base.replace(stop=jnp.float32(stop))),
      max_new_tokens=24, gamma=4, threshold=threshold, eos_ids=(), loop=loop,
      plan_path=plan_path)
  one, full = run(1.5, 0.0), run(0.0, 0.99)
  assert one.round_drafted == [1] * one.rounds
  assert set(full.round_drafted[:-1]) == {4}  # the last round may be cut by the budget
  assert one.tokens == full.tokens == ar_tokens("llama", n=24)
  with pytest.raises(PlanError, match="stop must be a float32 scalar"):
    base.replace(stop=jnp.zeros(2, jnp.float32)).check(4)


def test_self_sd_adapts_its_stop_after_every_round_as_the_papers_code_does(monkeypatch):
  """The public code's rule (decoding.py, auto_parameters [1, 0.5, 0.9, 1e-2, 0.9]) on a
  scripted run of rounds, threshold and acceptance average worked out by hand; then a
  real generation: its rounds' plans carry the moving threshold, it decodes on the host
  loop, stays lossless (with its plan compiled in where conditionals cost a host round
  trip), and `adaptive_stop=False` is a fixed 0.8 on the device loop."""
  import types

  from specjax.drafters import self_sd as self_sd_drafter
  from specjax.drafters.self_sd import StopState

  plan = DraftPlan.from_skips(4, [2], [1])
  drafter = SelfSDDrafter(plan)
  state = StopState(plan, 0.8, 0.0)
  expected = [(0.801, 0.5), (0.802, 0.75), (0.803, 0.875),
              (0.803, 0.9375),  # average above 0.9 but a full draft: held
              (0.802, 0.96875),  # above 0.9, a short draft: lowered
              (0.803, 0.484375)]  # a rejected draft: raised
  for (drafted, accepted), (stop, average) in zip(
      [(4, 4), (4, 4), (4, 4), (4, 4), (2, 2), (3, 0)], expected):
    out = types.SimpleNamespace(n_drafted=drafted, n_commit=accepted + 1,
                                drafts=np.zeros(4, np.int32))
    state = drafter.update(state, out, None)
    assert (state.stop, state.matchness) == pytest.approx((stop, average))
  assert float(drafter.plan(state).stop) == pytest.approx(0.803)

  config, graphdef, state = target("llama")
  out = speculative_generate(graphdef, state, config, PROMPT, drafter, max_new_tokens=48,
                             eos_ids=(), threshold=0.6, record_rounds=True)
  stops = [float(p.stop) for p in out.plans]
  assert out.loop == "host" and stops[0] == pytest.approx(0.6)  # starts at the caller's
  assert len(set(stops)) > 1 and out.tokens == ar_tokens("llama")
  fixed = speculative_generate(graphdef, state, config, PROMPT,
                               SelfSDDrafter(plan, adaptive_stop=False), max_new_tokens=8,
                               eos_ids=(), record_rounds=True)
  assert fixed.loop == "device" and fixed.plans[0].stop is None
  assert out.plans[0].frozen is None  # a CPU runs the plan's conditionals in place
  monkeypatch.setattr(self_sd_drafter, "conditionals_skip_cheaply", lambda: False)  # a GPU's
  gpu = speculative_generate(graphdef, state, config, PROMPT, drafter, max_new_tokens=24,
                             eos_ids=(), record_rounds=True)
  assert gpu.plans[0].frozen == plan.freeze().frozen
  assert gpu.tokens == ar_tokens("llama", n=24)


def test_eos_truncates_inside_a_round():
  ref = ar_tokens("llama")
  eos = ref[10]
  config, graphdef, state = target("llama")
  out = speculative_generate(graphdef, state, config, PROMPT, EarlyExitDrafter(k=3),
                             max_new_tokens=48, eos_ids=(eos,), gamma=5, threshold=0.0)
  assert out.tokens == ref[: ref.index(eos) + 1] and out.stopped_on_eos


def _exact_next(model, seq):
  logits, _ = reference_forward(model, jnp.asarray([seq]))
  return logits[0, -1]


@pytest.mark.parametrize("shortlist,top_p", [
    (None, 1.0),  # the plain head
    (None, 0.8),  # top-p: p and q have holes; a sample in one must fail the test
    ((0, 1, 2, 4, 5, 6, 8, 10), 1.0),  # FR-Spec: q scattered from a shortlist onto ids
])
def test_sampling_round_keeps_the_target_distribution(shortlist, top_p):
  """Many independent rounds from one state: the first committed token ~ p, and the
  second one (when a round commits two) ~ p(. | first). The draft is far enough from the
  target for the test to see the classic acceptance bugs (asserted)."""
  config, graphdef, state = target("llama", layers=4, vocab=12)
  model = nnx.merge(graphdef, state)
  sampling = SamplingParams(temperature=1.5, top_p=top_p)
  # Ends with a word of the tiny model's language: after the separator comes the uncertain
  # choice of the next word, where p is spread out.
  prompt = jnp.asarray([[9, 8, 10, 4, 3, 11, 9, 5, 8]], jnp.int32)
  cache = KVCache.create(config, 1, 32)
  first, cache = prefill_step(state, cache, prompt, jnp.int32(9), DraftPlan.full(4),
                              jax.random.key(0), graphdef=graphdef, sampling=sampling)
  plan = DraftPlan.from_skips(4, [1, 2], [2])
  if shortlist is not None:
    plan = plan.with_shortlist(np.asarray(shortlist), 12, eos_ids=[2])
  out = sample_rounds(lambda k: round_fn(
      state, cache, first[0], plan, k, graphdef=graphdef, vocab=12, gamma=3, threshold=0.0,
      sampling=sampling)[0])
  ctx = np.asarray(prompt[0]).tolist() + [int(first[0])]
  q1 = draft_step(state, cache, first[0], plan, jax.random.key(2), jnp.int32(1),
                  graphdef=graphdef, vocab=12, gamma=1,
                  threshold=0.0, sampling=sampling).q_rows[0]
  p = lambda seq: np.asarray(probs(_exact_next(model, seq), sampling), np.float64)
  assert_round_distribution(out, p(ctx), np.asarray(q1, np.float64), lambda t: p(ctx + [t]),
                            gamma=3)


def test_sampling_generation_is_seeded_and_sane():
  a = ssd("gemma3", EarlyExitDrafter(k=3), sampling=SamplingParams(1.5, 0.9), seed=3)
  b = ssd("gemma3", EarlyExitDrafter(k=3), sampling=SamplingParams(1.5, 0.9), seed=3)
  c = ssd("gemma3", EarlyExitDrafter(k=3), sampling=SamplingParams(1.5, 0.9), seed=4)
  assert a.tokens == b.tokens and len(a.tokens) == 48
  assert c.tokens != a.tokens  # the seed drives the draws
  assert_exercised(a)


def test_bad_requests():
  with pytest.raises(ValueError, match="gamma"):
    ssd("llama", EarlyExitDrafter(k=2), gamma=0)
  with pytest.raises(ValueError, match="empty"):
    config, graphdef, state = target("llama")
    speculative_generate(graphdef, state, config, [], EarlyExitDrafter(k=2))
  with pytest.raises(UnknownDrafterError, match="available"):
    drafter_class("medusa")
  with pytest.raises(PlanError, match="4 layers"):
    ssd("llama", StaticDrafter(DraftPlan.full(5)))


def test_plan_file_for_another_model_is_refused(tmp_path):
  path = tmp_path / "p.json"
  save_plan(path, DraftPlan.full(6), model="tiny-llama")
  with pytest.raises(PlanError, match="made for model 'tiny-llama'"):
    load_plan(path, model="smollm2-135m-instruct")
  path.write_text("{not json")
  with pytest.raises(PlanError, match="cannot read"):
    load_plan(path, model="tiny-llama")
