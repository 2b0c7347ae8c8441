"""KNN-SSD: anchors and 1-NN on synthetic clusters, the library's bit-exact round trip and
its refusals (another model, empty domain, NaN anchors, damage), a resumable build, and
the drafter lossless (greedy == AR) on tiny models."""

from __future__ import annotations

import json
import shutil
import types

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from targets import assert_exercised, target

from specjax.config import tiny_config
from specjax.data import MT_BENCH_CATEGORIES, Prompt
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.drafters import KNNDrafter, SelfSDDrafter
from specjax.errors import ConfigError
from specjax.model import init_model
from specjax.offline import knn_build
from specjax.offline.knn_library import (
  LibraryError,
  SkipLibrary,
  StaleLibraryError,
  choose_anchors,
  embed,
  from_parts,
  load_library,
  save_library,
  unit,
)
from specjax.sampling import SamplingParams


def clusters(seed: int, k: int = 4, per: int = 30, d: int = 24, noise: float = 0.05):
  """k clusters of unit vectors around random directions; (x[k*per, d], labels)."""
  rng = np.random.default_rng(seed)
  centres = unit(rng.normal(size=(k, d)))
  x = np.concatenate([c + noise * rng.normal(size=(per, d)) for c in centres])
  scale = rng.uniform(0.5, 20.0, size=(len(x), 1))  # cosine ignores the norm
  return (x * scale).astype(np.float32), np.repeat(np.arange(k), per)


def library_of(parts: dict, model: str = "tiny-llama") -> SkipLibrary:
  return from_parts(model, parts)


def random_parts(x, labels, k_anchors, L=4, seed=0):
  rng = np.random.default_rng(seed)
  parts = {}
  for c in np.unique(labels):
    rows = x[labels == c]
    a = choose_anchors(rows, k_anchors, seed)
    parts[f"d{c}"] = dict(anchors=rows[a.rows], attn=rng.random(L) < 0.5,
                          mlp=rng.random(L) < 0.5, note=f"domain {c}")
  return parts


def test_one_anchor_per_cluster_nearest_its_centroid():
  x, labels = clusters(0)
  a = choose_anchors(x, k=4)
  assert sorted(labels[a.rows]) == [0, 1, 2, 3]  # one representative per cluster
  assert a.sizes.tolist() == [30, 30, 30, 30]
  u = unit(x)
  for r in a.rows:  # each is its cluster's member closest to the cluster mean
    members = u[labels == labels[r]]
    centre = members.mean(0)
    best = members[np.argmin(((members - centre) ** 2).sum(1))]
    np.testing.assert_array_equal(u[r], best)


def test_anchor_count_capped_and_largest_cluster_first():
  x, labels = clusters(1, k=2, per=5)
  x = np.concatenate([x, x[:3]])  # duplicates do not become extra anchors
  assert len(choose_anchors(x, k=50).rows) == 10
  big = np.concatenate([np.tile(x[:1], (20, 1)), x[5:8]])
  a = choose_anchors(big, k=2)
  assert a.sizes.tolist() == [20, 3]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(2, 6), anchors=st.integers(1, 5))
def test_nearest_anchor_recovers_the_cluster(seed, k, anchors):
  x, labels = clusters(seed, k=k, per=12)
  lib = library_of(random_parts(x, labels, anchors))
  probe, truth = clusters(seed, k=k, per=12)  # the same centres, fresh noise and scale
  rng = np.random.default_rng(seed + 1)
  probe = probe + 0.05 * rng.normal(size=probe.shape) * np.linalg.norm(probe, axis=1,
                                                                      keepdims=True)
  got = [lib.nearest(p).domain for p in probe]
  assert got == truth.tolist()


def test_unlike_input_still_gets_the_nearest_domain_with_its_similarity():
  x, labels = clusters(2, k=3)
  lib = library_of(random_parts(x, labels, 3))
  far = np.random.default_rng(9).normal(size=x.shape[1]).astype(np.float32)
  m = lib.nearest(far)
  sims = lib.anchors @ unit(far)
  assert m.anchor == int(np.argmax(sims)) and m.similarity == pytest.approx(float(sims.max()))
  assert m.similarity < 0.9 < lib.nearest(x[0]).similarity


