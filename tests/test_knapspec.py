"""CLaSp and KnapSpec as drafters, and the latency profile they read: lossless (greedy ==
AR) whatever they select, draft lengths chosen per round, weights that follow the
profile, and clear errors for bad settings, missing or mismatched profiles."""

from __future__ import annotations

import dataclasses
import functools
import json
import types

import numpy as np
import pytest
from targets import PROMPT, assert_exercised, target

import specjax.drafters.knapspec as knapspec_module
from specjax.decode.draft_length import LOOP_STEPS
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.drafters import ClaspDrafter, KnapSpecDrafter
from specjax.drafters.knapspec import slots_for, tokens_per_time
from specjax.errors import ConfigError
from specjax.plan import DraftPlan, PlanError
from specjax.quant import quantize_weights_int8
from specjax.sampling import SamplingParams
from specjax.selection import profiler
from specjax.selection.profiler import LatencyProfile, MissingProfileError, ProfileMismatchError

tiny = target


def synthetic_profile(layers: int = 4, model: str = "tiny-llama", a: float = 2e-6,
                      b: float = 1e-4, c: float = 3e-4, draft: str = "target") -> LatencyProfile:
  """t_attn(n) = a·n + b, t_mlp = c, exactly (for weight tests and fast drafter tests)."""
  lengths = (128, 1024, 4096)
  return LatencyProfile(
      model=model, device=profiler.device_name(), dtype="float32", num_layers=layers,
      verify_tokens=5, lengths=lengths, attn=tuple(a * n + b for n in lengths),
      mlp=(c,) * 3, base=(1e-3,) * 3, verify=tuple(8e-3 + 1e-6 * n for n in lengths),
      step=tuple(5e-3 + 5e-7 * n for n in lengths), draft=draft)


def run(drafter, arch="llama", n=40, sampling=SamplingParams(), gamma=5, **kw):
  config, graphdef, state = tiny(arch)
  return speculative_generate(graphdef, state, config, PROMPT, drafter, max_new_tokens=n,
                              gamma=gamma, eos_ids=(), sampling=sampling, **kw)


@functools.cache
def ar(arch="llama", n=40):
  config, graphdef, state = tiny(arch)
  return generate(graphdef, state, config, PROMPT, max_new_tokens=n, eos_ids=()).tokens


@pytest.mark.parametrize("arch,kw", [
    ("llama", dict()), ("gemma3", dict()), ("llama", dict(coupled=True)),
    ("llama", dict(objective="cosine")), ("qwen3", dict(prune=False, window=3)),
    ("llama", dict(realised=True))])
def test_knapspec_is_lossless(arch, kw):
  out = run(KnapSpecDrafter(profile=synthetic_profile(), interval=2, selection_budget=None,
                            **kw), arch)
  assert out.tokens == ar(arch)
  assert_exercised(out)
  sel = out.drafter_state.selections
  assert len(sel) >= 3  # selection reran during the generation
  assert all(1 <= s.gamma <= 6 for s in sel)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_clasp_is_lossless_and_skips_exactly_m(arch):
  out = run(ClaspDrafter(skip=2, interval=2), arch, threshold=0.0)
  assert out.tokens == ar(arch)
  assert_exercised(out, deep=True)
  for bits in out.drafter_state.plans:
    assert np.sum(~bits[0::2]) == 2 and np.array_equal(bits[0::2], bits[1::2])


