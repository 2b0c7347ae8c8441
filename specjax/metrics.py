"""One definition of every figure (DESIGN.md "Metrics"), computed from per-run records.

A record is one (prompt, method) generation: new tokens, decode seconds, rounds, drafted,
accepted, committed and the time split. Aggregates are ratios of sums (not means of
ratios), so long and short prompts weigh by their tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

AR = "ar"


def summarize(records: Iterable[dict]) -> dict[str, dict]:
  """method -> {tokens_per_s, M, alpha, time shares (draft / verify / selection / other),
  mismatches, prompts}."""
  sums: dict[str, dict] = defaultdict(lambda: defaultdict(float))
  for r in records:
    s = sums[r["method"]]
    s["prompts"] += 1
    s["tokens"] += r["decode_tokens"]
    for k in ("decode_s", "draft_s", "verify_s", "selection_s", "other_s", "rounds",
              "drafted", "accepted", "committed"):
      s[k] += r.get(k, 0.0)
    s["mismatches"] += 0 if r.get("matches_ar", True) else 1
  out = {}
  for method, s in sums.items():
    tps = s["tokens"] / s["decode_s"] if s["decode_s"] else 0.0
    row = {"prompts": int(s["prompts"]), "tokens_per_s": tps, "mismatches": int(s["mismatches"])}
    if method != AR:
      row |= {
          "M": s["committed"] / s["rounds"] if s["rounds"] else 0.0,
          "alpha": s["accepted"] / s["drafted"] if s["drafted"] else 0.0,
          "draft_share": s["draft_s"] / s["decode_s"] if s["decode_s"] else 0.0,
          "verify_share": s["verify_s"] / s["decode_s"] if s["decode_s"] else 0.0,
          "selection_share": s["selection_s"] / s["decode_s"] if s["decode_s"] else 0.0,
          "other_share": s["other_s"] / s["decode_s"] if s["decode_s"] else 0.0,
      }
    out[method] = row
  ar = out.get(AR, {}).get("tokens_per_s")
  for row in out.values():
    row["speedup"] = row["tokens_per_s"] / ar if ar else None
  return out


def by_category(records: list[dict]) -> dict[str, dict[str, dict]]:
  cats: dict[str, list[dict]] = defaultdict(list)
  for r in records:
    cats[r["category"]].append(r)
  return {c: summarize(rs) for c, rs in sorted(cats.items())}
