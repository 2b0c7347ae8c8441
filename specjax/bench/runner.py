"""`specjax bench`: AR vs every drafter on a Spec-Bench subset, in one process.

Results are appended to `results.jsonl` as each prompt finishes (all methods of that
prompt), so an interrupted run loses at most one prompt and `--resume` continues it.
Greedy runs check every drafter's tokens against AR's and count mismatching prompts.
Outputs: results.jsonl, summary.md (tables), speedup.png, and a last line of JSON.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specjax import data, plots
from specjax.bench import (
  claims,
  docs,
  harness,
  leaderboard,
  llama_cpp,
  metrics,
  spec_bench_answers,
  verdict_page,
)
from specjax.bench.harness import RunSettings
from specjax.bench.results_store import ResultsStore
from specjax.drafters import names
from specjax.drafters.factory import DrafterFactory

DEFAULT_DRAFTERS = ("early_exit", "self_sd", "swift", "8bit", "self_sd+8bit")  # as the CLI's


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  model: str
  drafters: tuple[str, ...]
  per_category: int
  categories: tuple[str, ...]
  max_new_tokens: int
  max_turns: int
  gamma: int
  threshold: float | None  # None: each drafter's own
  temperature: float
  top_p: float
  seed: int
  search_iterations: int
  plan_file: str | None
  dtype: str = "auto"  # weights and KV cache: auto (bfloat16 on a GPU, float32 on a CPU)
  # γ per drafter from its measured acceptance and step costs (`draft_length`), at most
  # `gamma`; drafters that choose their own draft length (KnapSpec) keep theirs.
  auto_gamma: bool = False
  # Drafter options by part (`drafters.names`): {"knapspec": {"tau": 0.3}}.
  options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  # Also decode every prompt with llama.cpp on the same GGUF file (`bench.llama_cpp`).
  llama_cpp: bool = False
  # Devices the model is split over (`sharding`; 1: one device).
  tensor_parallel: int = 1


def settings_of(cfg: BenchConfig) -> dict:
  """What fingerprints a run's results: every field, but `llama_cpp` and
  `tensor_parallel` only when set, so results recorded before they existed still resume."""
  out = dataclasses.asdict(cfg)
  if not cfg.llama_cpp:
    del out["llama_cpp"]
  if cfg.tensor_parallel == 1:
    del out["tensor_parallel"]
  return out


def validate(cfg: BenchConfig) -> None:
  """Refuse bad settings before anything is loaded."""
  for name in cfg.drafters:
    names.parse(name)
  names.check_options(cfg.options)
  run_settings(cfg)  # raises on bad values
  if cfg.llama_cpp:
    llama_cpp.check(cfg.model, cfg.temperature, cfg.max_turns)


def run_settings(cfg: BenchConfig) -> RunSettings:
  return RunSettings(max_new_tokens=cfg.max_new_tokens, gamma=cfg.gamma, threshold=cfg.threshold,
                     temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                     max_turns=cfg.max_turns)


def split_prompts(cfg: BenchConfig, data_dir=None) -> tuple[list, list, list]:
  """(evaluation, search, pilot) prompts of the run's categories: the first
  `per_category` of each, the offline searches' (`data.evaluation_and_search`), and the
  `--auto-gamma` fit's (`data.pilot_prompts`, spread over the categories and apart from
  the other two; the first evaluation prompt where nothing is held out)."""
  prompts = data.load_spec_bench(data_dir, cfg.categories)
  evaluation, search = data.evaluation_and_search(prompts, cfg.per_category)
  pilots = data.pilot_prompts(prompts, cfg.per_category, PILOT_PROMPTS, exclude=search)
  return evaluation, search, pilots or evaluation[:1]


def factory_for(cfg: BenchConfig, model, out_dir: Path, search_prompts, data_dir=None,
                verbose: bool = True) -> DrafterFactory:
  options = {k: dict(v) for k, v in cfg.options.items()}
  if cfg.plan_file is not None:
    options.setdefault("static", {})["plan"] = cfg.plan_file
  return DrafterFactory(
      model, gamma=cfg.gamma, seed=cfg.seed, search_iterations=cfg.search_iterations,
      options=options, work_dir=out_dir, data_dir=data_dir, search_prompts=search_prompts,
      verbose=verbose)


def run(cfg: BenchConfig, out_dir: Path, *, data_dir=None, resume: bool = False,
        verbose: bool = True, write_docs: bool = False, docs_section: str | None = None,
        spec_bench_out: Path | None = None) -> dict:
  """Decode the prompts (resuming `out_dir`'s results with `resume`), then write the
  tables, plot and figures; with `spec_bench_out`, also each method's answers in
  Spec-Bench's model-answer format there (`spec_bench_answers`)."""
  from specjax.models.loader import load_model

  validate(cfg)
  store = ResultsStore(out_dir, settings_of(cfg), resume=resume)
  evaluation, search_prompts, pilots = split_prompts(cfg, data_dir)
  model = load_model(cfg.model, dtype=cfg.dtype, verbose=verbose,
                     tensor_parallel=cfg.tensor_parallel)
  todo = [(p.id, p.category, p.turns) for p in evaluation if not store.done(p.id)]
  bar = tqdm(total=len(todo), desc=f"bench {cfg.model}", unit="prompt", disable=not verbose)

  def progress() -> None:
    bar.update()
    bar.set_postfix_str(_postfix(store.records()))

  run_units(cfg, model, todo, store, work_dir=out_dir, search_prompts=search_prompts,
            pilot_prompts=pilots, data_dir=data_dir,
            verbose=verbose, progress=progress)
  bar.close()
  figures = finish(cfg, out_dir, store.records(), verbose, write_docs, docs_section)
  if spec_bench_out is not None:
    from specjax.decode.generate import precision_name

    paths = spec_bench_answers.write(
        store.records(), lambda ids: model.tokenizer.decode(ids, skip_special=True),
        Path(spec_bench_out), model_id=cfg.model,
        dtype=precision_name(model.config, model.state), temperature=cfg.temperature)
    figures["spec_bench_answers"] = {m: str(p) for m, p in paths.items()}
    if verbose:
      print(f"Spec-Bench answers: {Path(spec_bench_out)} ({len(paths)} files; baseline: "
            f"{paths[metrics.AR].name})", file=sys.stderr)
  return figures


def run_units(cfg: BenchConfig, model, units, store: ResultsStore, *, work_dir: Path,
              search_prompts, pilot_prompts, data_dir=None, settings_key: str | None = None,
              verbose: bool = True, progress=lambda: None) -> None:
  """Build `cfg`'s drafters (and their γ, with `auto_gamma`), then decode each unit
  (unit key, category, turns or ids) with AR and every drafter and add it to the store:
  the loop `specjax bench` and every point of `specjax sweep` share."""
  if not units:
    return
  factory = factory_for(cfg, model, work_dir, search_prompts, data_dir, verbose)
  drafters = {n: factory.make(n) for n in cfg.drafters}
  settings = run_settings(cfg)
  gammas = {n: cfg.gamma for n in drafters}
  thresholds: dict[str, float] = {}
  if cfg.auto_gamma:
    fitted = draft_lengths(model, drafters, cfg, pilot_prompts, work_dir, verbose)
    gammas |= {n: f["gamma"] for n, f in fitted.items()}
    thresholds = {n: f["threshold"] for n, f in fitted.items() if "threshold" in f}
  harness.warm_up(model, drafters, settings, gammas, thresholds)
  baseline = _llama_cpp_baseline(cfg, model) if cfg.llama_cpp else None
  # Drafter states handed from prompt to prompt, kept with the results (resume goes on).
  carried = store.load_carried(settings_key)
  for unit, category, prompt in units:
    tags = dict(prompt_id=unit, category=category)
    recs = harness.run_prompt(model, prompt, drafters, settings, gammas=gammas,
                              thresholds=thresholds, carried=carried, tags=tags)
    if baseline is not None:
      ar = next(r for r in recs if r["method"] == metrics.AR)
      recs.append(llama_cpp.record(baseline, harness.first_ids(model, prompt),
                                   cfg.max_new_tokens, ar["tokens"][0], tags))
    store.add(unit, recs, settings_key=settings_key)
    store.save_carried(carried, settings_key)
    progress()


def _llama_cpp_baseline(cfg: BenchConfig, model) -> llama_cpp.LlamaCppBaseline:
  """The llama.cpp baseline over the model's GGUF file, warmed up on a short prompt."""
  baseline = llama_cpp.LlamaCppBaseline(cfg.model, min(model.config.max_context, 16384))
  baseline.generate(model.tokenizer.encode_prompt("Warm up."), 4)
  return baseline


# Prompts whose pilot texts the (γ, τ) fit replays: one prompt of 64 tokens gives an 8-bit
# draft of SmolLM2 about eight rounds at γ = 8, few for the fit's 80 (γ, τ) pairs. Four,
# one per category spread over the set (`data.pilot_prompts`); until 2026-11-27 the first
# three search prompts, all MT-bench prose and the prompts Self-SD's skip set was chosen on.
PILOT_PROMPTS = 4


def draft_lengths(model, drafters: dict, cfg: BenchConfig, pilot_prompts, out_dir: Path,
                  verbose: bool = True) -> dict[str, dict]:
  """Per drafter, the draft length γ ≤ cfg.gamma and early-stop threshold τ of highest
  tokens per time (`draft_length.best_length_and_threshold`): pilot generations at
  γ = cfg.gamma without early stop, on up to PILOT_PROMPTS prompts outside the evaluation
  set, their texts replayed together under each (γ, τ) with the step costs measured under
  the first pilot's plan. τ stays cfg.threshold when one was given. Kept in
  `draft_lengths.json`, so a resumed run reuses them. Drafters that choose their draft
  length themselves (KnapSpec) keep cfg.gamma as their longest and get τ alone; drafters
  that draft from a quantised cache (whose step costs this measurement does not cover)
  keep cfg.gamma and their threshold."""
  from specjax.decode import draft_length

  path = out_dir / "draft_lengths.json"
  saved = json.loads(path.read_text()) if path.exists() else {}
  prompts = [harness.prompt_ids(model.tokenizer, p.turns[:1])
             for p in pilot_prompts[:PILOT_PROMPTS]]
  thresholds = draft_length.THRESHOLDS if cfg.threshold is None else (cfg.threshold,)
  for name, d in drafters.items():
    if name in saved or d.kv_cache is not None or (d.own_gamma and cfg.threshold is not None):
      continue
    pilot = draft_length.run_pilot(model.graphdef, model.state, model.config, d, prompts,
                                   gamma=cfg.gamma, max_new_tokens=cfg.max_new_tokens,
                                   early_stop=any(t > 0 for t in thresholds))
    alpha, costs = pilot.alpha, pilot.costs
    gamma, tau = draft_length.best_length_and_threshold(pilot.tracks, costs, cfg.gamma,
                                                        thresholds, fixed_gamma=d.own_gamma)
    tpt = draft_length.replay_tpt(pilot.tracks, gamma, tau, costs)
    saved[name] = {"gamma": gamma, "threshold": tau, "replayed_tpt": round(tpt, 4),
                   "alpha": round(alpha, 4), "draft_cost": round(costs.draft, 4),
                   "draft_cost_early_stop": (None if costs.draft_early_stop is None
                                             else round(costs.draft_early_stop, 4)),
                   "verify_cost": {str(g): round(v, 4) for g, v in costs.verify.items()},
                   "pilot_prompts": len(prompts), "pilot_rounds": pilot.rounds}
    path.write_text(json.dumps(saved, indent=1, sort_keys=True))
    if verbose:
      print(f"{name}: α {alpha:.3f}, draft step {costs.draft_at(tau):.3f} AR steps "
            f"-> γ = {gamma}, "
            f"τ = {tau} (replayed {tpt:.2f} tokens per AR step)", file=sys.stderr)
  return {name: saved[name] for name in drafters if name in saved}


def _postfix(records: list[dict]) -> str:
  s = metrics.summarize(records)
  return " ".join(f"{m}:{r['speedup']:.2f}x" for m, r in s.items()
                  if m != metrics.AR and r["speedup"])


def finish(cfg: BenchConfig, out_dir: Path, records: list[dict], verbose: bool,
           write_docs: bool = False, docs_section: str | None = None) -> dict:
  overall = metrics.summarize(records)
  cats = metrics.by_category(records)
  table = _overall_table(overall)
  shown = list(cfg.drafters) + ([llama_cpp.METHOD] if cfg.llama_cpp else [])
  cat_table = _category_table(cats, [metrics.AR] + shown)
  baseline = _baseline_note(records, overall) if cfg.llama_cpp else ""
  text = (f"# specjax bench: {cfg.model}\n\n{table}\n\nSpeedup vs AR by category:\n\n"
          f"{cat_table}\n" + (f"\n{baseline}\n" if baseline else ""))
  (out_dir / "summary.md").write_text(text)
  lengths_path = out_dir / "draft_lengths.json"
  lengths = _lengths_table(json.loads(lengths_path.read_text())) \
      if cfg.auto_gamma and lengths_path.exists() else ""
  if write_docs:
    _write_docs(cfg, table, cat_table, overall, lengths, docs_section, baseline)
  _plot(cats, shown, out_dir / "speedup.png")
  if verbose:
    print(f"\n{table}\n\nspeedup vs AR by category\n{cat_table}\n" + baseline)
    print(f"results: {out_dir / 'results.jsonl'}  table: {out_dir / 'summary.md'}  "
          f"plot: {out_dir / 'speedup.png'}")
  figures = {
      "model": cfg.model,
      "prompts": overall.get(metrics.AR, {}).get("prompts", 0),
      "methods": {m: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                  for m, r in overall.items()},
      "verdicts": [v.to_json() for v in claims.for_run(overall, altered=set(cfg.options))],
  }
  if llama_cpp.METHOD in overall:
    figures["over_llama_cpp"] = _over_llama_cpp(overall)
  return figures


def _over_llama_cpp(overall: dict) -> dict[str, float]:
  """Each method's tokens/s over llama.cpp's, both measured in this run."""
  base = overall[llama_cpp.METHOD]["tokens_per_s"]
  return {m: round(r["tokens_per_s"] / base, 4) for m, r in overall.items()
          if m != llama_cpp.METHOD and base}


def _baseline_note(records: list[dict], overall: dict) -> str:
  """What the llama.cpp row is, how far its greedy tokens follow specjax's AR, and each
  method's speed over it."""
  import statistics

  rows = [r for r in records if r["method"] == llama_cpp.METHOD]
  if not rows:
    return ""
  agree = [r["agreeing_tokens"] for r in rows]
  same = sum(r["agreeing_tokens"] == len(r["tokens"][0]) for r in rows)
  ratios = ", ".join(f"{'AR' if m == metrics.AR else m} {x:.2f}×"
                     for m, x in _over_llama_cpp(overall).items())
  try:
    build = f", built for {llama_cpp.build_features()}"
  except (llama_cpp.MissingBaselineError, AttributeError):  # a stand-in binding
    build = ""
  return (f"`{llama_cpp.METHOD}`: the same GGUF file decoded greedily by llama.cpp "
          f"({rows[0]['threads']} threads{build}) on the same prompts in the same process, from its "
          f"own quantised weights, with its activations quantised for its dots: not "
          f"specjax's float32 numbers, so its tokens are not AR's. They agree with AR's for "
          f"the first {statistics.median(agree):g} tokens (median over {len(rows)} prompts; "
          f"all of them on {same}). Speed over llama.cpp's: {ratios}.")


def _overall_table(overall: dict) -> str:
  head = ("| method | tok/s | speedup | median per prompt | M | α | mismatches | draft | verify "
          "| device rounds | selection | other | compile s |")
  lines = [head, "|" + " --- |" * 13]
  for m, r in overall.items():
    median = "–" if r.get("median_speedup") is None else f"{r['median_speedup']:.2f}"
    compiled = "–" if r.get("compile_s") is None else f"{r['compile_s']:.1f}"
    if "M" not in r:  # AR, AR on a quantised cache (what QuantSpec reproduces), llama.cpp
      name = "AR" if m == metrics.AR else m
      lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {median} | – | – "
                   f"| – | – | – | – | – | – | {compiled} |")
    else:
      lines.append(
          f"| {m} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {median} | {r['M']:.2f} | "
          f"{r['alpha']:.2f} | {metrics.mismatch_text(r['mismatches'], r.get('ties'))} | "
          f"{r['draft_share']:.0%} | "
          f"{r['verify_share']:.0%} | {r['rounds_share']:.0%} | {r['selection_share']:.0%} | "
          f"{r['other_share']:.1%} | {compiled} |")
  return "\n".join(lines)


