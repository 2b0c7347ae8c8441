"""The verdict lines: each claim decided by the numbers, both ways, and undecided when a
run lacks what the claim needs."""

from specjax.bench import claims
from specjax.bench.claims import BELOW_RANGE, NOT_REPRODUCED, PARTLY, REPRODUCED, UNDECIDED


def row(speedup, M=2.0, alpha=0.5):
  return {"speedup": speedup, "M": M, "alpha": alpha}


def test_faster_than_ar_on_every_workload():
  v = claims.faster_than_ar("clasp", {"spec-bench": row(1.35), "ctx-1024": row(1.4)})
  assert v.outcome == REPRODUCED and v.subject.startswith("CLaSp")
  assert "the paper's range starts at 1.30×" in v.evidence
  assert claims.faster_than_ar("clasp", {"a": row(1.1), "b": row(0.9)}).outcome == PARTLY
  assert claims.faster_than_ar("clasp", {"a": row(1.01)}).outcome == NOT_REPRODUCED  # a tie
  v = claims.faster_than_ar("self_sd", {"spec-bench": row(0.8, M=1.6)})
  assert v.outcome == NOT_REPRODUCED
  assert "a round cost 2.00 AR steps" in v.evidence  # M / speedup: the round's price
  assert claims.faster_than_ar("swift", {"spec-bench": None}).outcome == UNDECIDED
  assert claims.faster_than_ar("knapspec-fixed", {"x": row(0.5)}).subject.startswith("KnapSpec")


def test_a_speedup_claim_is_reproduced_at_the_papers_lower_bound():
  """Faster than AR but under the paper's range is its own outcome, never "reproduced":
  CLaSp's 1.3–1.7× is not reproduced by 1.2×, Self-SD's "up to 1.99×" not by 1.8×, and
  KNN-SSD's 1.3–1.6× needs 1.3× on every workload."""
  for method, speedups in (("clasp", (1.1, 1.2)), ("self_sd", (1.8,)), ("swift", (1.29,)),
                           ("knn", (1.5, 1.2)), ("knapspec", (1.05,))):
    v = claims.faster_than_ar(method, {f"w{i}": row(x) for i, x in enumerate(speedups)})
    assert v.outcome == BELOW_RANGE, (method, v)
  assert claims.faster_than_ar("knapspec", {"a": row(1.07)}).outcome == REPRODUCED
  assert claims.faster_than_ar("self_sd", {"a": row(2.0)}).outcome == REPRODUCED
  # a method without a paper's figure: beating AR beyond a tie is the claim
  assert claims.faster_than_ar("mine", {"a": row(1.05)}).outcome == REPRODUCED
  line = claims.faster_than_ar("clasp", {"a": row(1.2)}).line()
  assert "**Faster than AR, below the paper's range** here" in line


def test_a_spec_bench_run_leaves_claims_of_other_regimes_undecided():
  summary = {"ar": {"speedup": 1.0}, "quantspec": row(3.0), "frspec": row(3.0),
             "dynaspec": row(0.5)}
  found = {v.subject: v for v in claims.for_run(summary)}
  for m in ("quantspec", "frspec", "dynaspec"):
    v = found[claims.PAPERS[m][0]]
    assert v.outcome == UNDECIDED and "python -m experiments." in v.evidence


def test_a_drafter_run_with_its_own_options_gets_no_paper_verdict():
  """`specjax bench --option clasp.interval=8` runs a variant: its figures would pass
  CLaSp's claim, and no verdict of CLaSp's may read them; its composition still is judged."""
  summary = {"ar": {"speedup": 1.0}, "clasp": row(2.0), "8bit": row(1.5),
             "clasp+8bit": row(2.5)}
  assert claims.PAPERS["clasp"][0] in {v.subject for v in claims.for_run(summary)}
  found = {v.subject: v for v in claims.for_run(summary, altered={"clasp"})}
  assert set(found) == {"clasp+8bit"} and found["clasp+8bit"].outcome == REPRODUCED
  assert claims.predates_paper("clasp+8bit", "2026-11-27") == ["clasp"]
  assert claims.predates_paper("clasp+8bit", claims.PAPER_DEFAULTS_SINCE["clasp"]) == []


