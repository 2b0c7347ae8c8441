"""The docs a reader opens: short pages, links that resolve, results pages written only by
their commands, a Spec-Bench leaderboard that keeps the latest run of each configuration,
and a verdicts page that judges every kept run by the current rules."""

import re
from pathlib import Path

import pytest

from specjax.bench import claims, docs, leaderboard, verdict_page

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md"))
STAMP = re.compile(r"_Regenerated \d{4}-\d{2}-\d{2} by `(specjax |python -m experiments\.)[^`]+`\._")


def test_the_readme_is_short_with_its_two_commands_on_the_first_screen():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 150
  assert any("make run" in ln for ln in lines[:40]) and any("make test" in ln for ln in lines[:40])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_docs_page_is_longer_than_a_reader_scrolls(page):
  assert len(page.read_text().splitlines()) <= 400


def test_every_relative_link_in_the_docs_resolves():
  broken = []
  for page in [ROOT / "README.md", ROOT / "experiments" / "README.md", *PAGES]:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      if not (page.parent / target.split("#")[0]).exists():
        broken.append(f"{page.relative_to(ROOT)}: {target}")
  assert not broken, broken


def test_results_sections_are_stamped_by_a_command_and_no_two_share_a_heading():
  headings: dict[str, str] = {}
  for page in sorted(docs.RESULTS.glob("*.md")):
    for name, body in docs.sections(page.read_text()).items():
      assert STAMP.search(body), f"{page.name}: {name} names no command"
      heading = next(ln for ln in body.splitlines() if ln.startswith("## "))
      assert heading not in headings, f"{name} and {headings[heading]}: {heading}"
      headings[heading] = name
      assert docs.page_for(name) == page, f"{name} sits on {page.name}, not its topic page"


def test_every_section_an_experiment_writes_has_a_topic_page():
  """The names the scripts pass to `write_section` (their literal prefixes) land on a
  topic page, not on the catch-all."""
  prefixes = set()
  for script in (ROOT / "experiments").glob("*.py"):
    prefixes |= set(re.findall(r"write_section\(f?\"([a-z-]+)", script.read_text()))
  prefixes |= {"bench-", "sweep-", "gpu-forward"}  # `specjax bench`, `specjax sweep`, bench_gpu
  assert len(prefixes) > 12
  for prefix in prefixes:
    assert docs.page_for(prefix + "m").name != docs.OTHER[0], prefix


def test_the_generated_pages_are_what_their_stores_render():
  """The leaderboard and the verdicts page are regenerated from the run store and the
  sections: a hand edit, or a store left behind, shows here."""
  runs = leaderboard.load()
  assert runs and leaderboard.PAGE.read_text() == leaderboard.render(runs)
  assert verdict_page.PAGE.read_text() == verdict_page.render(runs)


def _run(date, methods, machine="CPU (cpu), Test CPU (AVX2), 2 cores, jax 0.12",
         command="specjax bench --model m --per-category 1 --max-new-tokens 64 --gamma 8 "
                 "--auto-gamma --write-docs"):
  return {"date": date, "command": command, "machine": machine, "model": "m",
          "dtype": "auto", "methods": {"ar": {"tokens_per_s": 10.0, "speedup": 1.0}} | {
              m: {"tokens_per_s": 10 * x, "speedup": x, "M": 2.0, "alpha": 0.5,
                  "mismatches": 0} for m, x in methods.items()}}


@pytest.fixture
def store(tmp_path, monkeypatch):
  monkeypatch.setattr(docs, "DOCS_DIR", tmp_path)
  return tmp_path / "spec-bench.json", tmp_path / "spec-bench.md"