def _category_table(cats: dict, methods: list[str]) -> str:
  lines = ["| category | " + " | ".join(methods[1:]) + " |", "|" + " --- |" * len(methods)]
  for c, s in cats.items():
    cells = [f"{s[m]['speedup']:.2f}" if m in s and s[m]["speedup"] else "–" for m in methods[1:]]
    lines.append(f"| {c} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _plot(cats: dict, drafters: list[str], path: Path) -> None:
  plt = plots.pyplot()
  import numpy as np

  names = list(cats)
  x = np.arange(len(names))
  width = 0.8 / max(len(drafters), 1)
  fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(names)), 3.5))
  for i, d in enumerate(drafters):
    ys = [cats[c].get(d, {}).get("speedup") or 0 for c in names]
    ax.bar(x + i * width, ys, width, label=d)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(x + width * (len(drafters) - 1) / 2, names, rotation=35, ha="right")
  ax.set_ylabel("speedup vs AR")
  ax.legend(fontsize=8)
  plots.save(fig, path, dpi=120)


# Under the geometric model a draft of γ tokens at per-token α accepts Σ α^k (k = 1..γ).
PILOT_ALPHA = ("`pilot α` is per token (`draft_length.acceptance`): accepted drafts over "
               "accepted drafts plus rejections, since no draft past a rejection is tested. "
               "It runs above the first table's α, accepted over drafted: at γ = 8, a "
               f"per-token α of 0.95 accepts {sum(0.95 ** k for k in range(1, 9)) / 8:.0%} "
               "of the drafts on average.")


