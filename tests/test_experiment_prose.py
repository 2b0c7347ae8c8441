"""Benchmark prose is written from the figures: the words change when the numbers do."""

from __future__ import annotations

import pytest

from experiments import bench_quantspec, profile_round
from specjax.bench import harness


def test_break_even_prose_follows_the_measured_cost():
  assert "no acceptance rate makes it beat AR" in profile_round.break_even_text(5.3, 4)
  text = profile_round.break_even_text(2.0, 4)
  assert "breaks even at M = 2.00" in text
  alpha = float(text.split("α ≈ ")[1].split(" ")[0])
  assert abs((1 - alpha ** 5) / (1 - alpha) - 2.0) < 0.02  # M(α) at the quoted α


def test_quantspec_prose_quotes_the_measured_int8_ar_speed():
  figures = {"1024": {"int8kv_ar_vs_fp_ar": 0.61}, "4096": {"int8kv_ar_vs_fp_ar": 1.12}}
  assert bench_quantspec.int8_vs_fp(figures) == "0.61–1.12×"
  assert bench_quantspec.int8_vs_fp({"1024": {"int8kv_ar_vs_fp_ar": 0.5}}) == "0.50×"


def test_each_method_keeps_its_pass_of_median_speed():
  """Passes are lists of one record per method, in the same order; each method keeps its
  own median pass, whichever passes the other methods' medians came from."""
  rec = lambda method, s: {"method": method, "decode_tokens": 60, "decode_s": s}
  passes = [[rec("ar", 1.0), rec("quantspec", 3.0)],
            [rec("ar", 2.0), rec("quantspec", 1.0)],
            [rec("ar", 3.0), rec("quantspec", 2.0)]]
  assert harness.median_pass(passes) == [rec("ar", 2.0), rec("quantspec", 2.0)]
  assert harness.median_pass(passes[:1]) == passes[0]
  assert harness.median_passes(passes) == [1, 2]


def test_long_context_passes_start_alike_and_each_drafter_carries_its_kept_pass(
    monkeypatch):
  """Every pass decodes from the same carried states; each drafter goes on from the state
  of the pass whose speed it kept, which need not be another method's."""
  from experiments import bench_long_context

  speeds = iter([{"ar": 1.0, "swift": 2.0}, {"ar": 2.0, "swift": 1.0},
                 {"ar": 3.0, "swift": 3.0}])
  seen = []

  def run_prompt(model, prompt, drafters, settings, *, carried, extra, tags):
    seen.append(carried.get("swift"))
    s = next(speeds)
    carried["swift"] = f"after a pass at {s['swift']}"
    return [{"method": m, "decode_tokens": 60, "decode_s": 60 / v} for m, v in s.items()]

  monkeypatch.setattr(bench_long_context.harness, "run_prompt", run_prompt)
  carried = {"swift": "learned"}
  kept = bench_long_context.median_run(None, [1], {}, None, carried, 3, tags={})
  assert seen == ["learned"] * 3
  assert [r["decode_s"] for r in kept] == [30.0, 30.0]  # ar's pass 2, swift's pass 1
  assert carried == {"swift": "after a pass at 2.0"}