def test_library_saves_and_restores_bit_exactly(tmp_path):
  x, labels = clusters(3, k=3)
  lib = library_of(random_parts(x, labels, 4))
  save_library(tmp_path / "lib", lib)
  back = load_library(tmp_path / "lib", model="tiny-llama", num_layers=4, embed_dim=24)
  assert back.domains == lib.domains and back.model == lib.model
  for name in ("anchors", "anchor_domain", "attn", "mlp"):
    a, b = getattr(lib, name), getattr(back, name)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), name
  assert back.meta["d0"]["note"] == "domain 0"
  for d in range(3):
    assert np.array_equal(back.plan(d).attn, lib.plan(d).attn)


def test_bad_libraries_are_refused_clearly(tmp_path):
  x, labels = clusters(4, k=2)
  parts = random_parts(x, labels, 2)
  save_library(tmp_path / "lib", library_of(parts))
  with pytest.raises(LibraryError, match="built for tiny-llama, not smollm2.*specjax knn build "
                                         "--model smollm2"):
    load_library(tmp_path / "lib", model="smollm2")
  with pytest.raises(LibraryError, match="4 layers, the model 6"):
    load_library(tmp_path / "lib", model="tiny-llama", num_layers=6)
  with pytest.raises(LibraryError, match="24-dimensional, the model's hidden states 64"):
    load_library(tmp_path / "lib", model="tiny-llama", embed_dim=64)
  with pytest.raises(LibraryError, match="no skip library at"):
    load_library(tmp_path / "nowhere", model="tiny-llama")
  empty = dict(parts, d1=dict(parts["d1"], anchors=np.zeros((0, 24), np.float32)))
  with pytest.raises(LibraryError, match="'d1' has no anchors"):
    library_of(empty)
  nan = parts["d0"]["anchors"].copy()
  nan[1, 3] = np.nan
  with pytest.raises(LibraryError, match=r"NaN/inf \(rows \[1\]\)"):
    library_of(dict(parts, d0=dict(parts["d0"], anchors=nan)))
  with pytest.raises(LibraryError, match="NaN"):
    choose_anchors(nan, 2)
  with pytest.raises(LibraryError, match="prompt embedding contain NaN"):
    library_of(parts).nearest(np.full(24, np.nan, np.float32))
  meta = json.loads((tmp_path / "lib" / "meta.json").read_text())
  del meta["search_version"]  # a library from before the Self-SD objective's fix
  (tmp_path / "lib" / "meta.json").write_text(json.dumps(meta))
  with pytest.raises(StaleLibraryError, match="older Self-SD search objective.*specjax knn "
                                              "build --model tiny-llama"):
    load_library(tmp_path / "lib", model="tiny-llama")
  (tmp_path / "lib" / "meta.json").write_text(json.dumps(
      dict(meta, search_version=knn_build.self_sd.OBJECTIVE_VERSION)))
  with pytest.raises(StaleLibraryError, match=r"covers the domains \['d0', 'd1'\], not "
                                              r"\['d1', 'd0'\].*--domains d1,d0"):
    load_library(tmp_path / "lib", model="tiny-llama", domains=("d1", "d0"))
  assert load_library(tmp_path / "lib", model="tiny-llama",
                      domains=("d0", "d1")).domains == ("d0", "d1")
  shutil.rmtree(tmp_path / "lib" / "tree")
  with pytest.raises(LibraryError, match="unreadable|no checkpoint.*rebuild it with"):
    load_library(tmp_path / "lib", model="tiny-llama")


# --- tiny models: the drafter and the build --------------------------------------------------


def tiny(arch: str = "llama"):
  return target(arch, 4, 97)


PROMPTS = {"up": list(range(3, 30)), "down": list(range(60, 33, -1))}


