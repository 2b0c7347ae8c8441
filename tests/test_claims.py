"""The verdict lines: each claim decided by the numbers, both ways, and undecided when a
run lacks what the claim needs."""

from specjax.bench import claims
from specjax.bench.claims import NOT_REPRODUCED, PARTLY, REPRODUCED, UNDECIDED


def row(speedup, M=2.0, alpha=0.5):
  return {"speedup": speedup, "M": M, "alpha": alpha}


def test_faster_than_ar_on_every_workload():
  v = claims.faster_than_ar("clasp", {"spec-bench": row(1.1), "ctx-1024": row(1.2)})
  assert v.outcome == REPRODUCED and v.subject.startswith("CLaSp")
  assert claims.faster_than_ar("clasp", {"a": row(1.1), "b": row(0.9)}).outcome == PARTLY
  assert claims.faster_than_ar("clasp", {"a": row(1.01)}).outcome == NOT_REPRODUCED  # a tie
  v = claims.faster_than_ar("self_sd", {"spec-bench": row(0.8, M=1.6)})
  assert v.outcome == NOT_REPRODUCED
  assert "a round cost 2.00 AR steps" in v.evidence  # M / speedup: the round's price
  assert claims.faster_than_ar("swift", {"spec-bench": None}).outcome == UNDECIDED
  assert claims.faster_than_ar("knapspec-fixed", {"x": row(0.5)}).subject.startswith("KnapSpec")


def summaries(knap, clasp, self_sd):
  return {f"ctx-{n}": {"knapspec": row(k), "clasp": row(c), "self_sd": row(s)}
          for n, k, c, s in zip((1024, 2048, 4096), knap, clasp, self_sd)}


CONTEXTS = {"ctx-1024": 1024, "ctx-2048": 2048, "ctx-4096": 4096}


def test_knapspec_lead_over_context():
  grows = summaries((0.9, 1.0, 1.2), (0.9, 0.9, 0.9), (0.8, 0.9, 1.0))
  v = claims.beats_rivals_as_context_grows(grows, CONTEXTS)
  assert v.outcome == REPRODUCED and "+0.20 at 4096 tokens" in v.evidence
  shrinks = summaries((1.3, 1.0, 1.0), (0.9, 0.9, 0.9), (0.8, 0.9, 0.95))
  assert claims.beats_rivals_as_context_grows(shrinks, CONTEXTS).outcome == PARTLY
  behind = summaries((0.5, 0.5, 0.5), (0.9, 0.9, 0.9), (0.8, 0.9, 1.0))
  assert claims.beats_rivals_as_context_grows(behind, CONTEXTS).outcome == NOT_REPRODUCED
  dips = summaries((1.0, 0.5, 1.2), (0.9, 0.9, 0.9), (0.8, 0.9, 1.0))  # +0.1, -0.4, +0.2
  assert claims.beats_rivals_as_context_grows(dips, CONTEXTS).outcome == PARTLY
  level = summaries((0.88, 0.88, 0.88), (0.9, 0.9, 0.9), (0.8, 0.9, 0.9))  # -0.02 throughout
  assert claims.beats_rivals_as_context_grows(level, CONTEXTS).outcome == NOT_REPRODUCED
  shares = {n: share for n, share in zip(sorted(CONTEXTS.values()), (0.14, 0.17, 0.2))}
  v = claims.beats_rivals_as_context_grows(level, CONTEXTS, attention_share=shares)
  assert "attention at 14% → 17% → 20% of a layer's time" in v.evidence
  no_rival = {w: {"knapspec": row(1.0)} for w in CONTEXTS}
  assert claims.beats_rivals_as_context_grows(no_rival, CONTEXTS).outcome == UNDECIDED


def test_predicted_tpt():
  assert claims.predicted_tpt_tracks({"a": 0.9, "b": 0.85}).outcome == REPRODUCED
  # the bar is 0.8, not a positive sign: a weak correlation does not track throughput
  assert claims.predicted_tpt_tracks({"a": 0.5, "b": 0.79}).outcome == NOT_REPRODUCED
  assert claims.predicted_tpt_tracks({"a": 0.8}).outcome == REPRODUCED  # at the bar
  assert claims.predicted_tpt_tracks({"a": 0.5}, bar=0.4).outcome == REPRODUCED
  assert claims.predicted_tpt_tracks({"a": 0.9, "b": -0.2}).outcome == PARTLY
  assert claims.predicted_tpt_tracks({"a": None}).outcome == UNDECIDED


def test_knn_streams():
  ahead = {r: {"knn": row(k), "ssd_f": row(0.9), "ssd_m": row(0.8)}
           for r, k in (("0", 1.3), ("0.3", 1.32), ("1", 1.28), ("ood", 0.1))}
  assert claims.knn_stable_and_ahead(ahead).outcome == REPRODUCED  # ood rows are not streams
  ahead["1"]["knn"] = row(0.5)
  assert claims.knn_stable_and_ahead(ahead).outcome == NOT_REPRODUCED  # slow, unstable, behind
  # below AR and level with its rivals (a 0.1 % lead is a tie): only the stability holds
  tied = {r: {"knn": row(0.61), "ssd_f": row(0.6), "ssd_m": row(0.6094)} for r in ("0", "1")}
  v = claims.knn_stable_and_ahead(tied)
  assert v.outcome == PARTLY and "a lead under 2% is a tie" in v.evidence
  assert claims.knn_stable_and_ahead({"0": {"ssd_f": row(1)}}).outcome == UNDECIDED


def test_quantspec():
  ok = {1024: {"alpha": 0.95, "speedup": 0.9}, 8192: {"alpha": 0.93, "speedup": 1.2}}
  assert claims.quantspec_long_context(ok, 1.4).outcome == REPRODUCED
  assert claims.quantspec_long_context(ok, 1.1).outcome == PARTLY
  flat = {1024: {"alpha": 0.7, "speedup": 0.9}, 8192: {"alpha": 0.8, "speedup": 0.8}}
  assert claims.quantspec_long_context(flat, 1.1).outcome == NOT_REPRODUCED


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