def test_quantspec_memory_prices_a_separate_draft_cache():
  from specjax.config import tiny_config

  c = tiny_config("llama")
  (r,) = bench_quantspec.memory_rows(c, lengths=(4096,))
  # Bytes per layer from the format: nibble planes of K and V, float32 (min, scale) per key
  # group of G = 128 tokens and per value group of min(G, H) channels, a 2R bf16 buffer.
  K, H, S = c.num_kv_heads, c.head_dim, 4096
  plane = K * S * H // 2
  stats = 2 * 4 * K * (S // 128 * H + S * H // min(128, H))
  shared = 4 * plane + stats + 2 * K * 256 * H * 2
  separate = shared + 2 * plane + stats  # a second, 4-bit cache: one plane per K and V
  assert abs(r["separate_draft_saving"] - separate / shared) < 1e-4  # + 3 scalar counters
  # the sparse-KV draft's footprint: weights and the bf16 cache it reads slices of, over
  # QuantSpec's: weights, its draft weight copy and the hierarchical cache
  W, D = 10_000_000, 1_500_000
  (r,) = bench_quantspec.memory_rows(c, lengths=(4096,), weight_bytes=W,
                                     draft_weight_bytes={"quantspec_w4": D})
  bf16 = 2 * c.num_layers * K * S * H * 2
  assert abs(r["bf16_bytes"] - bf16) <= 4
  assert r["sparse_kv_saving"]["quantspec_w4"] == pytest.approx(
      (W + r["bf16_bytes"]) / (W + D + r["quant_bytes"]))


def test_long_context_verdicts():
  from experiments import bench_long_context
  from specjax.bench import claims

  r = lambda s: {"speedup": s, "M": 2.0, "alpha": 0.5}
  summary = {w: {"ar": {"speedup": 1.0}, "self_sd": r(0.8), "clasp": r(0.9), "knapspec": r(k),
                 "8bit": r(1.6), "knapspec+8bit": r(1.2)}
             for w, k in (("spec-bench", 1.0), ("ctx-1024", 1.0), ("ctx-4096", 1.1))}
  ctx = {"spec-bench": 270, "ctx-1024": 1024, "ctx-4096": 4096}
  found = bench_long_context.verdicts(["self_sd", "clasp", "knapspec", "8bit", "knapspec+8bit"],
                                      summary, ctx, {"ctx-1024": {"tpt": 0.9, "alpha": 0.5, "tpl": 0.6}},
                                      summary["ctx-4096"])
  by = {v.subject: v.outcome for v in found}
  assert by["knapspec+8bit"] == claims.NOT_REPRODUCED  # 1.2× < 8bit's 1.6×
  assert by[claims.PAPERS["clasp"][0]] == claims.NOT_REPRODUCED
  assert "8bit" not in by  # no paper: judged inside its composition
  knap = [v for v in found if v.subject == claims.PAPERS["knapspec"][0]]
  assert [v.outcome for v in knap] == [claims.PARTLY, claims.REPRODUCED, claims.REPRODUCED]
  # a variant, or a paper's drafter run with other options, is not judged by the paper
  summary = {w: {**s, "knapspec-budget": r(2.0)} for w, s in summary.items()}
  found = bench_long_context.verdicts(["self_sd", "knapspec", "knapspec-budget"], summary, ctx,
                                      {}, summary["ctx-4096"], altered={"knapspec"})
  assert {v.subject for v in found} == {claims.PAPERS["self_sd"][0]}


def test_shortlist_and_quantspec_verdicts_read_only_the_papers_rows():
  """FR-Spec at 1k, DynaSpec at another k or reading h_t, and QuantSpec's 8-bit draft are
  our variants: however fast they ran, no paper's claim is judged on them."""
  from experiments import bench_vocab
  from specjax.bench import claims

  r = lambda s, m=2.5: {"speedup": s, "M": m}
  summary = {"full-vocab": r(0.9, 2.8), "frspec-1k": r(1.2), "frspec-32k": r(0.8),
             "dynaspec": r(0.8, 2.2), "dynaspec-ht": r(1.3, 2.7), "dynaspec-k64": r(1.2, 2.7)}
  found = bench_vocab.verdicts(list(summary), summary,
                               {"dynaspec": 1300, "dynaspec-ht": 1300, "dynaspec-k64": 5000})
  assert [v.evidence.split()[0] for v in found] == ["frspec-32k", "dynaspec", "dynaspec"]
  assert {v.outcome for v in found} == {claims.NOT_REPRODUCED}

  fig = lambda a, s: {"alpha": a, "speedup_vs_fp_ar": s}
  rivals = {"streaming_kv": {"speedup_without_selection": 1.0},
            "snapkv": {"speedup_without_selection": 0.7}}
  figures = {"4096": {"quantspec_w4": fig(0.8, 0.9), "quantspec_w8": fig(0.95, 1.5), **rivals},
             "8192": {"quantspec_w4": fig(0.8, 0.8), "quantspec_w8": fig(0.95, 1.8), **rivals}}
  mem = [{"sparse_kv_saving": {"quantspec_w4": 1.0, "quantspec_w8": 1.3}}]
  (v,) = bench_quantspec.verdicts(figures, mem)
  assert v.evidence.startswith("quantspec_w4's") and v.outcome == claims.NOT_REPRODUCED
  assert bench_quantspec.verdicts({"4096": {"quantspec_w8": fig(0.95, 1.5), **rivals}},
                                  mem) == []


def test_long_context_runs_each_paper_default_beside_its_variants(tmp_path):
  """`knapspec` is the paper's KnapSpec whatever the bench's own flags; `knapspec-budget`
  our CPU variant; `--option` reaches every drafter of its part, variants included."""
  import types

  from test_data import write_spec_bench
  from test_drafter_factory import model

  from experiments import bench_long_context
  from specjax.drafters import KnapSpecDrafter

  args = types.SimpleNamespace(
      data_dir=str(write_spec_bench(tmp_path / "data")), spec_bench=1, gamma=4,
      search_iterations=2, drafters=["knapspec", "knapspec-budget"], options={})
  made = bench_long_context.make_drafters(model(), args, tmp_path / "out")
  paper, ours = made["knapspec"], made["knapspec-budget"]
  assert (paper.interval, paper.selection_budget, paper.window) == (1, None, 5)
  assert (ours.interval, ours.selection_budget) == (16, 0.05)
  prose = bench_long_context.knapspec_prose(made)
  assert "`knapspec`: a DP after every round, over the last 5 verified tokens" in prose
  assert "`knapspec-budget`: a DP once it costs ≤ 5% of the decode time" in prose
  args.options = {"knapspec": {"window": 3}}
  made = bench_long_context.make_drafters(model(), args, tmp_path / "out")
  assert made["knapspec"].window == made["knapspec-budget"].window == 3
  assert made["knapspec-budget"].interval == 16
  assert isinstance(made["knapspec"], KnapSpecDrafter)


def test_attention_share_comes_from_the_profile_and_reaches_the_verdict():
  from test_knapspec import synthetic_profile

  from experiments import bench_long_context

  prof = synthetic_profile()
  shares = bench_long_context.attention_shares(prof, [1024, 4096])
  for n, share in shares.items():
    assert abs(share - prof.t_attn(n) / (prof.t_attn(n) + prof.t_mlp(n))) < 1e-12
  assert shares[4096] > shares[1024]  # attention's time grows with the cache
  r = lambda s: {"speedup": s, "M": 2.0, "alpha": 0.5}
  summary = {w: {"self_sd": r(0.8), "clasp": r(0.9), "knapspec": r(1.0)}
             for w in ("ctx-1024", "ctx-4096")}
  found = bench_long_context.verdicts(["self_sd", "clasp", "knapspec"], summary,
                                      {"ctx-1024": 1024, "ctx-4096": 4096}, {}, summary,
                                      shares)
  assert any(f"attention at {shares[1024]:.0%} → {shares[4096]:.0%}" in v.evidence
             for v in found)


def test_knapspec_fields_read_through_overlays():
  import types

  from experiments import bench_long_context

  sel = types.SimpleNamespace(round=0, context=10, gamma=3, chosen_bits=[True, False],
                              predicted_tpt=1.0, candidates=[])
  base = types.SimpleNamespace(selections=[sel], bits=[True, False], gamma=3)
  wrapped = types.SimpleNamespace(base=base)  # knapspec+8bit
  g = types.SimpleNamespace(drafter_state=wrapped)
  assert bench_long_context.knapspec_fields("knapspec+8bit", g)["selections"][0]["bits"] == [1, 0]
  assert bench_long_context.knapspec_fields("self_sd", g) == {}


def test_tpt_correlation_decodes_each_candidate():
  import types

  from targets import target

  from experiments import bench_long_context

  config, graphdef, state = target("llama")
  model = types.SimpleNamespace(graphdef=graphdef, state=state, config=config)
  n = 2 * config.num_layers
  cands = [dict(budget=b, gamma=g, alpha=0.5, tpt=t, bits=[True] * (n - k) + [False] * k)
           for b, g, t, k in ((1, 2, 0.9, 3), (2, 3, 1.1, 2), (3, 3, 1.4, 0))]
  args = types.SimpleNamespace(tpt_candidates=3, max_new_tokens=8, gamma=3)
  out = bench_long_context.tpt_correlation(model, [1, 2, 3, 4, 5], {"candidates": cands}, args,
                                           10.0)
  assert [r["budget"] for r in out["rows"]] == [1, 2, 3]
  assert all(r["measured"] > 0 for r in out["rows"]) and -1 <= out["pearson"] <= 1


def test_prefill_selection_selects_under_an_overlay_even_with_a_budget():
  """The TPT study needs a selection at each long prompt; a budgeted KnapSpec that carried
  its selection over the prompt made none there, so the study asks for one at prefill."""
  import types

  from targets import PROMPT, target
  from test_knapspec import synthetic_profile

  from experiments import bench_long_context
  from specjax.drafters import Int8WeightsDrafter, KnapSpecDrafter

  config, graphdef, state = target("llama")
  model = types.SimpleNamespace(name="tiny-llama", graphdef=graphdef, state=state,
                                config=config)
  d = Int8WeightsDrafter.for_model(model, base=KnapSpecDrafter(profile=synthetic_profile()))
  sel = bench_long_context.prefill_selection(model, PROMPT, d,
                                             types.SimpleNamespace(gamma=3))
  assert sel["round"] == 0 and sel["candidates"]
  assert all(len(c["bits"]) == 2 * config.num_layers for c in sel["candidates"])


def test_plan_rows_show_the_plan_each_prompt_ended_with():
  """A prompt without a DP drafts with the carried plan re-priced at its cache size; the
  long-context report shows which plan that was."""
  import types

  from experiments import bench_long_context

  sel = types.SimpleNamespace(round=0, context=10, gamma=3, chosen_bits=[True, True],
                              predicted_tpt=1.0, candidates=[])
  state = types.SimpleNamespace(selections=[sel], bits=[False, True], gamma=5)
  fields = bench_long_context.knapspec_fields(
      "knapspec+8bit", types.SimpleNamespace(drafter_state=types.SimpleNamespace(base=state)))
  assert fields["final_plan"] == {"bits": [0, 1], "gamma": 5}
  runs = [dict(workload="ctx-1024", prompt_tokens=1000, method="knapspec+8bit", **fields),
          dict(workload="ctx-1024", prompt_tokens=1000, method="self_sd")]
  assert bench_long_context.plan_rows(runs, ["ctx-1024"]) == [
      ["ctx-1024", 1000, "knapspec+8bit", "0/1", "1/1", 5, 1]]
  assert bench_long_context.peak_rss_gib() > 0


def test_knn_search_prompt_study_writes_its_own_section():
  import types

  from experiments import bench_knn_streams

  assert bench_knn_streams.study_suffix(types.SimpleNamespace(knn_search_prompts=8)) == ""
  assert (bench_knn_streams.study_suffix(types.SimpleNamespace(knn_search_prompts=7))
          == "-search-prompts7")


def test_ssd_m_searches_on_prompts_spread_over_its_own_stream():
  """SSD-M's search prompts are the stream's own, spread over it (the KNN-SSD paper
  searches it again on each stream's mixture), never more than the stream holds."""
  from experiments import bench_knn_streams

  stream = [f"p{i}" for i in range(10)]
  assert bench_knn_streams.mixture_of(stream, 5) == ["p0", "p2", "p4", "p6", "p8"]
  assert bench_knn_streams.mixture_of(stream, 3) == ["p0", "p3", "p6"]
  assert bench_knn_streams.mixture_of(stream[:2], 7) == ["p0", "p1"]


def test_long_context_shows_the_quantised_profile_each_knapspec_selected_with(tmp_path,
                                                                              monkeypatch):
  """Each quantised profile a KnapSpec composition read gets its table, naming who read
  it: QuantSpec at its default (the paper's 4 bits) has its own; plain KnapSpec adds none."""
  import types

  from test_drafter_factory import model
  from test_knapspec import synthetic_profile

  from experiments import bench_long_context
  from specjax.selection import profiler

  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  for kind in ("int8", "int4"):
    profiler.save_profile(synthetic_profile(4, c=1e-4, draft=kind))
  args = types.SimpleNamespace(gamma=4, drafters=["knapspec", "knapspec-budget", "self_sd+8bit",
                                                  "knapspec+8bit", "knapspec+quantspec"])
  lines = bench_long_context.quantised_profile_lines(model(), args)
  # one table per copy: QuantSpec's 4-bit MLP (its default, the paper's), then 8-bit
  assert len(lines) == 8
  assert "`knapspec+quantspec`" in lines[0] and "--draft-weights int4" in lines[0]
  assert "`knapspec+8bit`" in lines[4] and "--draft-weights int8" in lines[4]
  assert lines[6] == profiler.table(synthetic_profile(4, c=1e-4, draft="int8"))
  args.drafters = ["knapspec", "self_sd+8bit"]
  assert bench_long_context.quantised_profile_lines(model(), args) == []


def test_quantspec_is_held_against_the_faster_sparse_draft_where_both_ran():
  """Each context's rival is the faster sparse-KV draft without its selection time; a
  context where one of them did not run gives no rival."""
  row = lambda v, share: {"speedup_without_selection": v / (1 - share)}
  figures = {"4096": {"streaming_kv": row(0.9, 0.0), "snapkv": row(0.8, 0.2)},
             "8192": {"streaming_kv": row(1.2, 0.0), "snapkv": row(1.0, 0.0)},
             "16384": {"streaming_kv": row(1.3, 0.0)}}
  assert bench_quantspec.sparse_rival(figures) == {4096: pytest.approx(1.0), 8192: 1.2}
