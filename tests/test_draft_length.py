"""Draft length and early-stop threshold from the measured trade-off: acceptance from
rounds, the replay of a pilot's rounds and its best (γ, τ), step costs measured on a model,
and `specjax bench --auto-gamma` end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from targets import target
from test_bench import ARGS
from test_data import write_spec_bench

from specjax.cli import main
from specjax.decode import draft_length
from specjax.decode.draft_length import (
    PilotRound,
    PilotTrack,
    StepCosts,
    acceptance,
    best_length_and_threshold,
    replay_tpt,
    round_at,
)
from specjax.plan import DraftPlan


def test_acceptance_counts_accepted_tokens_over_accepted_plus_rejections():
  # rounds of 4 drafts: all kept, 2 kept then a rejection, a rejection at once
  assert acceptance([4, 4, 4], [4, 2, 0]) == 6 / 8
  assert acceptance([3, 3], [3, 3]) == 1.0
  with pytest.raises(ValueError, match="no drafted token"):
    acceptance([], [])


def test_verify_cost_interpolates_between_measured_gammas():
  c = StepCosts(draft=0.5, verify={1: 1.1, 4: 1.4, 8: 2.2})
  assert c.verify_at(1) == 1.1 and c.verify_at(8) == 2.2
  assert c.verify_at(2) == pytest.approx(1.2)
  assert c.verify_at(6) == pytest.approx(1.8)
  assert c.verify_at(10) == pytest.approx(2.6)  # extrapolated from the last two


def track(*rounds: PilotRound) -> list[PilotTrack]:
  return [PilotTrack.from_rounds(rounds)]


def test_a_track_lays_the_pilots_rounds_out_by_position():
  t = PilotTrack.from_rounds([PilotRound((0.9, 0.2, 0.8, 0.7), accepted=1),
                              PilotRound((0.6, 0.5), accepted=2)])
  # round 1: one accepted, then rejected at 0.2 (drafts 0.8, 0.7 followed on a wrong token);
  # round 2: both accepted, then the target's next token, which no draft reached
  assert t.confidence == (0.9, 0.2, 0.6, 0.5, 1.0)
  assert t.correct == (True, False, True, True, True)
  assert t.after_rejection == ((), (0.8, 0.7), (), (), ())


def test_a_round_under_a_threshold_stops_after_its_first_unsure_draft():
  t = PilotTrack.from_rounds([PilotRound((0.9, 0.3, 0.9, 0.9, 0.9), 5)])
  assert round_at(t, 0, 4, 0.5) == (2, 3)  # the unsure draft is kept, accepted, +1
  assert round_at(t, 0, 4, 0.0) == (4, 5)
  assert round_at(t, 2, 4, 0.5) == (4, 4)  # 4 drafts, 3 positions left: commits 3 + 1 = 4
  assert round_at(t, 5, 4, 0.5) == (1, 1)  # the last position: 1 draft, 1 token
  # a wrong draft: drafting goes on with what the pilot drafted after it, up to an unsure
  # one (the round still commits only the drafts before the wrong one, plus one)
  w = PilotTrack.from_rounds([PilotRound((0.9, 0.8, 0.9, 0.3, 0.9), 1)])
  assert round_at(w, 0, 5, 0.0) == (5, 2)
  assert round_at(w, 0, 5, 0.5) == (4, 2)
  assert round_at(w, 0, 8, 0.0) == (8, 2)  # past what the pilot drafted: sure drafts


def test_replay_prices_rounds_at_the_executables_gamma():
  c = StepCosts(draft=0.5, verify={1: 1.0, 4: 2.0})
  t = track(PilotRound((0.9, 0.2, 0.9, 0.9), accepted=1), PilotRound((0.9,) * 4, accepted=4))
  # τ = 0: 4 drafts per round, commits 2 and 5, each costing 4·0.5 + v(4) = 4
  assert replay_tpt(t, 4, 0.0, c) == pytest.approx(7 / 8)
  # τ = 0.5 cuts the first round after 2 drafts: commits 1 + 1 at 2·0.5 + v(4) = 3
  assert replay_tpt(t, 4, 0.5, c) == pytest.approx(7 / 7)


def test_a_round_cut_short_is_followed_by_one_from_where_it_stopped():
  """The early stop costs what it costs: the text it leaves undrafted is drafted again by
  the next round (the rounds-for-rounds replay counted it as never there)."""
  c = StepCosts(draft=0.4, verify={4: 1.3})
  # sure, sure, unsure-but-right, sure, then the target's token: 5 positions
  t = track(PilotRound((0.95, 0.95, 0.3, 0.95), 4))
  assert replay_tpt(t, 4, 0.0, c) == pytest.approx(5 / (4 * 0.4 + 1.3))
  # τ = 0.4: a round of 3 drafts commits 4; the next, from position 4, 1 draft and 1 token
  assert replay_tpt(t, 4, 0.4, c) == pytest.approx(5 / (3 * 0.4 + 1.3 + 0.4 + 1.3))


def _rounds(unsure_accepted: bool, n: int = 60) -> list[PilotTrack]:
  """Pilot rounds of 8 drafts: runs of 2 to 7 sure ones (p = 0.95), then an unsure one
  (p = 0.3), accepted or rejected; run lengths at random, so that no γ lines its rounds up
  with the unsure positions."""
  runs = np.random.default_rng(0).integers(2, 8, n)
  return track(*[PilotRound((0.95,) * k + (0.3,) + (0.95,) * (7 - k),
                            8 if unsure_accepted else k) for k in runs])


def test_threshold_follows_what_unsure_drafts_do():
  c = StepCosts(draft=0.4, verify={1: 1.1, 4: 1.3, 8: 1.5})
  # A near-exact draft (8-bit weights): unsure yet accepted, so no early stop pays.
  assert best_length_and_threshold(_rounds(True), c, 8) == (8, 0.0)
  # A draft whose unsure tokens are rejected: stop right after them (the lowest τ above
  # 0.3), keeping the long rounds the sure ones earn.
  g, tau = best_length_and_threshold(_rounds(False), c, 8)
  assert tau == 0.4 and g >= 4
  assert replay_tpt(_rounds(False), g, 0.4, c) > replay_tpt(_rounds(False), g, 0.0, c)
  # One sure draft, then an unsure one that is rejected: the free fit drafts one token; a
  # drafter that keeps its own γ (KnapSpec) gets the τ that cuts its rounds there instead.
  second_rejected = track(*[PilotRound((0.95, 0.3, 0.95, 0.95), 1)] * 10)
  assert best_length_and_threshold(second_rejected, c, 4) == (1, 0.0)
  assert best_length_and_threshold(second_rejected, c, 4, fixed_gamma=True) == (4, 0.4)
  with pytest.raises(ValueError, match="no rounds"):
    best_length_and_threshold([], c, 4)
  with pytest.raises(ValueError, match="gamma_max"):
    best_length_and_threshold(_rounds(True), c, 0)


def test_an_early_stop_is_priced_at_its_own_draft_step():
  """τ > 0 drafts in a loop of unknown length, dearer per step on a GPU (a predicate each
  step): replay prices such rounds at that cost, τ = 0 at the known-length one, and a
  dear enough early stop no longer pays where an equal price made τ = 0.4 win."""
  plain = StepCosts(draft=0.4, verify={1: 1.1, 4: 1.3, 8: 1.5})
  dear = StepCosts(draft=0.4, verify=plain.verify, draft_early_stop=0.6)
  rounds = _rounds(False)
  assert replay_tpt(rounds, 8, 0.0, dear) == replay_tpt(rounds, 8, 0.0, plain)
  assert replay_tpt(rounds, 8, 0.4, dear) == replay_tpt(
      rounds, 8, 0.4, StepCosts(draft=0.6, verify=plain.verify))
  assert best_length_and_threshold(rounds, plain, 8)[1] == 0.4
  assert best_length_and_threshold(rounds, dear, 8)[1] == 0.0


@settings(max_examples=40, deadline=None)
@given(rounds=st.lists(st.tuples(st.lists(st.floats(0, 1), min_size=4, max_size=4),
                                 st.integers(0, 4)), min_size=1, max_size=12),
       draft=st.floats(0.05, 1.0))
def test_the_fit_is_the_best_of_its_grid(rounds, draft):
  c = StepCosts(draft=draft, verify={1: 1.1, 4: 1.4})
  ts = track(*[PilotRound(tuple(p), a) for p, a in rounds])
  g, tau = best_length_and_threshold(ts, c, 4)
  best = replay_tpt(ts, g, tau, c)
  assert all(best >= replay_tpt(ts, h, t, c) - 1e-12
             for h in range(1, 5) for t in draft_length.THRESHOLDS)


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(st.tuples(st.lists(st.floats(0, 1), min_size=1, max_size=6),
                                 st.integers(0, 6)), min_size=1, max_size=10),
       gamma=st.integers(1, 8), tau=st.sampled_from(draft_length.THRESHOLDS))
def test_replayed_rounds_cover_the_text_once(rounds, gamma, tau):
  """Rounds tile the pilot's text: each commits 1 to γ + 1 tokens from where the last one
  stopped, drafts 1 to γ, and together they commit exactly its length."""
  t = PilotTrack.from_rounds([PilotRound(tuple(p), a) for p, a in rounds])
  pos = 0
  while pos < len(t):
    n, c = round_at(t, pos, gamma, tau)
    assert 1 <= n <= gamma and 1 <= c <= min(n + 1, len(t) - pos)
    pos += c
  assert pos == len(t)


def test_pilot_rounds_record_each_drafts_probability():
  from specjax.decode.engine import speculative_generate
  from specjax.drafters import StaticDrafter

  config, graphdef, state = target("llama")
  d = StaticDrafter(DraftPlan.first_layers(config.num_layers, 2))
  g = speculative_generate(graphdef, state, config, [1, 2, 3, 4], d, max_new_tokens=16,
                           gamma=3, threshold=0.6, record_rounds=True, loop="host", eos_ids=())
  rounds = draft_length.pilot_rounds(g)
  assert len(rounds) == g.rounds and [len(r.confidence) for r in rounds] == g.round_drafted
  for r in rounds:
    assert all(0 < p <= 1 for p in r.confidence)
    assert all(p >= 0.6 for p in r.confidence[:-1])  # early stop: only the last is unsure
  with pytest.raises(ValueError, match="record_rounds"):
    draft_length.pilot_rounds(speculative_generate(graphdef, state, config, [1, 2, 3, 4], d,
                                                   max_new_tokens=8, gamma=3, eos_ids=()))


def test_step_costs_are_ratios_to_the_ar_step(monkeypatch):
  """The division, on times we choose: the measured ones below are machine noise."""
  config, graphdef, state = target("llama")
  plan = DraftPlan.first_layers(config.num_layers, 3)
  seen = []

  def fixed_times(graphdef, state, config, plans, *, gammas, loop, early_stop, **_):
    seen.append((sorted(plans), loop, tuple(early_stop)))
    return draft_length.StepTimes(ar=2.0, verify={g: 1.0 + g for g in gammas},
                                  drafts={"plan": 0.5, "early stop": 0.75})

  monkeypatch.setattr(draft_length, "step_times", fixed_times)
  c = draft_length.measure_step_costs(graphdef, state, config, plan, gammas=(1, 4),
                                      device_loop=True)
  assert (c.draft, c.draft_early_stop, c.verify) == (0.25, 0.375, {1: 1.0, 4: 2.5})
  host = draft_length.measure_step_costs(graphdef, state, config, plan, gammas=(1,),
                                         early_stop=False)
  assert host.draft == host.draft_early_stop == 0.375  # the host loop's only draft step
  assert seen == [(["early stop", "plan"], draft_length.LOOP_STEPS, ("early stop",)),
                  (["early stop"], 0, ("early stop",))]


def test_step_costs_measured_on_a_model_cover_every_step():
  config, graphdef, state = target("llama")
  plan = DraftPlan.first_layers(config.num_layers, 3)
  c = draft_length.measure_step_costs(graphdef, state, config, plan, gammas=(1, 4), context=32,
                                      repeats=3, device_loop=True)
  assert set(c.verify) == {1, 4}
  positive = [c.draft, c.draft_early_stop, *c.verify.values()]
  assert all(math.isfinite(x) and x > 0 for x in positive)
  assert c.draft_at(0.0) == c.draft and c.draft_at(0.3) == c.draft_early_stop
  alone = draft_length.measure_step_costs(graphdef, state, config, plan, gammas=(1,),
                                          context=32, repeats=1, device_loop=True,
                                          early_stop=False)
  assert alone.draft_early_stop is None and alone.draft_at(0.3) == alone.draft
  # the host loop drafts up to a traced limit, a loop of unknown length whatever τ
  host = draft_length.measure_step_costs(graphdef, state, config, plan, gammas=(1,),
                                         context=32, repeats=1, early_stop=False)
  assert math.isfinite(host.draft) and 0 < host.draft == host.draft_early_stop


def test_bench_auto_gamma_records_and_reuses_the_chosen_lengths(tmp_path, capsys):
  root = write_spec_bench(tmp_path / "data")
  out = tmp_path / "run"
  argv = ["bench", *ARGS, "--drafters", "early_exit,8bit,knapspec+8bit", "--auto-gamma",
          "--data-dir", str(root), "--out", str(out)]
  assert main(argv) == 0
  saved = json.loads((out / "draft_lengths.json").read_text())
  assert set(saved) == {"early_exit", "8bit", "knapspec+8bit"}
  assert all(v["threshold"] in draft_length.THRESHOLDS for v in saved.values())
  assert saved["knapspec+8bit"]["gamma"] == 3  # KnapSpec picks its own γ: τ alone is fitted
  # the rounds of several held-out prompts, pooled (3 categories: a pilot from each)
  assert all(v["pilot_prompts"] == 3 and v["pilot_rounds"] >= 3 for v in saved.values())
  assert all(v["draft_cost_early_stop"] > 0 for v in saved.values())  # τ > 0 was a choice
  records = [r for line in (out / "results.jsonl").read_text().splitlines()
             for r in json.loads(line)["records"]]
  assert records
  for r in records:
    if r["method"] != "ar":
      assert r["gamma"] == saved[r["method"]]["gamma"] and 1 <= r["gamma"] <= 3
      assert r["threshold"] == saved[r["method"]]["threshold"]
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert all(m["mismatches"] in (0, None) for m in figures["methods"].values())
  (out / "draft_lengths.json").write_text(json.dumps(
      {k: dict(v, gamma=1) for k, v in saved.items()}))  # a resumed run reuses the file
  (out / "results.jsonl").write_text("")
  assert main(argv + ["--resume"]) == 0
  records = [r for line in (out / "results.jsonl").read_text().splitlines()
             for r in json.loads(line)["records"]]
  assert {r["gamma"] for r in records if r["method"] != "ar"} == {1}


@given(st.floats(0.0, 1.0), st.integers(1, 12))
def test_expected_tokens_is_the_geometric_sum(alpha, gamma):
  """One closed form prices every γ and plan choice: Σ_{i ≤ γ} α^i, γ + 1 at α = 1,
  growing with α and with γ."""
  from specjax.selection.cost import expected_tokens

  e = float(expected_tokens(alpha, gamma))
  assert e == pytest.approx(sum(alpha ** i for i in range(gamma + 1)), rel=1e-6, abs=1e-9)
  assert 1.0 <= e <= gamma + 1
  assert float(expected_tokens(min(alpha + 0.01, 1.0), gamma)) >= e - 1e-12
  assert float(expected_tokens(alpha, gamma + 1)) >= e


def test_the_lengths_table_shows_the_early_stop_price_where_a_fit_has_one():
  from specjax.bench.runner import _lengths_table

  fit = {"alpha": 0.9, "draft_cost": 0.5, "verify_cost": {"4": 1.2}, "gamma": 4,
         "threshold": 0.3, "replayed_tpt": 2.0, "pilot_rounds": 7}
  table = _lengths_table({"new": {**fit, "draft_cost_early_stop": 0.55}, "old": fit})
  assert "| new | 7 | 0.900 | 0.500 (0.550 with τ > 0) | γ=4: 1.20 |" in table
  assert "| old | 7 | 0.900 | 0.500 | γ=4: 1.20 |" in table  # fitted before 2026-12-04


def test_run_pilot_times_steps_as_the_drafters_loop_pays_them(monkeypatch):
  """`run_pilot` decodes each prompt (rounds recorded, no early stop), pools them, and
  times the steps in the loop the drafter's rounds will run in: a fixed plan's in the
  device loop (steps chained in one jitted loop, the plan traced on a CPU), a drafter that
  updates after every round as host calls. Verification is measured at 1, γ/2 and γ, so a
  fit at any γ ≤ the pilot's reads measured costs around it."""
  from test_round_loop import _EveryRound

  from specjax.drafters import StaticDrafter

  config, graphdef, state = target("llama")
  plan = DraftPlan.from_skips(config.num_layers, [1, 3], [2])
  seen = []
  timed = draft_length.step_times

  def spy(*args, **kw):
    seen.append(kw)
    return timed(*args, **{**kw, "repeats": 1})

  monkeypatch.setattr(draft_length, "step_times", spy)
  prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
  for drafter, loop in ((StaticDrafter(plan), draft_length.LOOP_STEPS), (_EveryRound(plan), 0)):
    pilot = draft_length.run_pilot(graphdef, state, config, drafter, prompts, gamma=6,
                                   max_new_tokens=20)
    kw = seen.pop()
    assert kw["loop"] == loop and tuple(kw["gammas"]) == (1, 3, 6)
    assert sorted(pilot.costs.verify) == [1, 3, 6]
    assert len(pilot.tracks) == 2 and all(len(t) >= 19 for t in pilot.tracks)
    assert pilot.rounds >= 2 and 0 < pilot.alpha < 1  # the skip plan is rejected in part
    if loop:  # the device loop drafts a fixed plan in a loop of known length
      assert pilot.costs.draft_early_stop is not None
    else:  # the host loop's draft takes a traced limit: only that step is timed
      assert pilot.costs.draft == pilot.costs.draft_early_stop