def test_knapspec_defaults_are_the_papers():
  """By default KnapSpec runs the paper's method: a DP after every round (and at the
  prompt), sub-layers weighed at the context each DP runs at, budgets up to half the full
  model's weight (K/2), values over the last 5 verified tokens."""
  # attention outweighs the MLP as the context grows: 1:2 at 15 tokens, 3:1 at 70
  d = KnapSpecDrafter(profile=synthetic_profile(a=4e-6, b=1e-6, c=1e-4))
  assert (d.interval, d.selection_budget, d.window, d.max_budget_share) == (1, None, 5, 0.5)
  out = run(d, n=60)
  assert out.tokens == ar(n=60)
  st = out.drafter_state
  assert d.selections(st) >= out.rounds - 1
  contexts = [sel.context for sel in st.selections]
  assert contexts == sorted(contexts) and contexts[-1] > contexts[0]  # one per round
  assert np.array_equal(st.weights, d._weights(contexts[-1]))
  assert not np.array_equal(st.weights, d._weights(contexts[0]))
  for sel in st.selections:
    half = 0.5 * float(np.sum(d._weights(sel.context)))
    assert all(c["budget"] <= half for c in sel.candidates)
  # The DP's table stops at K/2: the budgets past it can feed no candidate. (Attention
  # weighs 5, the MLP 1: K = 24, 25 slots for every budget, 13 to K/2, in tables of 16.)
  heavy = KnapSpecDrafter(profile=synthetic_profile(a=0.0, b=6e-4, c=1e-4))
  widths = []
  real = knapspec_module.run_dp
  def spy(*args, slots, **kw):
    widths.append((slots, int(np.sum(args[3]))))
    return real(*args, slots=slots, **kw)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(knapspec_module, "run_dp", spy)
    assert run(heavy, n=60).tokens == ar(n=60)
  assert widths and set(widths) == {(16, 24)}, widths


def test_selection_budget_spaces_selections_and_carries_across_prompts():
  """With a budget, selection waits until the DP's measured cost is within that share of
  the decode time since the last one; the next prompt starts from the
  carried selection instead of a new DP."""
  d = KnapSpecDrafter(profile=synthetic_profile(), interval=2, selection_budget=0.05)
  first = run(d)
  assert first.tokens == ar()
  st = first.drafter_state
  assert st.dp_seconds > 0
  due = lambda **kw: d._due(dataclasses.replace(st, **kw))
  assert not due(rounds=5, since_s=st.dp_seconds / 0.05 * 0.9)
  assert due(rounds=5, since_s=st.dp_seconds / 0.05 * 1.1)
  assert not due(rounds=1, since_s=1e9)  # never before `interval` rounds
  config, graphdef, state = tiny()
  second = speculative_generate(graphdef, state, config, PROMPT, d, max_new_tokens=40,
                                gamma=5, eos_ids=(), drafter_state=st)
  assert second.tokens == ar()
  assert all(s.round > st.total_rounds for s in second.drafter_state.selections)
  # A longer generation reaches longer contexts, where attention weighs more: the carried
  # selection still drafts from the first round, and each DP weighs the sub-layers at the
  # context it runs at. A budget of half the decode time makes a DP due well inside it
  # however loaded the machine (at 5 % one under CI-like load never came due again).
  lenient = dataclasses.replace(d, selection_budget=0.5)
  third = speculative_generate(graphdef, state, config, PROMPT, lenient, max_new_tokens=240,
                               gamma=5, eos_ids=(), drafter_state=second.drafter_state)
  assert third.tokens == ar(n=240)
  t = third.drafter_state
  assert t.selections and t.selections[-1].context > len(PROMPT) + 40
  assert np.array_equal(t.weights, d._weights(t.selections[-1].context))
  assert not np.array_equal(t.weights, d._weights(len(PROMPT)))
  assert all(s.round > second.drafter_state.total_rounds for s in t.selections)
  with pytest.raises(ValueError, match="selection_budget"):
    KnapSpecDrafter(profile=synthetic_profile(), selection_budget=1.5)


def test_a_carried_choice_is_priced_again_at_the_new_context():
  """A carried state's last DP candidates are re-priced at each prompt's context, and
  (`realised`) after each round: where attention grows costly with context, a plan that
  skips attention overtakes the full plan it lost to at a short context, with no DP (the
  budget keeps DPs rare on a CPU; the 1.5B's long prompts drafted with a plan chosen at
  52 tokens before this)."""
  d = KnapSpecDrafter(profile=synthetic_profile(a=1e-7, b=1e-6, c=1e-4), max_gamma=4,
                      selection_budget=0.05, interval=16)  # the budgeted variant carries
  mlp_only, full = np.zeros(8, bool), np.ones(8, bool)
  mlp_only[1::2] = True  # sub-layers alternate attention, MLP
  st = run(d, n=8).drafter_state
  st = dataclasses.replace(st, candidates=(np.stack([full, mlp_only]), np.asarray([1.0, 0.85])),
                           bits=mlp_only, gamma=4, plan=DraftPlan.from_bits(mlp_only))
  assert np.array_equal(d._rechoose(st, 64).bits, full)  # attention cheap: the exact plan
  assert np.array_equal(d._rechoose(st, 4096).bits, mlp_only)  # attention dear: skip it
  # The next prompt (a short one) drafts with the choice priced at its own context,
  # not the carried one.
  config, graphdef, state = tiny()
  out = speculative_generate(graphdef, state, config, PROMPT, d, max_new_tokens=12, gamma=5,
                             eos_ids=(), drafter_state=st, record_rounds=True, loop="host")
  assert out.tokens == ar(n=12)
  assert np.array_equal(out.plans[0].to_bits(), full)