def summaries(knap, clasp, self_sd):
  return {f"ctx-{n}": {"knapspec": row(k), "clasp": row(c), "self_sd": row(s)}
          for n, k, c, s in zip((1024, 2048, 4096), knap, clasp, self_sd)}


CONTEXTS = {"ctx-1024": 1024, "ctx-2048": 2048, "ctx-4096": 4096}


def test_knapspec_lead_over_context():
  grows = summaries((0.9, 1.0, 1.2), (0.9, 0.9, 0.9), (0.8, 0.9, 1.0))
  v = claims.beats_rivals_as_context_grows(grows, CONTEXTS)
  assert v.outcome == REPRODUCED and "+20% at 4096 tokens" in v.evidence  # relative
  shrinks = summaries((1.3, 1.0, 1.0), (0.9, 0.9, 0.9), (0.8, 0.9, 0.95))
  assert claims.beats_rivals_as_context_grows(shrinks, CONTEXTS).outcome == PARTLY
  behind = summaries((0.5, 0.5, 0.5), (0.9, 0.9, 0.9), (0.8, 0.9, 1.0))
  assert claims.beats_rivals_as_context_grows(behind, CONTEXTS).outcome == NOT_REPRODUCED
  dips = summaries((1.0, 0.5, 1.2), (0.9, 0.9, 0.9), (0.8, 0.9, 1.0))  # +0.1, -0.4, +0.2
  assert claims.beats_rivals_as_context_grows(dips, CONTEXTS).outcome == PARTLY
  level = summaries((0.88, 0.88, 0.88), (0.9, 0.9, 0.9), (0.8, 0.9, 0.9))  # -2 % throughout
  assert claims.beats_rivals_as_context_grows(level, CONTEXTS).outcome == NOT_REPRODUCED
  shares = {n: share for n, share in zip(sorted(CONTEXTS.values()), (0.14, 0.17, 0.2))}
  v = claims.beats_rivals_as_context_grows(level, CONTEXTS, attention_share=shares)
  assert "attention at 14% → 17% → 20% of a layer's time" in v.evidence
  no_rival = {w: {"knapspec": row(1.0)} for w in CONTEXTS}
  assert claims.beats_rivals_as_context_grows(no_rival, CONTEXTS).outcome == UNDECIDED


def test_tpt_claim_is_that_it_predicts_better_than_alpha_or_tpl():
  good = {"tpt": 0.9, "alpha": 0.4, "tpl": 0.7}
  assert claims.tpt_predicts_throughput({"a": good}).outcome == REPRODUCED
  # a high r is not the claim: α alone ranking the candidates as well refutes it
  assert claims.tpt_predicts_throughput(
      {"a": {"tpt": 0.9, "alpha": 0.95, "tpl": 0.2}}).outcome == NOT_REPRODUCED
  assert claims.tpt_predicts_throughput(
      {"a": {"tpt": 0.5, "alpha": 0.1, "tpl": 0.6}}).outcome == NOT_REPRODUCED
  assert claims.tpt_predicts_throughput(  # best of three, but not positively related
      {"a": {"tpt": -0.1, "alpha": -0.5, "tpl": -0.3}}).outcome == NOT_REPRODUCED
  both = {"a": good, "b": {"tpt": 0.3, "alpha": 0.8, "tpl": 0.1}}
  v = claims.tpt_predicts_throughput(both)
  assert v.outcome == PARTLY and "on b r = 0.30 for TPT, 0.80 for α, 0.10 for TPL" in v.evidence
  assert claims.tpt_predicts_throughput(
      {"a": {"tpt": None, "alpha": 0.1, "tpl": 0.2}}).outcome == UNDECIDED