def tiny_library(arch: str) -> SkipLibrary:
  """Two domains keyed by the tiny model's own prompt embeddings, with different plans."""
  config, graphdef, state = tiny(arch)
  keys = {d: embed(graphdef, state, config, ids) for d, ids in PROMPTS.items()}
  masks = {"up": ([1, 0, 1, 1], [1, 1, 0, 1]), "down": ([1, 1, 1, 0], [0, 1, 1, 1])}
  return from_parts(f"tiny-{arch}", {
      d: dict(anchors=keys[d][None], attn=np.asarray(masks[d][0], bool),
              mlp=np.asarray(masks[d][1], bool)) for d in PROMPTS})


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_knn_drafter_is_lossless_and_picks_the_prompts_domain(arch):
  config, graphdef, state = tiny(arch)
  drafter = KNNDrafter(tiny_library(arch))
  for domain, ids in PROMPTS.items():
    ar = generate(graphdef, state, config, ids, max_new_tokens=30, eos_ids=()).tokens
    out = speculative_generate(graphdef, state, config, ids, drafter, max_new_tokens=30,
                               gamma=4, eos_ids=(), record_rounds=True, threshold=0.0)
    assert out.tokens == ar
    assert_exercised(out, deep=True)
    assert out.drafter_state.domain == domain
    # the engine's prefill embedding is the library's: the prompt is its own anchor
    assert out.drafter_state.similarity == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(out.plans[0].attn, drafter.library.plan(
        drafter.library.domains.index(domain)).attn)


def test_knn_drafter_sampling_runs_and_rejects_a_mismatched_library():
  config, graphdef, state = tiny("llama")
  drafter = KNNDrafter(tiny_library("llama"))
  out = speculative_generate(graphdef, state, config, PROMPTS["up"], drafter,
                             max_new_tokens=20, gamma=3, eos_ids=(),
                             sampling=SamplingParams(temperature=0.8))
  assert len(out.tokens) == 20
  other = tiny_config("llama", num_layers=6, vocab_size=97)
  g6, s6 = nnx.split(init_model(other, seed=2))
  with pytest.raises(LibraryError, match="4 layers, the model 6"):
    speculative_generate(g6, s6, other, PROMPTS["up"], drafter, max_new_tokens=5, eos_ids=())


class CharTokenizer:
  def encode_prompt(self, text: str) -> list[int]:
    return [3 + ord(c) % 90 for c in text]


def test_build_is_resumable_and_keys_domains_apart(tmp_path, monkeypatch):
  config, graphdef, state = tiny("llama")
  model = types.SimpleNamespace(name="tiny-llama", graphdef=graphdef, state=state,
                                config=config, tokenizer=CharTokenizer())
  domains = {"letters": [Prompt(f"l{i}", "letters", ("abcdefgh" * (3 + i),)) for i in range(5)],
             "digits": [Prompt(f"d{i}", "digits", ("0123456789" * (2 + i),)) for i in range(5)]}
  kw = dict(anchors=3, search_prompts=1, iterations=3, verbose=False, drafter_of=SelfSDDrafter)
  lib = knn_build.build(model, domains, tmp_path / "lib", **kw)
  assert lib.domains == ("letters", "digits") and lib.anchors.shape == (6, config.embed_dim)
  assert lib.meta["letters"]["search_ids"][0].startswith("l")
  rho = lib.meta["letters"]["rank_agreement"]  # predicted vs measured, over 3 candidates
  assert -1 <= rho <= 1 and f"| {rho:+.2f} |" in knn_build.summary_table(lib)
  shutil.rmtree(tmp_path / "lib")

  def fail(*a, **k):
    raise AssertionError("a finished domain was rebuilt")

  monkeypatch.setattr(knn_build, "build_domain", fail)
  again = knn_build.build(model, domains, tmp_path / "lib", **kw)  # from the parts alone
  assert again.anchors.tobytes() == lib.anchors.tobytes()
  monkeypatch.setattr(knn_build.self_sd, "OBJECTIVE_VERSION", 99)  # a newer search objective
  with pytest.raises(AssertionError, match="rebuilt"):  # stale parts are searched again
    knn_build.build(model, domains, tmp_path / "lib", **kw)
  with pytest.raises(LibraryError, match="'empty' has no prompts"):
    monkeypatch.undo()
    knn_build.build(model, dict(domains, empty=[]), tmp_path / "lib2", **kw)
  with pytest.raises(ConfigError, match="objective must be one of measured, predicted"):
    knn_build.build(model, domains, tmp_path / "lib3", **dict(kw, objective="guessed"))
  assert not (tmp_path / "lib3.parts").exists()  # refused before any work
  with pytest.raises(ConfigError, match="pass drafter_of=specjax.drafters.SelfSDDrafter"):
    knn_build.build(model, domains, tmp_path / "lib3", **dict(kw, drafter_of=None))