def test_realised_acceptance_is_tallied_per_plan_and_blended():
  """`realised`: every round's accepted drafts and rejection land on the plan that
  drafted it; a selection prices a plan that drafted before between its window estimate
  and what it realised, and one that never drafted at its estimate."""
  from specjax.drafters.knapspec import blended_alpha, plan_key, tally

  out = run(KnapSpecDrafter(profile=synthetic_profile(), interval=2, selection_budget=None,
                            realised=True), threshold=0.0)
  tallies = out.drafter_state.tallies
  drafted, accepted = out.round_drafted[:-1], out.round_accepted[:-1]  # the last: no update
  assert sum(a for a, _ in tallies.values()) == sum(accepted)
  assert sum(r for _, r in tallies.values()) == sum(a < d for d, a in zip(drafted, accepted))
  sel = out.drafter_state.selections
  assert plan_key(sel[-1].chosen_bits) in tallies or out.drafter_state.rounds == 0
  priced = [c for s in sel[1:] for c in s.candidates if c["alpha"] != c["window_alpha"]]
  assert priced  # later selections priced some candidates by their rounds

  # Between DPs the choice is remade among the last DP's candidates: a plan that realised
  # poorly loses to one whose estimate promises more, at no DP.
  d = KnapSpecDrafter(profile=synthetic_profile(), realised=True)
  st = out.drafter_state
  cheap, full = np.zeros(8, bool), np.ones(8, bool)
  cheap[[0, 1]] = True
  cands = (np.stack([cheap, full]), np.asarray([1.0, 1.0]))
  fresh = dataclasses.replace(st, candidates=cands, tallies={}, bits=cheap, gamma=6)
  assert np.array_equal(d._rechoose(fresh, 64).bits, cheap)  # both α̂ = 1: the cheap one
  burnt = dataclasses.replace(fresh, tallies={plan_key(cheap): (2, 40)})
  assert np.array_equal(d._rechoose(burnt, 64).bits, full)

  t = tally(tally({}, np.ones(4, bool), 4, 4), np.ones(4, bool), 4, 1)
  assert t == {plan_key(np.ones(4, bool)): (5, 1)}
  assert blended_alpha(1.0, None, 4) == 1.0
  assert blended_alpha(1.0, (5, 1), 4) == pytest.approx(9 / 10)  # (5 + 4·1) / (6 + 4)
  assert blended_alpha(1.0, (500, 250), 4) == pytest.approx(504 / 754)  # the rounds win


def test_knapspec_uses_the_draft_length_it_chooses():
  """Each round drafts at most the γ of the last selection (the engine caps it). With no
  early stop every draft would run to the engine's γ = 5 if the cap were ignored."""

  class Fixed(KnapSpecDrafter):
    def draft_length(self, state):
      return 2

  # Selections every 4 rounds, not when the DP's measured time fits the budget: the rounds
  # (and the partly accepted draft `deep` asks for) must not depend on the machine's speed.
  out = run(Fixed(profile=synthetic_profile(), interval=4, selection_budget=None), gamma=5,
            threshold=0.0)
  assert out.tokens == ar()
  assert max(out.round_drafted) == 2
  assert_exercised(out, deep=True)


def test_knapspec_sampling_runs_and_stays_in_vocab():
  out = run(KnapSpecDrafter(profile=synthetic_profile(), interval=3),
            sampling=SamplingParams(0.8, 0.9))
  assert len(out.tokens) == 40 and all(0 <= t < 97 for t in out.tokens)