def test_a_rerun_replaces_its_configuration_and_a_run_showing_nothing_is_dropped(store):
  path, page = store
  leaderboard.record(_run("2027-01-01", {"self_sd": 0.8, "8bit": 2.0}), path, page)
  leaderboard.record(_run("2027-01-02", {"8bit": 2.2}), path, page)
  runs = leaderboard.load(path)
  assert [r["date"] for r in runs] == ["2027-01-01", "2027-01-02"]  # the first keeps self_sd
  text = page.read_text()
  assert "| `8bit` | ≤ 8, fitted | – | 2.00 | 2.20× |" in text and "2.00×" not in text
  assert "| `self_sd` |" in text and "ar" not in leaderboard.load(path)[1]["methods"]
  leaderboard.record(_run("2027-01-03", {"self_sd": 0.9, "8bit": 2.1}), path, page)
  assert [r["date"] for r in leaderboard.load(path)] == ["2027-01-03"]


def test_the_leaderboard_shows_a_run_s_figures_as_its_own_section_does(store):
  """The store keeps figures unrounded: M 1.70499 stored rounded to 1.705 would show as 1.71
  beside the run's own 1.70, and a round's cost (M / speedup) from rounded figures drifts."""
  path, page = store
  run = _run("2027-01-01", {"self_sd": 0.033449})
  run["methods"]["self_sd"]["M"] = 1.70499
  leaderboard.record(run, path, page)
  assert "| 1.70 | 0.03× |" in page.read_text()
  (verdict,) = [v for _, v in leaderboard.verdicts(leaderboard.load(path)).values()]
  assert "M 1.70; a round cost 50.97 AR steps" in verdict.evidence


def test_settings_that_change_a_figure_keep_their_own_row(store):
  path, page = store
  leaderboard.record(_run("2027-01-01", {"8bit+frspec": 2.0}), path, page)
  leaderboard.record(_run("2027-01-02", {"8bit+frspec": 2.3}, command=(
      "specjax bench --model m --gamma 4 --option frspec.size=65536 --option knapspec.tau=0.3 "
      "--write-docs")), path, page)
  leaderboard.record(_run("2027-01-03", {"8bit+frspec": 1.9}, machine="GPU (H200), x"),
                     path, page)
  assert len(leaderboard.load(path)) == 3
  rows = [ln for ln in page.read_text().splitlines() if ln.startswith("| `8bit+frspec`")]
  assert len(rows) == 3
  assert any("| ≤ 4 | frspec.size=65536 |" in ln for ln in rows)  # not knapspec's option
  assert "### m: bfloat16 weights" in page.read_text()  # `auto` on a GPU


def test_a_composition_is_judged_against_its_parts_in_its_own_run_only():
  """A composition verdict compares speedups measured in one process; a later run with the
  composition alone states it undecided and does not replace the decided one."""
  runs = [_run("2027-01-01", {"self_sd": 0.8, "8bit": 2.0, "self_sd+8bit": 1.2}),
          _run("2027-01-02", {"self_sd+8bit": 2.5})]
  judged = {k[3]: (i, v) for k, (i, v) in leaderboard.verdicts(runs).items()}
  i, v = judged["self_sd+8bit"]
  assert i == 0 and v.outcome == claims.NOT_REPRODUCED
  assert judged[claims.PAPERS["self_sd"][0]][1].outcome == claims.NOT_REPRODUCED