def test_knn_streams():
  ahead = {r: {"knn": row(k), "ssd_f": row(0.9), "ssd_m": row(0.8)}
           for r, k in (("0", 1.35), ("0.3", 1.4), ("1", 1.38), ("ood", 0.1))}
  assert claims.knn_stable_and_ahead(ahead).outcome == REPRODUCED  # ood rows are not streams
  ahead["1"]["knn"] = row(0.5)
  assert claims.knn_stable_and_ahead(ahead).outcome == NOT_REPRODUCED  # slow, unstable, behind
  # below AR and level with its rivals (a 0.1 % lead is a tie): nothing holds
  tied = {r: {"knn": row(0.61), "ssd_f": row(0.6), "ssd_m": row(0.6094)}
          for r in ("0", "0.3", "1")}
  v = claims.knn_stable_and_ahead(tied)
  assert v.outcome == NOT_REPRODUCED and "a lead under 2% is a tie" in v.evidence
  assert claims.knn_stable_and_ahead({"0": {"ssd_f": row(1)}}).outcome == UNDECIDED


def test_knn_stability_needs_three_ratios_a_speedup_and_every_rival():
  """Stable but slower than AR is not the claim; two mix ratios cannot show stability;
  a rival missing at one ratio leaves the rivals' part undecided: none of these can
  reproduce the claim."""
  fast = lambda ratios: {r: {"knn": row(1.4), "ssd_f": row(0.9), "ssd_m": row(0.8)}
                         for r in ratios}
  two = claims.knn_stable_and_ahead(fast(("0", "1")))
  assert two.outcome == PARTLY and "stability needs 3 mix ratios or more" in two.evidence
  slow = {r: {"knn": row(1.0), "ssd_f": row(0.9), "ssd_m": row(0.8)} for r in "012"}
  assert claims.knn_stable_and_ahead(slow).outcome == PARTLY  # only the rivals' part holds
  slow_all = {r: {"knn": row(0.5), "ssd_f": row(0.5), "ssd_m": row(0.5)} for r in "012"}
  assert claims.knn_stable_and_ahead(slow_all).outcome == NOT_REPRODUCED
  missing = fast(("0", "0.3", "1"))
  del missing["0.3"]["ssd_m"]
  v = claims.knn_stable_and_ahead(missing)
  assert v.outcome == PARTLY and "needs SSD-F and SSD-M at every ratio" in v.evidence


def test_quantspec():
  ok = {2048: {"alpha": 0.95, "speedup": 0.9}, 8192: {"alpha": 0.93, "speedup": 1.2}}
  slower = {2048: 0.8, 8192: 1.0}  # the sparse-KV draft's speedups
  assert claims.quantspec_long_context(ok, 1.4, sparse_kv=slower).outcome == REPRODUCED
  assert claims.quantspec_long_context(ok, 1.1, sparse_kv=slower).outcome == PARTLY
  # a sparse-KV draft as fast at one long context: the rival part fails
  v = claims.quantspec_long_context(ok, 1.4, sparse_kv={2048: 0.8, 8192: 1.19})
  assert v.outcome == PARTLY
  assert "the faster sparse-KV draft's 0.80× (2048) → 1.19× (8192)" in v.evidence
  # no sparse-KV baseline: the rival and memory parts are undecided, so only partly
  v = claims.quantspec_long_context(ok)
  assert v.outcome == PARTLY and "memory part is undecided" in v.evidence
  assert "no sparse-KV draft ran beside it" in v.evidence
  assert claims.quantspec_long_context(ok, sparse_kv_saving=1.4).outcome == PARTLY
  faster = {2048: 1.5, 8192: 2.0}
  assert claims.quantspec_long_context(flat := {2048: {"alpha": 0.7, "speedup": 0.9},
                                                8192: {"alpha": 0.8, "speedup": 0.8}},
                                       1.1, sparse_kv=faster).outcome == NOT_REPRODUCED
  assert claims.quantspec_long_context(flat, sparse_kv_saving=1.1).outcome == NOT_REPRODUCED
  level = {2048: {"alpha": 0.95, "speedup": 1.0}, 8192: {"alpha": 0.95, "speedup": 1.01}}
  assert claims.quantspec_long_context(level, sparse_kv_saving=1.4).outcome == PARTLY  # a tie
  # its regime is long context: short prompts do not count
  short = {256: {"alpha": 0.99, "speedup": 2.0}, 1024: {"alpha": 0.99, "speedup": 2.5}}
  assert claims.quantspec_long_context(short, sparse_kv_saving=1.4).outcome == UNDECIDED
  mixed = {**short, 4096: {"alpha": 0.95, "speedup": 0.9}}
  v = claims.quantspec_long_context(mixed, sparse_kv_saving=1.4)
  assert "1024" not in v.evidence and v.outcome == PARTLY  # one long context: no growth