def test_weights_follow_the_profile():
  p = synthetic_profile(a=2e-6, b=1e-4, c=3e-4)
  # n = 100: t_attn = 3e-4 = t_mlp -> all ones.
  np.testing.assert_array_equal(p.weights(100), np.ones(8))
  # n = 1000: t_attn = 2.1e-3 = 7·t_mlp -> attention capped at 5, MLP 1.
  w = p.weights(1000, cap=5)
  np.testing.assert_array_equal(w[0::2], 5)
  np.testing.assert_array_equal(w[1::2], 1)
  # n = 400: t_attn = 9e-4 = 3·t_mlp.
  np.testing.assert_array_equal(p.weights(400)[0::2], 3)
  assert p.t_attn(1000) == pytest.approx(2.1e-3)
  assert p.t_target(1000, 5) == pytest.approx(9e-3)
  assert p.t_target(1000, 1) == pytest.approx(5.5e-3)
  assert slots_for(p.weights(1000)) == 32  # 4·5 + 4·1 + 1 -> rounded up to 16
  assert slots_for(p.weights(1000), 0.5) == 16  # budgets up to 12 (K/2)
  assert slots_for(np.full(40, 5), 0.5) == 112 and slots_for(np.full(40, 5)) == 208


def test_tokens_per_time():
  # α = 0: one token per round; α = 1: γ + 1.
  assert tokens_per_time(np.float64(0.0), 3, 1.0, 2.0) == pytest.approx(1 / 5)
  assert tokens_per_time(np.float64(1.0), 3, 1.0, 2.0) == pytest.approx(4 / 5)
  assert tokens_per_time(np.float64(0.5), 1, 1.0, 1.0) == pytest.approx(1.5 / 2)


def test_measured_profile_round_trips_and_is_checked(tmp_path):
  config, graphdef, state = tiny()

  class Loaded:
    name = "tiny-llama"

  m = Loaded()
  m.config, m.graphdef, m.state = config, graphdef, state
  p = profiler.measure(m, lengths=(64, 128), gamma=2, repeats=2, verbose=False)
  assert p.lengths == (64, 128) and all(t > 0 for t in p.verify + p.step + p.base)
  assert p.loop_steps == LOOP_STEPS  # timed as the device loop pays its steps
  with pytest.raises(ConfigError, match="no context for 16 chained steps"):
    profiler.measure(m, lengths=(20, 128), gamma=2, repeats=2, verbose=False)
  assert p.weights(128).shape == (8,) and p.weights(128).min() >= 1
  path = profiler.save_profile(p, tmp_path / "p.json")
  assert profiler.load_profile("tiny-llama", 4, path) == p
  with pytest.raises(ProfileMismatchError, match="specjax profile --model other"):
    profiler.load_profile("other", 4, path)
  obj = json.loads(path.read_text())
  obj["device"] = "tpu-v9"
  path.write_text(json.dumps(obj))
  with pytest.raises(ProfileMismatchError, match="measured on tpu-v9"):
    profiler.load_profile("tiny-llama", 4, path)
  path.write_text("{not json")
  with pytest.raises(ProfileMismatchError, match="not a valid profile"):
    profiler.load_profile("tiny-llama", 4, path)
  with pytest.raises(MissingProfileError, match="run `specjax profile --model tiny-llama`"):
    profiler.load_profile("tiny-llama", 4, tmp_path / "none.json")
  old = {k: v for k, v in obj.items() if k not in ("dtype", "num_layers", "verify_tokens")}
  path.write_text(json.dumps(old))  # an older specjax's format: say what to run
  with pytest.raises(ProfileMismatchError, match=r"missing \['dtype'.*run `specjax profile"):
    profiler.load_profile("tiny-llama", 4, path)
  del obj["draft"]  # written before 8-bit draft profiles existed: a target-weight profile
  del obj["loop_steps"]  # written before loop timing existed: its steps were host calls
  obj["device"] = p.device
  path.write_text(json.dumps(obj))
  back = profiler.load_profile("tiny-llama", 4, path)
  assert back.draft == "target" and back.loop_steps == 0
  assert back.timing == "each step a call from the host"