def test_domains_split_build_from_held_out_and_reject_unknown_ones():
  from test_data import SHARED

  if not (SHARED / "spec_bench" / "question.jsonl").exists():
    pytest.skip("Spec-Bench not in the shared data folder")
  build, held = knn_build.domain_prompts(SHARED, ("mt_bench", "qa", "gsm8k"))
  for d in ("mt_bench", "qa", "gsm8k"):
    ids_b, ids_h = {p.id for p in build[d]}, {p.id for p in held[d]}
    assert ids_b and ids_h and not ids_b & ids_h
    assert 0.25 < len(ids_h) / (len(ids_b) + len(ids_h)) < 0.35
  assert {p.category for p in held["mt_bench"]} == set(MT_BENCH_CATEGORIES)
  with pytest.raises(ValueError, match="unknown domain 'poetry'"):
    knn_build.domain_prompts(SHARED, ("poetry",))


def test_libraries_with_other_search_settings_share_the_embeddings(tmp_path, monkeypatch):
  """A library searched on more prompts per domain (the search-prompt-count study) embeds
  nothing again: the prompts' embeddings are kept apart from the parts."""
  config, graphdef, state = tiny("llama")
  model = types.SimpleNamespace(name="tiny-llama", graphdef=graphdef, state=state,
                                config=config, tokenizer=CharTokenizer())
  domains = {"letters": [Prompt(f"l{i}", "letters", ("abcdefgh" * (3 + i),)) for i in range(4)]}
  kw = dict(anchors=3, iterations=2, verbose=False, drafter_of=SelfSDDrafter)
  knn_build.build(model, domains, tmp_path / "lib", search_prompts=1, **kw)

  def fail(*a, **k):
    raise AssertionError("embedded again")

  monkeypatch.setattr(knn_build, "embed_all", fail)
  more = knn_build.build(model, domains, tmp_path / "lib-search-prompts2", search_prompts=2,
                         embeddings=knn_build.parts_dir(tmp_path / "lib"), **kw)
  assert len(more.meta["letters"]["search_ids"]) == 2


def test_factory_keeps_a_library_per_search_setting(tmp_path, monkeypatch):
  from specjax.drafters.factory import DrafterFactory
  from specjax.offline import knn_library

  model = types.SimpleNamespace(name="tiny-llama", config=tiny("llama")[0])
  seen = {}
  monkeypatch.setattr(knn_library, "default_dir", lambda name: tmp_path / name)
  monkeypatch.setattr(knn_build, "domain_prompts",
                      lambda data_dir, domains: ({d: [] for d in domains}, {}))
  monkeypatch.setattr(knn_build, "build",
                      lambda m, d, path, **kw: seen.update(path=path, domains=tuple(d), **kw))
  DrafterFactory(model, options={"knn": {"search_prompts": 7}}, verbose=False).store.knn_library()
  assert seen["path"] == tmp_path / "tiny-llama-search-prompts7"
  assert seen["search_prompts"] == 7 and seen["anchors"] == 10
  assert seen["embeddings"] == knn_build.parts_dir(tmp_path / "tiny-llama")
  assert seen["objective"] == "measured"  # KNN-SSD's paper times each candidate
  DrafterFactory(model, verbose=False).store.knn_library()
  assert seen["path"] == tmp_path / "tiny-llama"
  assert seen["search_prompts"] == 8  # KNN-SSD's paper: 8 representatives a domain
  # the paper's five domains: CNN/DM, GSM8K and WMT De-En are Spec-Bench's summarization,
  # math_reasoning and translation; qa and rag stand in for TinyStories and Spider2
  assert seen["domains"] == ("summarization", "math_reasoning", "translation", "qa", "rag")
  DrafterFactory(model, options={"knn": {"domains": "mt_bench,gsm8k"}},
                 verbose=False).store.knn_library()
  assert seen["path"] == tmp_path / "tiny-llama-domains-mt_bench+gsm8k"
  assert seen["domains"] == ("mt_bench", "gsm8k")
  DrafterFactory(model, options={"knn": {"objective": "predicted"}},
                 verbose=False).store.knn_library()
  assert seen["path"] == tmp_path / "tiny-llama-objectivepredicted"
  assert seen["objective"] == "predicted"