def _lengths_table(saved: dict) -> str:
  """The chosen draft lengths and the measurements behind them, as a markdown table."""
  lines = ["| method | pilot rounds | pilot α | draft step ÷ AR step | verify(γ) ÷ AR step "
           "| γ chosen | τ chosen | replayed tokens per AR step |", "|" + " --- |" * 8]
  for name, r in sorted(saved.items()):
    verify = ", ".join(f"γ={g}: {v:.2f}" for g, v in
                       sorted(r["verify_cost"].items(), key=lambda kv: int(kv[0])))
    stopping = r.get("draft_cost_early_stop")  # absent from fits before 2026-12-04
    draft = f"{r['draft_cost']:.3f}" + (f" ({stopping:.3f} with τ > 0)" if stopping is not None else "")
    lines.append(f"| {name} | {r.get('pilot_rounds', '–')} | {r['alpha']:.3f} | "
                 f"{draft} | {verify} | "
                 f"{r['gamma']} | {r.get('threshold', '–')} | "
                 + (f"{r['replayed_tpt']:.2f} |" if "replayed_tpt" in r else "– |"))
  return "\n".join(lines)


def _write_docs(cfg: BenchConfig, table: str, cat_table: str, overall: dict,
                lengths: str = "", section: str | None = None, baseline: str = "") -> None:
  """Put this run on the Spec-Bench leaderboard and regenerate its model's section of
  docs/results/spec-bench-runs.md (one per model and weight format; `section`: another
  name, which keeps a section of its own), then the verdicts page."""
  n = overall.get(metrics.AR, {}).get("prompts", 0)
  threshold = (cfg.threshold if cfg.threshold is not None else
               "fitted with γ (alone for KnapSpec, which picks its own γ)" if cfg.auto_gamma else
               "per drafter (0.8; KnapSpec 0.7; 8bit and QuantSpec 0)")
  gamma = (f"γ and early-stop threshold per drafter (γ ≤ {cfg.gamma}) of highest tokens per "
           f"time, replaying up to {PILOT_PROMPTS} held-out pilot prompts (one per category, "
           f"spread over the set) position by "
           f"position with its step costs measured here (table below)"
           if cfg.auto_gamma else f"γ ≤ {cfg.gamma}")
  body = "\n".join([
      f"## SSD vs AR on Spec-Bench ({cfg.model}"
      + (f", --dtype {cfg.dtype}" if cfg.dtype != "auto" else "")
      + (f": {', '.join(cfg.drafters)}" if section else "")
      + ("; llama.cpp)" if cfg.llama_cpp else ")"), "",
      f"{n} prompts ({cfg.per_category} per category), {cfg.max_new_tokens} new tokens, "
      f"{gamma}, threshold {threshold}, "
      f"{'greedy' if cfg.temperature == 0 else f'T={cfg.temperature}'}; AR and every drafter "
      f"in the same process. `speedup` is total tokens over total decode time, against AR's; "
      f"`median per prompt` the median of each prompt's speedup, which one prompt's noise "
      f"moves little; `compile s` the seconds a method spent compiling during its timed "
      f"prompts, outside their decode time: what the warm-up did not foresee (a drafter that "
      f"changes shapes mid-run; the shared prefills apart). Weights: {_weights(cfg.dtype)}. "
      f"Machine: {docs.machine()}.",
      "",
      table, "", *([baseline, ""] if baseline else []), "Speedup vs AR by category:", "",
      cat_table,
  ] + (["", "Draft lengths (`--auto-gamma`):", "", lengths, "", PILOT_ALPHA] if lengths else [])
    + ["", claims.section(claims.for_run(overall, altered=set(cfg.options)))])
  command = _command(cfg, section)
  docs.write_section(section or default_section(cfg), body, command)
  leaderboard.record({"date": datetime.date.today().isoformat(), "command": command,
                      "machine": docs.machine(), "model": cfg.model, "dtype": cfg.dtype,
                      "methods": overall})
  verdict_page.refresh()


