"""The drafter factory: names, options, and the composition matrix — every overlay on every
layer drafter, and overlay pairs in both orders, lossless on a tiny model."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
from targets import PROMPT, target
from test_dynaspec import bundle
from test_knapspec import synthetic_profile
from test_knn import tiny_library

from specjax.bench import harness
from specjax.bench.harness import Reference, RunSettings
from specjax.drafters import UnknownDrafterError
from specjax.drafters.factory import DrafterFactory
from specjax.drafters.names import BASES, OVERLAYS, DrafterNameError, parse
from specjax.errors import ConfigError
from specjax.plan import DraftPlan, save_plan
from specjax.quant_kv_cache import QuantKV
from specjax.selection import profiler

KV = QuantKV(group=8, residual=16)
SETTINGS = RunSettings(max_new_tokens=24, gamma=4)


@functools.cache
def model():
  config, graphdef, state = target("llama", 4, 97)
  return types.SimpleNamespace(name="tiny-llama", config=config, graphdef=graphdef,
                               state=state)


@functools.cache
def factory(plan_path: str) -> DrafterFactory:
  return small_factory(model(), plan_path)


def small_factory(of, plan_path: str) -> DrafterFactory:
  """Every drafter of the tiny llama target `of` (its state placed anywhere: one device or
  a mesh) from small artefacts made here, no search or training: what the composition
  tests and the tensor-parallel tests build."""
  skip = DraftPlan.from_skips(4, [1], [2])
  counts = np.bincount(np.asarray(PROMPT) % 97, minlength=97).astype(np.int64) + 1
  return DrafterFactory(
      of, gamma=4, verbose=False,
      options={"static": {"plan": plan_path}, "clasp": {"interval": 3, "skip": 1},
               "knapspec": {"interval": 4, "window": 2, "selection_budget": None},
               "quantspec": {"group": KV.group, "residual": KV.residual},
               "frspec": {"size": 48}, "swift": {"trials": 4, "bo_every": 4, "window": 8},
               # 10 and 16 of the prompt's 37 slots
               "streaming_kv": {"sinks": 2, "recent": 8},
               "snapkv": {"keep": 6, "recent": 10, "window": 8}},
      artefacts={"profile": synthetic_profile(4), "library": tiny_library("llama"),
                 "int8_profile": synthetic_profile(4, c=1e-4, draft="int8"),
                 "int4_profile": synthetic_profile(4, c=2e-4, draft="int4"),
                 "q4_0_profile": synthetic_profile(4, c=5e-5, draft="q4_0"),
                 "counts": counts, "bundle": bundle("llama")[0], "self_sd_plan": skip})


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("plans") / "static.json"
  save_plan(path, DraftPlan.from_skips(4, [2], [1]), model="tiny-llama")
  return str(path)


def matrix() -> list[str]:
  # `early_exit` is a fixed plan to an overlay, as `static` is (the same two methods, a
  # different plan): it decodes alone in the engine's and the mesh's tests
  names = [f"{b}+{o}" for b in BASES if b != "early_exit" for o in OVERLAYS]
  names += list(OVERLAYS)
  pairs = [("8bit", "frspec"), ("8bit", "dynaspec"), ("4bit", "frspec"), ("4bit", "dynaspec"),
           ("quantspec", "frspec"), ("quantspec", "dynaspec")]
  names += [f"{a}+{b}" for a, b in pairs] + [f"{b}+{a}" for a, b in pairs]
  return names + ["knapspec+8bit+dynaspec", "clasp+quantspec+frspec"]


def test_composition_matrix_is_lossless(plan_file):
  """Greedy SSD == greedy AR for every composition (QuantSpec's against AR on its own
  quantised cache), in one harness run as `specjax bench` makes them."""
  f = factory(plan_file)
  drafters = {name: f.make(name) for name in matrix()}
  refs = (Reference(), Reference("ar_q", KV))
  recs = harness.run_prompt(model(), PROMPT, drafters, SETTINGS, references=refs)
  by_name = {r["method"]: r for r in recs}
  bad = [n for n in drafters if not by_name[n]["matches_ar"]]
  assert not bad, f"not lossless: {bad}"
  for name, d in drafters.items():
    expected = "ar_q" if "quantspec" in name else "ar"
    assert by_name[name]["reference"] == expected, name
    assert (d.kv_cache == KV) == ("quantspec" in name), name
  assert sum(by_name[n]["drafted"] for n in drafters) > 0


def test_compositions_set_the_fields_of_each_part(plan_file):
  f = factory(plan_file)
  d = f.make("knapspec+8bit+dynaspec")
  assert (d.name, d.base.name, d.base.base.name) == ("dynaspec", "8bit", "knapspec")
  assert d.own_gamma and d.wants_residuals  # KnapSpec's policy passes through
  assert d.base.base.profile.draft == "int8"  # priced at the 8-bit sub-layer times
  assert f.make("knapspec+dynaspec").base.profile.draft == "target"
  # QuantSpec prices KnapSpec at the times of the weights it drafts with (the paper's 4
  # bits by default, or 8), and its drafter, profile and search share one copy
  for bits, kind in ((8, "int8"), (4, "int4"), (16, None)):
    g = DrafterFactory(model(), gamma=4, verbose=False,
                       options={"quantspec": {"weight_bits": bits}}, artefacts=f.artefacts)
    d = g.make("knapspec+quantspec")
    assert d.base.profile.draft == profiler.draft_label(kind)
    assert d.weights is g.store.draft_weights(kind)
    assert d.weights is None or (d.weights.bits, d.weights.kind) == (bits, kind)
    assert g.draft_kind("self_sd+quantspec") == kind
  names = ("knapspec", "knapspec+dynaspec", "8bit+frspec", "self_sd+4bit+frspec")
  assert [f.draft_kind(n) for n in names] == [None, None, "int8", "q4_0"]
  # under 4bit, KnapSpec prices its sub-layers at their Q4_0 times
  assert f.make("knapspec+4bit+frspec").base.base.profile.draft == "q4_0"
  with pytest.raises(ConfigError, match="unknown draft weights 'int5'"):
    f.store.draft_weights("int5")
  five = DrafterFactory(model(), verbose=False, options={"quantspec": {"weight_bits": 5}})
  with pytest.raises(ConfigError, match="4, 8 or 16 bits, got 5"):
    five.make("knapspec+quantspec")
  q = f.make("frspec+quantspec")  # FR-Spec alone, under QuantSpec
  assert q.name == "quantspec" and q.base.name == "frspec" and q.kv_cache == KV
  assert f.make("8bit").weights is f.make("self_sd+8bit").weights  # one int8 copy
  assert f.make("quantspec").weights is f.store.int4_weights  # the paper's 4-bit MLP
  assert f.make("quantspec").weights is f.make("self_sd+quantspec").weights  # one copy
  assert f.make("4bit").weights is f.make("early_exit+4bit+frspec").base.weights  # one Q4_0
  assert f.make("4bit").weights is f.make("knapspec+4bit").weights
  assert (f.make("4bit").weights.bits, f.make("4bit").weights.kind) == (4, "q4_0")


def test_dynaspec_core_is_the_most_frequent_tokens(plan_file):
  """`{"dynaspec": {"core": n}}` scores FR-Spec's n most frequent tokens beside the
  routed clusters; without token counts that is a clear error."""
  from specjax.offline.token_counts import frequent_shortlist

  f = factory(plan_file)
  assert f.make("dynaspec").core is None
  options = {"dynaspec": {"core": 16}}
  cored = DrafterFactory(model(), gamma=4, verbose=False, options=options,
                         artefacts=f.artefacts).make("knapspec+dynaspec")
  counts, cfg = f.artefacts["counts"], model().config
  np.testing.assert_array_equal(cored.core, frequent_shortlist(counts, 16, cfg.eos_ids))
  no_counts = {k: v for k, v in f.artefacts.items() if k != "counts"}
  with pytest.raises(ValueError, match="core needs token counts"):
    DrafterFactory(model(), gamma=4, verbose=False, options=options,
                   artefacts=no_counts).make("dynaspec")


@pytest.mark.parametrize("name, message", [
    ("", "empty part"), ("self_sd+", "empty part"), ("medusa", "unknown drafter 'medusa'"),
    ("early_exit+swift", "'swift' is a layer drafter"),
    ("8bit+knapspec", "'knapspec' is a layer drafter"),
    ("frspec+dynaspec", "frspec and dynaspec both set the draft's vocab"),
    ("quantspec+8bit", "quantspec and 8bit both set the draft's weights"),
    ("8bit+8bit", "8bit and 8bit both set"),
    ("4bit+8bit", "4bit and 8bit both set the draft's weights"),
])
def test_bad_names_are_refused_with_the_reason(name, message):
  with pytest.raises((DrafterNameError, UnknownDrafterError)) as err:
    parse(name)
  assert message in str(err.value)


def test_bad_options_are_refused_with_the_valid_ones():
  with pytest.raises(DrafterNameError, match="knapspec has no option 'taux'.*tau"):
    DrafterFactory(model(), options={"knapspec": {"taux": 0.3}})
  with pytest.raises(DrafterNameError, match="options for 'medusa'"):
    DrafterFactory(model(), options={"medusa": {}})
  with pytest.raises(ValueError, match="unknown artefact 'router'"):
    DrafterFactory(model(), artefacts={"router": None})
  with pytest.raises(ValueError, match="needs a plan file"):
    DrafterFactory(model()).make("static")


def test_default_references_cover_every_cache_a_drafter_reads(plan_file):
  """Without explicit references, a QuantSpec drafter is compared with AR on its own
  quantised cache, which the summary treats as a reference (no M, no mismatch count)."""
  from specjax.bench import metrics

  f = factory(plan_file)
  drafters = {"quantspec": f.make("quantspec"), "8bit": f.make("8bit")}
  recs = harness.run_prompt(model(), PROMPT, drafters, RunSettings(max_new_tokens=8))
  assert [r["method"] for r in recs] == ["ar", "ar_int8kv", "quantspec", "8bit"]
  assert [r.get("reference") for r in recs] == [None, None, "ar_int8kv", "ar"]
  s = metrics.summarize(recs)
  assert s["ar_int8kv"]["mismatches"] is None and "M" not in s["ar_int8kv"]
  assert s["quantspec"]["mismatches"] == 0 and s["8bit"]["mismatches"] == 0
  # one prefill per cache type, shared by the runs that read it
  prefill = {r["method"]: r["prefill_s"] for r in recs}
  assert prefill["8bit"] == prefill["ar"] and prefill["quantspec"] == prefill["ar_int8kv"]
  assert prefill["ar"] != prefill["ar_int8kv"]


def test_overlays_hand_their_base_its_own_prior(plan_file):
  """Under an overlay SWIFT keeps optimising across prompts, as it does alone (the
  overlay's state wraps the base's: the base must get its own part back)."""
  counts = np.bincount(np.asarray(PROMPT) % 97, minlength=97).astype(np.int64) + 1
  f = DrafterFactory(model(), gamma=4, verbose=False, artefacts={"counts": counts},
                     options={"frspec": {"size": 48},
                              # max_score 2: no plan ends the search before prompt two
                              "swift": {"trials": 100, "bo_every": 4, "window": 8,
                                        "max_score": 2.0}})
  names = ("swift", "swift+8bit", "swift+8bit+frspec")
  drafters = {n: f.make(n) for n in names}
  base = lambda s: s if hasattr(s, "trials") else base(s.base)
  carried: dict = {}
  trials = []
  for _ in range(2):
    recs = harness.run_prompt(model(), PROMPT, drafters, SETTINGS, carried=carried)
    assert all(r["matches_ar"] for r in recs if r["method"] in names)
    trials.append({n: base(carried[n]).trials for n in names})
  for n in names:
    assert trials[1][n] > trials[0][n] > 0, n  # the second prompt went on counting


def test_frspec_counts_its_tokens_without_training_a_router(tmp_path, monkeypatch):
  """With no counts at hand, `frspec` counts them from training prompts and the model's
  continuations, and trains no DynaSpec router: on Qwen2.5-0.5B that router took longer
  than the counts, and FR-Spec never reads it. A second factory reuses the counts."""
  import json

  from specjax.offline import shortlists
  from specjax.offline.token_counts import frequent_shortlist, load_counts

  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  prompts = [PROMPT[:8], PROMPT[5:15]]
  monkeypatch.setattr(shortlists, "training_prompts", lambda tok, n, data_dir=None: prompts)
  monkeypatch.setattr(shortlists, "build", None)  # the router's build would fail
  m = types.SimpleNamespace(**vars(model()), tokenizer=None)  # the prompts come tokenised
  d = DrafterFactory(m, gamma=4, verbose=False, options={"frspec": {"size": 48}}
                     ).make("frspec")
  out = tmp_path / "shortlists" / "tiny-llama"
  assert not (out / "router").exists()
  seqs = json.loads((out / "sequences.json").read_text())
  assert [s[: len(p)] for s, p in zip(seqs, prompts)] == prompts
  assert all(len(s) > len(p) for s, p in zip(seqs, prompts))  # continued by the model
  counts = load_counts(out / "counts.npz", model="tiny-llama")
  np.testing.assert_array_equal(counts, np.bincount(np.concatenate(seqs), minlength=97))
  np.testing.assert_array_equal(d.shortlist,
                                frequent_shortlist(counts, 48, model().config.eos_ids))
  monkeypatch.setattr(shortlists, "sequences", None)  # nothing is generated again
  again = DrafterFactory(m, gamma=4, verbose=False, options={"frspec": {"size": 48}})
  np.testing.assert_array_equal(again.store.token_counts, counts)


def test_knapspec_under_8bit_measures_its_own_profile_once(tmp_path, monkeypatch):
  """With no profiles saved, `knapspec+8bit` measures one timed with the int8 weights and
  saves it; a new factory finds that one (not the target's) and measures nothing."""
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  first = DrafterFactory(model(), gamma=2, verbose=False).make("knapspec+8bit")
  assert first.base.profile.draft == "int8"
  assert profiler.profile_path("tiny-llama", draft="int8").exists()
  assert not profiler.profile_path("tiny-llama").exists()
  monkeypatch.setattr(profiler, "measure", None)  # a second measurement would fail
  again = DrafterFactory(model(), gamma=2, verbose=False).make("knapspec+8bit")
  assert again.base.profile == first.base.profile


def test_a_bfloat16_models_profile_is_found_again(tmp_path, monkeypatch):
  """Profiles are keyed by the precision the model runs at: a bfloat16 model measures its
  own once and finds it again (it was saved as bfloat16 but looked up as float32, so it
  was measured on every run), and never takes a float32 one."""
  from specjax.models.loader import at_precision
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  config, graphdef, state = at_precision(model().config, model().state, "bfloat16")
  bf16 = types.SimpleNamespace(name="tiny-llama", config=config, graphdef=graphdef,
                               state=state)
  first = DrafterFactory(bf16, gamma=2, verbose=False).make("knapspec")
  assert first.profile.dtype == "bfloat16"
  assert profiler.profile_path("tiny-llama", dtype="bfloat16").exists()
  assert not profiler.profile_path("tiny-llama").exists()
  monkeypatch.setattr(profiler, "measure", None)  # a second measurement would fail
  again = DrafterFactory(bf16, gamma=2, verbose=False).make("knapspec")
  assert again.profile == first.profile


def test_self_sd_searches_with_the_objective_its_option_names(tmp_path, monkeypatch):
  """`self_sd` searches with the paper's measured objective unless
  `self_sd.objective=predicted` names ours, and keeps each plan under its own name: a plan
  searched with one objective is never taken for the other's."""
  from specjax import data
  from specjax.offline import self_sd_search

  seen = []

  def search(graphdef, state, config, ids, **kw):
    seen.append(kw["objective"])
    return self_sd_search.SearchResult(DraftPlan.from_skips(4, [1], [2]), 1.2, 0.5, 0.6, [],
                                       kw["objective"])

  monkeypatch.setattr(self_sd_search, "search", search)
  monkeypatch.setattr(data, "prompt_ids", lambda tokenizer, turns: PROMPT[:10])
  prompts = [data.Prompt("q1", "qa", ("a question",))]
  m = types.SimpleNamespace(**vars(model()), tokenizer=None)

  def make(**options):
    return DrafterFactory(m, gamma=4, verbose=False, work_dir=tmp_path, search_prompts=prompts,
                          options={"self_sd": options}).make("self_sd")

  make(), make(objective="predicted"), make(), make(objective="predicted")
  assert seen == ["measured", "predicted"]  # each searched once, then found again
  assert len(list(tmp_path.glob("self_sd_plan-*.json"))) == 2
  with pytest.raises(ConfigError, match="objective"):
    make(objective="guessed")