def test_a_seed_drafter_run_as_a_variant_is_not_judged_by_its_papers_claim(store,
                                                                           monkeypatch):
  """A run from before the drafter took its paper's defaults, or with options of its own,
  ran a variant: the leaderboard marks the first, no paper verdict reads either, and the
  verdicts page lists the first apart. A composition is still judged against its parts."""
  path, page = store
  monkeypatch.setattr(docs, "RESULTS", path.parent)  # no section verdicts of our own pages
  since = claims.PAPER_DEFAULTS_SINCE["knapspec"]
  early = _run("2026-11-25", {"knapspec": 2.0, "8bit": 1.5, "knapspec+8bit": 2.5})
  tuned = _run(since, {"clasp": 2.0}, command="specjax bench --model m --option "
               "clasp.interval=8 --write-docs")
  paper = _run(since, {"knapspec": 0.5}, machine="CPU (cpu), Other CPU, 2 cores, jax 0.12")
  runs = [early, tuned, paper]
  judged = {(k[0], k[3]): v for k, (_, v) in leaderboard.verdicts(runs).items()}
  knapspec, clasp = claims.PAPERS["knapspec"][0], claims.PAPERS["clasp"][0]
  assert (early["machine"], knapspec) not in judged  # 2.0× would have reproduced it
  assert (tuned["machine"], clasp) not in judged
  assert judged[(paper["machine"], knapspec)].outcome == claims.NOT_REPRODUCED
  assert judged[(early["machine"], "knapspec+8bit")].outcome == claims.REPRODUCED
  apart = {(k[0], k[3]): v for k, (_, v) in leaderboard.verdicts(runs, early=True).items()}
  assert set(apart) == {(early["machine"], knapspec)}
  assert apart[(early["machine"], knapspec)].outcome == claims.REPRODUCED
  for run in runs:
    leaderboard.record(run, path, page)
  text = page.read_text()
  assert "| `knapspec` † |" in text and "| `knapspec+8bit` † |" in text
  assert "| `knapspec` | ≤ 8, fitted |" in text and "| `clasp` | ≤ 4 |" in text  # no mark
  assert f"(`knapspec`: {since})" in text
  verdicts = verdict_page.render(leaderboard.load(path)).split(f"## {knapspec}")[1]
  current, before = verdicts.split("- Runs from before the drafter took the paper's defaults")
  assert "knapspec ran at 0.50×" in current and "2.00×" not in current
  assert f"({since})" in before.splitlines()[0] and "  - **Reproduced** (2026-11-25" in before


def test_a_section_replaces_its_own_block_on_its_topic_page(tmp_path, monkeypatch):
  monkeypatch.setattr(docs, "DOCS_DIR", tmp_path)
  monkeypatch.setattr(docs, "RESULTS", tmp_path / "results")
  docs.write_section("long-context-m", "## Long context (m)\n\nfirst", "python -m experiments.x")
  docs.write_section("long-context-n", "## Long context (n)\n\nother", "python -m experiments.x")
  docs.write_section("long-context-m", "## Long context (m)\n\nsecond", "python -m experiments.x")
  text = (tmp_path / "results" / "long-context.md").read_text()
  assert text.startswith("# Long context\n")
  assert list(docs.sections(text)) == ["long-context-m", "long-context-n"]
  assert "second" in text and "first" not in text
  assert STAMP.search(docs.sections(text)["long-context-m"])


def test_verdict_lines_of_an_experiment_section_reach_the_verdicts_page(tmp_path, monkeypatch):
  monkeypatch.setattr(docs, "DOCS_DIR", tmp_path)
  monkeypatch.setattr(docs, "RESULTS", tmp_path)
  monkeypatch.setattr(verdict_page, "PAGE", tmp_path / "verdicts.md")
  monkeypatch.setattr(leaderboard, "PAGE", tmp_path / "spec-bench.md")
  v = claims.Verdict("KNN-SSD", "it is stable", claims.NOT_REPRODUCED, "0.6× everywhere")
  docs.write_section("knn-streams-m", "## KNN (m)\n\n" + claims.section([v]),
                     "python -m experiments.bench_knn_streams")
  text = verdict_page.render(runs=[])
  assert "## KNN-SSD" in text and "Claim: it is stable." in text
  assert "- **Not reproduced** (" in text and "[knn-ssd: `knn-streams-m`](knn-ssd.md)" in text
  assert "Runs from before" not in text
  # A section written before KNN-SSD took its paper's defaults stands apart.
  page = tmp_path / "knn-ssd.md"
  page.write_text(re.sub(r"_Regenerated \S+ by", "_Regenerated 2026-11-25 by",
                         page.read_text()))
  text = verdict_page.render(runs=[])
  since = claims.PAPER_DEFAULTS_SINCE["knn"]
  assert f"- Runs from before the drafter took the paper's defaults ({since})" in text
  assert "  - **Not reproduced** (2026-11-25, [knn-ssd: `knn-streams-m`]" in text