def test_int8_draft_profile_is_timed_with_the_8bit_weights_and_kept_apart(tmp_path):
  """`knapspec+8bit` prices its sub-layers at their 8-bit cost: that profile is measured
  with draft steps reading the int8 copies, stored under its own name, and a profile of
  one draft kind is refused where the other is asked for."""
  config, graphdef, state = tiny()
  m = types.SimpleNamespace(name="tiny-llama", config=config, graphdef=graphdef, state=state)
  weights = quantize_weights_int8(state, config.num_layers)
  p = profiler.measure(m, lengths=(64,), gamma=2, repeats=2, verbose=False,
                       draft_weights=weights, loop_steps=0)  # host calls, as the host loop
  assert p.draft == "int8" and all(t > 0 for t in p.base + p.verify + p.step)
  assert p.loop_steps == 0
  assert profiler.profile_path("m", "cpu") != profiler.profile_path("m", "cpu", draft="int8")
  path = profiler.save_profile(p, tmp_path / "p8.json")
  assert profiler.load_profile("tiny-llama", 4, path, draft="int8") == p
  with pytest.raises(ProfileMismatchError, match="reading int8 weights, not target"):
    profiler.load_profile("tiny-llama", 4, path)  # asked for the target-weight draft
  path.write_text(json.dumps({**p.to_json(), "draft": "target"}))
  with pytest.raises(ProfileMismatchError, match="--draft-weights int8"):
    profiler.load_profile("tiny-llama", 4, path, draft="int8")
  for kind in ("int4", "q4_0"):
    with pytest.raises(ProfileMismatchError, match=f"--draft-weights {kind}"):
      profiler.load_profile("tiny-llama", 4, path, draft=profiler.draft_label(kind))
  with pytest.raises(ConfigError, match="unknown draft weights 'int5'"):
    profiler.draft_label("int5")


def test_profiles_saved_under_bit_labels_still_load(tmp_path, monkeypatch):
  """Before copies were named by kind, the int8 and QuantSpec int4 profiles were labelled
  "8bit" and "4bit" (in the file and its name): they load as "int8" and "int4", and a
  "4bit" profile is never taken for the Q4_0 copy's."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  for old, kind in (("8bit", "int8"), ("4bit", "int4")):
    p = synthetic_profile(4, draft=kind)
    path = profiler.profile_path("tiny-llama", draft=old)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**p.to_json(), "draft": old}))
    assert profiler.load_profile("tiny-llama", 4, draft=kind) == p
  with pytest.raises(profiler.MissingProfileError, match="--draft-weights q4_0"):
    profiler.load_profile("tiny-llama", 4, draft="q4_0")


def test_bad_settings_are_clear_errors():
  p = synthetic_profile()
  for tau in (0.0, -0.1, 1.5):
    with pytest.raises(ValueError, match="tau must be in"):
      KnapSpecDrafter(profile=p, tau=tau)
  with pytest.raises(TypeError, match="'profile'"):  # a required constructor argument
    KnapSpecDrafter()
  with pytest.raises(ValueError, match="needs a latency profile"):
    KnapSpecDrafter(profile=None)
  with pytest.raises(ValueError, match="objective"):
    KnapSpecDrafter(profile=p, objective="speed")
  for share in (0.0, 1.5):
    with pytest.raises(ValueError, match="max_budget_share must be in"):
      KnapSpecDrafter(profile=p, max_budget_share=share)
  with pytest.raises(ProfileMismatchError, match="8 layers"):
    run(KnapSpecDrafter(profile=synthetic_profile(layers=8)))
  with pytest.raises(PlanError, match="cannot skip 9 layers of a 4-layer"):
    run(ClaspDrafter(skip=9))
  with pytest.raises(PlanError, match="cannot skip -1"):
    ClaspDrafter(skip=-1)


def test_prompt_window_scores_agreement_with_the_target_not_the_text():
  """The window's next tokens after prefill are the target's own top-1 choices at those
  positions (what α̂ must agree with), not the prompt text's next tokens."""
  from specjax.decode.generate import prefill_prompt
  from specjax.decode.session import Session
  from specjax.selection.layer_probe import prompt_window

  config, graphdef, state = tiny()
  pre = prefill_prompt(graphdef, state, config, PROMPT, sampling=SamplingParams(), seed=0,
                       kv_cache=None, size=64)
  session = Session(graphdef, state, config, pre.cache, list(PROMPT) + [int(pre.first[0])])
  window = prompt_window(session, 4)
  n = len(PROMPT)
  want = [generate(graphdef, state, config, PROMPT[: p + 1], max_new_tokens=1,
                   eos_ids=()).tokens[0] for p in range(n - 4, n)]
  assert np.asarray(window.next_tokens).tolist() == want
  assert want != PROMPT[n - 3:] + [want[-1]]  # the text would have said otherwise
