"""One definition of every figure, computed from per-run records.

A record is one (prompt, method) generation: new tokens, decode seconds, rounds, drafted,
accepted, committed and the time split. Aggregates are ratios of sums (not means of
ratios), so long and short prompts weigh by their tokens:

  tokens/s   new tokens / decode seconds (prefill and compilation excluded)
  M          committed tokens per verification round (the mean acceptance length)
  α          accepted drafts / drafted tokens
  speedup    a method's tokens/s / AR's, measured in the same process
  shares     draft / verify / device-round / selection / other seconds over decode seconds
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

from specjax.errors import SpecjaxError

AR = "ar"


class MissingComparisonError(SpecjaxError, ValueError):
  """A method's record says nothing about its agreement with AR."""


def mismatches(records: list[dict], method: str) -> int | None:
  """Prompts whose tokens differ from AR's, but for bfloat16 divergences accounted as a
  numerical tie (`decode.divergence`; `ties` counts those); None when nothing was compared
  (sampled runs record `matches_ar: None`). A record without the key is an error, not a
  match: a benchmark that dropped the comparison must not print "0 mismatches"."""
  seen = []
  for r in records:
    if "matches_ar" not in r:
      raise MissingComparisonError(
          f"the {method} record of prompt {r.get('prompt_id')!r} has no AR comparison "
          "(matches_ar: True/False for greedy runs, None for sampled ones)")
    seen.append(r["matches_ar"])
  if all(v is None for v in seen):
    return None
  if any(v is None for v in seen):
    raise MissingComparisonError(f"{method} mixes compared and uncompared records")
  return sum(not v for v in seen) - ties(records)


def ties(records: list[dict]) -> int:
  """Prompts whose tokens left AR's at a numerical tie (bfloat16 rounding, not a bug)."""
  return sum(1 for r in records
             if r.get("matches_ar") is False and (r.get("divergence") or {}).get("tie"))


def total_mismatches(summary: dict[str, dict]) -> int | None:
  """Mismatches over every compared method of a `summarize` result; None if none was."""
  found = [row["mismatches"] for row in summary.values() if row.get("mismatches") is not None]
  return sum(found) if found else None


def summarize(records: Iterable[dict], references: tuple[str, ...] = (AR,)) -> dict[str, dict]:
  """method -> {tokens_per_s, M, alpha, time shares (draft / verify / device rounds /
  selection / other), compile_s, mismatches, prompts}. `references` (AR, and e.g. an int8-KV AR) are what others are
  compared with: their `mismatches` is None, as for every method whose records are marked
  `is_reference` (the harness marks its AR baselines)."""
  sums: dict[str, dict] = defaultdict(lambda: defaultdict(float))
  by_method: dict[str, list[dict]] = defaultdict(list)
  for r in records:
    by_method[r["method"]].append(r)
    s = sums[r["method"]]
    s["prompts"] += 1
    s["tokens"] += r["decode_tokens"]
    for k in ("decode_s", "draft_s", "verify_s", "rounds_s", "selection_s", "other_s", "rounds",
              "drafted", "accepted", "committed"):
      s[k] += r.get(k, 0.0)
  out = {}
  for method, s in sums.items():
    tps = s["tokens"] / s["decode_s"] if s["decode_s"] else 0.0
    reference = method in references or all(r.get("is_reference") for r in by_method[method])
    compared = None if reference else mismatches(by_method[method], method)
    # Seconds it compiled during its timed prompts (outside decoding; the warm-up compiled
    # the rest); None for records from before they were kept.
    compiled = (sum(r["compile_s"] for r in by_method[method])
                if all("compile_s" in r for r in by_method[method]) else None)
    row = {"prompts": int(s["prompts"]), "tokens_per_s": tps, "mismatches": compared,
           "ties": None if compared is None else ties(by_method[method]),
           "compile_s": compiled}
    if not reference:
      row |= {
          "M": s["committed"] / s["rounds"] if s["rounds"] else 0.0,
          "alpha": s["accepted"] / s["drafted"] if s["drafted"] else 0.0,
          "draft_share": s["draft_s"] / s["decode_s"] if s["decode_s"] else 0.0,
          "verify_share": s["verify_s"] / s["decode_s"] if s["decode_s"] else 0.0,
          # the device round loop: drafting and verification together
          "rounds_share": s["rounds_s"] / s["decode_s"] if s["decode_s"] else 0.0,
          "selection_share": s["selection_s"] / s["decode_s"] if s["decode_s"] else 0.0,
          "other_share": s["other_s"] / s["decode_s"] if s["decode_s"] else 0.0,
      }
    out[method] = row
  ar = out.get(AR, {}).get("tokens_per_s")
  ar_by_prompt = {r["prompt_id"]: _tokens_per_s(r) for r in by_method.get(AR, ())
                  if "prompt_id" in r}
  for method, row in out.items():
    row["speedup"] = row["tokens_per_s"] / ar if ar else None
    row["median_speedup"] = _median_speedup(by_method[method], ar_by_prompt)
  return out


def _tokens_per_s(record: dict) -> float:
  return record["decode_tokens"] / record["decode_s"] if record["decode_s"] else 0.0


def _median_speedup(records: list[dict], ar_by_prompt: dict) -> float | None:
  """The median over prompts of tokens/s over AR's on the same prompt. `speedup` is total
  tokens over total time, as Spec-Bench reports; one prompt whose AR ran slow (machine
  noise) lifts every method's, and this shows it: it moves by one prompt's worth at most."""
  ratios = [_tokens_per_s(r) / ar_by_prompt[r["prompt_id"]] for r in records
            if ar_by_prompt.get(r.get("prompt_id"))]
  return statistics.median(ratios) if ratios else None


def by_category(records: list[dict], references: tuple[str, ...] = (AR,)
                ) -> dict[str, dict[str, dict]]:
  cats: dict[str, list[dict]] = defaultdict(list)
  for r in records:
    cats[r["category"]].append(r)
  return {c: summarize(rs, references) for c, rs in sorted(cats.items())}


def mismatch_text(value: int | None, tied: int | None = None) -> str:
  """A table cell: the count (and the numerical ties beside it, when any), or 'not
  compared' (sampled runs, reference rows)."""
  if value is None:
    return "not compared"
  return f"{value} (+{tied} tied)" if tied else str(value)