def default_section(cfg: BenchConfig) -> str:
  """One section per model and weight format: a rerun replaces the last run's."""
  return f"bench-{cfg.model}" + ("" if cfg.dtype == "auto" else f"-{cfg.dtype}")


def _weights(dtype: str) -> str:
  """The target's precision in words, for a section's prose."""
  return {"auto": "float32 on a CPU, bfloat16 on a GPU (`--dtype auto`)",
          "gguf": "the GGUF file's own blocks, computed as the float32 weights they stand for "
                  "(`--dtype gguf`)"}.get(dtype, f"`--dtype {dtype}`")


def _command(cfg: BenchConfig, section: str | None = None) -> str:
  """The `specjax bench` command line that reproduces this run."""
  from specjax.data import SPEC_BENCH_CATEGORIES

  parts = [f"specjax bench --model {cfg.model} --per-category {cfg.per_category}",
           f"--max-new-tokens {cfg.max_new_tokens} --drafters {','.join(cfg.drafters)}",
           f"--gamma {cfg.gamma}" + (" --auto-gamma" if cfg.auto_gamma else "")
           + ("" if cfg.threshold is None else f" --threshold {cfg.threshold}"),
           f"--search-iterations {cfg.search_iterations}"]
  if tuple(cfg.categories) != SPEC_BENCH_CATEGORIES:
    parts.append(f"--categories {','.join(cfg.categories)}")
  if cfg.max_turns != 1:
    parts.append(f"--max-turns {cfg.max_turns}")
  if cfg.dtype != "auto":
    parts.append(f"--dtype {cfg.dtype}")
  if cfg.plan_file:
    parts.append(f"--plan {cfg.plan_file}")
  if cfg.temperature:
    parts.append(f"--temperature {cfg.temperature} --top-p {cfg.top_p} --seed {cfg.seed}")
  if cfg.llama_cpp:
    parts.append("--llama-cpp")
  if cfg.tensor_parallel > 1:
    parts.append(f"--tensor-parallel {cfg.tensor_parallel}")
  for part, opts in sorted(cfg.options.items()):
    parts += [f"--option {part}.{k}={v if isinstance(v, str) else json.dumps(v)}"
              for k, v in sorted(opts.items())]
  return " ".join(parts + ["--write-docs"] + ([f"--docs-section {section}"] if section else []))