def test_shortlists():
  fr = {8192: 2.4, 32768: 2.7}
  keeps = claims.shortlist_keeps_m(2.75, {"M": 2.7, "shortlist": 3000}, fr)
  assert keeps.outcome == REPRODUCED and "FR-Spec 8192" in keeps.evidence  # nearest size
  assert keeps.evidence.startswith("DynaSpec keeps 98.2% of M with 3000 tokens")
  named = claims.shortlist_keeps_m(2.75, {"M": 2.7, "shortlist": 3000}, fr, method="dynaspec-k64")
  assert named.evidence.startswith("dynaspec-k64 keeps")  # several DynaSpec rows: which one
  loses = claims.shortlist_keeps_m(2.75, {"M": 2.28, "shortlist": 3000}, fr)
  assert loses.outcome == NOT_REPRODUCED
  # M kept and FR-Spec's beaten, but with a shortlist no smaller than FR-Spec's 32k: the
  # claim's first part is "smaller", so it fails, alone (no FR-Spec rows) or beside the
  # second
  big = {"M": 2.74, "shortlist": 32768}
  assert claims.shortlist_keeps_m(2.75, big, {}).outcome == NOT_REPRODUCED
  assert claims.shortlist_keeps_m(2.75, big, {32768: 2.6}).outcome == PARTLY
  assert claims.shortlist_keeps_m(2.75, {**big, "shortlist": 30000}, {}).outcome == REPRODUCED
  s = {"full-vocab": row(0.6), "frspec-8k": row(0.65), "dynaspec": row(0.5)}
  assert claims.shortlist_pays("frspec-8k", s).outcome == REPRODUCED
  assert claims.shortlist_pays("dynaspec", s).outcome == NOT_REPRODUCED


def test_compositions_and_a_run():
  summary = {"ar": {"speedup": 1.0, "tokens_per_s": 7.5}, "8bit": row(1.6),
             "self_sd": row(0.8), "self_sd+8bit": row(1.1), "knapspec+8bit": row(1.7)}
  found = {v.subject: v for v in claims.for_run(summary)}
  assert found["self_sd+8bit"].outcome == NOT_REPRODUCED  # below 8bit alone
  assert found["knapspec+8bit"].outcome == UNDECIDED  # knapspec alone did not run
  assert found[claims.PAPERS["self_sd"][0]].outcome == NOT_REPRODUCED
  assert "8bit" not in found  # no paper: judged only inside compositions
  text = claims.section(list(found.values()))
  assert text.count("\n- **") == 3 and "**Not reproduced** here" in text
  assert claims.section([]) == ""


def test_a_composition_is_judged_against_its_best_part():
  """Ahead of every part by more than a tie: reproduced; level with or behind the best
  part (here 8bit, not the slower self_sd): not reproduced."""
  speedups = {"8bit": 1.6, "self_sd": 0.8}
  v = claims.composition_beats_parts("self_sd+8bit", {**speedups, "self_sd+8bit": 1.7})
  assert v.outcome == REPRODUCED
  assert v.evidence == "self_sd+8bit 1.70× against self_sd 0.80×, 8bit 1.60×"
  for level in (1.62, 1.2):  # inside the 2 % tie margin; ahead of self_sd alone
    v = claims.composition_beats_parts("self_sd+8bit", {**speedups, "self_sd+8bit": level})
    assert v.outcome == NOT_REPRODUCED
