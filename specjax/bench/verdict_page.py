"""docs/results/verdicts.md: every seed paper's claim and what each of our runs says of it.

The verdicts come from two places: the Spec-Bench runs in the leaderboard's store, judged
again here by the current rules of `claims` (so a change of rule reaches every run), and
the verdict lines that the other experiments' sections end with (long context, QuantSpec,
shortlists, KNN-SSD streams), read from their pages as those runs wrote them.
"""

from __future__ import annotations

import re
from collections import defaultdict

from specjax.bench import claims, docs, leaderboard

PAGE = docs.RESULTS / "verdicts.md"
_LINE = re.compile(r"^- \*\*(?P<subject>.+?)\*\* claims (?P<claim>.+?)\. "
                   r"\*\*(?P<outcome>.+?)\*\* here: (?P<evidence>.+)\.$")
_STAMP = re.compile(r"_Regenerated (\S+) by `(.+)`\._")


def _drafters(subject: str) -> list[str]:
  """The drafters named after the paper `subject` (none for a composition)."""
  return [m for m, (paper, _) in claims.PAPERS.items() if paper == subject]


def _early(subject: str, date: str) -> bool:
  """Whether a verdict on `subject`'s claim comes from a run dated before that paper's
  drafter took the paper's defaults: a verdict on our variant of the time."""
  return any(claims.predates_paper(m, date) for m in _drafters(subject))


def section_verdicts() -> list[dict]:
  """The verdict lines of every generated section on the results pages (the Spec-Bench
  runs' sections apart: the leaderboard's store judges those)."""
  out = []
  for page in sorted(docs.RESULTS.glob("*.md")):
    if page in (PAGE, leaderboard.PAGE, docs.page_for("bench-")):
      continue
    for name, body in docs.sections(page.read_text()).items():
      stamp = _STAMP.search(body)
      for line in body.splitlines():
        if m := _LINE.match(line.strip()):
          date = stamp.group(1) if stamp else "–"
          out.append(m.groupdict() | {"where": f"[{page.stem}: `{name}`]({page.name})",
                                      "date": date, "early": _early(m["subject"], date)})
  return out


def spec_bench_verdicts(runs: list[dict]) -> list[dict]:
  out = []
  for early in (False, True):
    for (machine, model, dtype, _), (i, v) in sorted(
        leaderboard.verdicts(runs, early).items()):
      out.append({"subject": v.subject, "claim": v.claim, "outcome": v.outcome,
                  "evidence": v.evidence, "date": runs[i]["date"], "early": early,
                  "where": f"[Spec-Bench, {model}, {leaderboard.weights(dtype, machine)}; "
                           f"{_short(machine)}](spec-bench.md)"})
  return out


def _since(subject: str) -> str:
  """The day `subject`'s drafter took its paper's defaults."""
  return max(claims.PAPER_DEFAULTS_SINCE.get(m, "") for m in _drafters(subject))


def _short(machine: str) -> str:
  """The device and CPU of a machine line, without the core count and jax version."""
  return machine.split(", jax")[0]


def render(runs: list[dict] | None = None) -> str:
  rows = spec_bench_verdicts(leaderboard.load() if runs is None else runs) + section_verdicts()
  papers = [paper for paper, _ in claims.PAPERS.values()]
  by_subject: dict[str, list[dict]] = defaultdict(list)
  for r in rows:
    by_subject[r["subject"]].append(r)
  order = [s for s in papers if s in by_subject] + sorted(s for s in by_subject
                                                           if s not in papers)
  out = ["# The seed papers' verdicts", "",
         "Each seed paper's claim as its abstract states it (`specjax/bench/claims.py`), put "
         "to our runs: reproduced, partly reproduced, faster than AR but below the paper's "
         "range, not reproduced, or undecided (the run lacks what the claim needs). Our "
         "models are 0.1–1.5B parameters on CPUs, the papers' 7–70B on GPUs: weigh that "
         "first. How each method's defaults follow its paper: [../FIDELITY.md](../FIDELITY.md). "
         "The Spec-Bench runs are judged here by the current rules; the other experiments' "
         "verdicts are as their run wrote them, and those dated before 2026-12-05 were "
         "judged by looser rules (a lead of 3 % passed a speedup claim; see FIDELITY.md) "
         "until their experiment is rerun. A run of a seed drafter from before it took its "
         "paper's defaults ran what is now our variant: its lines stand apart under each "
         "claim. This page is regenerated with every results section."]
  for subject in order:
    out += ["", f"## {subject}"]
    by_claim: dict[str, list[dict]] = defaultdict(list)
    for r in by_subject[subject]:
      by_claim[r["claim"]].append(r)
    for claim, group in by_claim.items():
      out += ["", f"Claim: {claim}.", ""]
      out += [_line(r) for r in group if not r["early"]]
      if early := [r for r in group if r["early"]]:
        out.append(f"- Runs from before the drafter took the paper's defaults "
                   f"({_since(subject)}), of the variant it ran then; not a verdict on the "
                   f"paper's method, kept until their experiment is rerun:")
        out += ["  " + _line(r) for r in early]
  return "\n".join(out) + "\n"


def _line(r: dict) -> str:
  return (f"- **{r['outcome'][:1].upper() + r['outcome'][1:]}** ({r['date']}, "
          f"{r['where']}): {r['evidence']}.")


def refresh() -> None:
  """Regenerate the page (a no-op outside a repository checkout)."""
  if docs.RESULTS.exists():
    PAGE.write_text(render())
