"""`specjax bench`: AR vs every drafter on a Spec-Bench subset, in one process.

Results are appended to `results.jsonl` as each prompt finishes (all methods of that
prompt), so an interrupted run loses at most one prompt and `--resume` continues it.
Greedy runs check every drafter's tokens against AR's and count mismatching prompts.
Outputs: results.jsonl, summary.md (tables), speedup.png, and a last line of JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from specjax import data, docs, metrics, plots
from specjax.drafters import (ClaspDrafter, EarlyExitDrafter, Int8WeightsDrafter,
                              KnapSpecDrafter, KNNDrafter, SelfSDDrafter, StaticDrafter,
                              SwiftDrafter, drafter_class)
from specjax.drafters import self_sd
from specjax.drafters.static import load_plan, save_plan
from specjax.engine import speculative_generate
from specjax.generate import generate
from specjax.quant import quantize_weights_int8
from specjax.sampling import SamplingParams

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


class ResumeMismatchError(ValueError):
  pass


def _chat_ids(tok, turns: list[str], answers: list[str]) -> list[int]:
  """Token ids for the last turn, with earlier turns and this method's answers as history."""
  if tok.is_chat:
    msgs = []
    for i, turn in enumerate(turns):
      msgs.append({"role": "user", "content": turn})
      if i < len(answers):
        msgs.append({"role": "assistant", "content": answers[i]})
    return tok.encode_chat(msgs)
  parts = []
  for i, turn in enumerate(turns):
    parts.append(turn)
    if i < len(answers):
      parts.append(answers[i])
  return tok.encode("\n\n".join(parts))


OVERLAYS = ("8bit",)  # names that compose on top of a layer drafter: `self_sd+8bit`


def _make_drafter(name: str, cfg: BenchConfig, model, out_dir: Path, search_prompts,
                  data_dir=None, int8_weights=None):
  """The drafter called `name`: a drafter, an overlay alone (`8bit`: over the full model),
  or a layer drafter with overlays on top, joined by `+` (`self_sd+8bit`). `int8_weights`
  (a memoised thunk) lets every `8bit` name share one quantised copy of the model."""
  base, *overlays = name.split("+")
  if base in OVERLAYS:
    base, overlays = None, [base] + overlays
  drafter = None if base is None else _make_base(base, cfg, model, out_dir, search_prompts,
                                                data_dir)
  for overlay in overlays:
    if overlay not in OVERLAYS:
      drafter_class(overlay)  # an unknown name: the error lists them all
      raise ValueError(f"{overlay!r} in {name!r} is not an overlay; overlays: "
                       f"{', '.join(OVERLAYS)}")
    weights = int8_weights() if int8_weights else quantize_weights_int8(
        model.state, model.config.num_layers)
    drafter = Int8WeightsDrafter(weights=weights, base=drafter)
  return drafter


def _make_base(name: str, cfg: BenchConfig, model, out_dir: Path, search_prompts,
               data_dir=None):
  L = model.config.num_layers
  if name == "early_exit":
    return EarlyExitDrafter(k=L // 2)
  if name == "swift":
    return SwiftDrafter(seed=cfg.seed)
  if name == "static":
    if cfg.plan_file is None:
      raise ValueError("the static drafter needs --plan FILE (a plan saved by a search)")
    return StaticDrafter(load_plan(cfg.plan_file, model=cfg.model))
  if name == "self_sd":
    path = out_dir / "self_sd_plan.json"
    if path.exists():
      return SelfSDDrafter(load_plan(path, model=cfg.model))
    ids = [_chat_ids(model.tokenizer, list(p.turns[:1]), []) for p in search_prompts]
    res = self_sd.search(model.graphdef, model.state, model.config, ids,
                         iterations=cfg.search_iterations, gamma=cfg.gamma, seed=cfg.seed)
    save_plan(path, res.plan, model=cfg.model, objective=res.objective, alpha=res.alpha,
              cost=res.cost, search_prompts=[p.id for p in search_prompts])
    if res.objective < 1.0:
      print(f"self_sd: no skip set found is predicted to beat AR on {cfg.model} (best "
            f"predicted {res.objective:.2f}x, agreement {res.alpha:.2f}); benchmarking it "
            f"anyway", file=sys.stderr)
    return SelfSDDrafter(res.plan)
  if name == "clasp":
    return ClaspDrafter()
  if name == "knapspec":
    return KnapSpecDrafter(profile=latency_profile(model, cfg.gamma))
  if name == "knn":
    return KNNDrafter(knn_library(model, cfg, data_dir))
  drafter_class(name)  # raises UnknownDrafterError with the list of names
  raise ValueError(f"drafter {name!r} is not benchmarked by `specjax bench` yet")


def latency_profile(model, gamma: int, verbose: bool = True):
  """The saved latency profile of this model on this device; measured now (and saved)
  when there is none. A profile of another model or device is refused, not replaced."""
  from specjax import profiler

  try:
    return profiler.load_profile(model.name, model.config.num_layers)
  except profiler.MissingProfileError as err:
    print(f"{err}\nrunning the profiler now", file=sys.stderr)
    prof = profiler.measure(model, gamma=gamma, verbose=verbose)
    profiler.save_profile(prof)
    return prof


def knn_library(model, cfg: BenchConfig, data_dir=None, verbose: bool = True):
  """The model's saved KNN-SSD library; built now (and saved) from the default domains'
  build prompts when there is none. Another model's library is refused, not replaced."""
  from specjax import knn_build, knn_library

  path = knn_library.default_dir(model.name)
  if (path / "meta.json").exists():
    return knn_library.load_library(path, model=model.name, num_layers=model.config.num_layers,
                                    embed_dim=model.config.embed_dim)
  print(f"no KNN-SSD library for {model.name} at {path}: building it now (`specjax knn "
        f"build --model {model.name}` does the same)", file=sys.stderr)
  build, _ = knn_build.domain_prompts(data_dir)
  return knn_build.build(model, {d: ps[:40] for d, ps in build.items()}, path,
                         iterations=cfg.search_iterations, gamma=cfg.gamma,
                         seed=cfg.seed, verbose=verbose)


def _read_records(path: Path) -> list[dict]:
  records = []
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        records.append(json.loads(line))
      except ValueError:  # a line cut by a crash: dropped, its prompt is redone
        continue
  return records


def run(cfg: BenchConfig, out_dir: Path, *, data_dir=None, resume: bool = False,
        verbose: bool = True, write_docs: bool = False) -> dict:
  from specjax.loader import load_model

  out_dir.mkdir(parents=True, exist_ok=True)
  results_path = out_dir / "results.jsonl"
  cfg_path = out_dir / "config.json"
  cfg_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
  if results_path.exists() and not resume:
    raise ResumeMismatchError(f"{results_path} exists: pass --resume to continue it, or "
                              f"choose another --out")
  if resume and cfg_path.exists() and cfg_path.read_text() != cfg_json:
    raise ResumeMismatchError(f"--resume: {cfg_path} was written with other settings")
  cfg_path.write_text(cfg_json)
  for name in cfg.drafters:
    for part in name.split("+"):
      drafter_class(part)
  if cfg.gamma < 1:
    raise ValueError(f"gamma must be >= 1, got {cfg.gamma}")

  prompts = data.load_spec_bench(data_dir, cfg.categories)
  by_cat: dict[str, list] = {}
  for p in prompts:
    by_cat.setdefault(p.category, []).append(p)
  evaluation = [p for ps in by_cat.values() for p in ps[: cfg.per_category]]
  # Self-SD searches on other prompts of the same set: the last one of each category.
  search_prompts = [ps[-1] for ps in by_cat.values() if len(ps) > cfg.per_category][:6]

  model = load_model(cfg.model, dtype=cfg.dtype, verbose=verbose)
  sampling = SamplingParams(cfg.temperature, cfg.top_p)
  int8_weights = functools.cache(lambda: quantize_weights_int8(model.state,
                                                               model.config.num_layers))
  drafters = {n: _make_drafter(n, cfg, model, out_dir, search_prompts, data_dir, int8_weights)
              for n in cfg.drafters}
  methods = [metrics.AR] + list(drafters)
  gammas = {n: cfg.gamma for n in drafters}
  if cfg.auto_gamma:
    gammas |= draft_lengths(model, drafters, cfg, search_prompts or evaluation[:1], out_dir,
                            verbose)

  records = _read_records(results_path)
  # Only prompts with every method recorded count as done; the rest are redone.
  complete = {pid for pid in {r["prompt_id"] for r in records}
              if {r["method"] for r in records if r["prompt_id"] == pid} >= set(methods)}
  records = [r for r in records if r["prompt_id"] in complete]
  results_path.write_text("".join(json.dumps(r) + "\n" for r in records))
  todo = [p for p in evaluation if p.id not in complete]

  _warm_up(model, drafters, cfg, sampling, gammas)
  bar = tqdm(todo, desc=f"bench {cfg.model}", unit="prompt", disable=not verbose)
  carried: dict[str, object] = {}  # drafter states handed from prompt to prompt
  for prompt in bar:
    recs = _run_prompt(model, prompt, drafters, cfg, sampling, carried, gammas)
    with results_path.open("a") as f:
      f.write("".join(json.dumps(r) + "\n" for r in recs))
    records += recs
    bar.set_postfix_str(_postfix(records))
  return finish(cfg, out_dir, records, verbose, write_docs)


def draft_lengths(model, drafters: dict, cfg: BenchConfig, pilot_prompts, out_dir: Path,
                  verbose: bool = True) -> dict[str, int]:
  """Per drafter, the γ ≤ cfg.gamma of highest predicted tokens per time: α from a pilot
  generation at γ = cfg.gamma on a prompt outside the evaluation set, step costs measured
  under the pilot's plan. Kept in `draft_lengths.json`, so a resumed run reuses them.
  Drafters that choose their draft length themselves, or draft from a quantised cache
  (whose step costs this measurement does not cover), keep cfg.gamma."""
  from specjax import draft_length

  path = out_dir / "draft_lengths.json"
  saved = json.loads(path.read_text()) if path.exists() else {}
  ids = _chat_ids(model.tokenizer, list(pilot_prompts[0].turns[:1]), [])
  for name, d in drafters.items():
    if name in saved or d.own_gamma or d.kv_cache is not None:
      continue
    pilot = speculative_generate(model.graphdef, model.state, model.config, ids, d,
                                 max_new_tokens=cfg.max_new_tokens, gamma=cfg.gamma,
                                 threshold=cfg.threshold, keep_plans=True, eos_ids=())
    alpha = draft_length.acceptance(pilot.round_drafted, pilot.round_accepted)
    costs = draft_length.measure_step_costs(model.graphdef, model.state, model.config,
                                            pilot.plans[0],
                                            gammas=sorted({1, max(1, cfg.gamma // 2), cfg.gamma}))
    gamma = draft_length.best_gamma(alpha, costs, cfg.gamma)
    saved[name] = {"gamma": gamma, "alpha": round(alpha, 4), "draft_cost": round(costs.draft, 4),
                   "verify_cost": {str(g): round(v, 4) for g, v in costs.verify.items()}}
    path.write_text(json.dumps(saved, indent=1, sort_keys=True))
    if verbose:
      print(f"{name}: α {alpha:.3f}, draft step {costs.draft:.3f} AR steps -> γ = {gamma}",
            file=sys.stderr)
  return {name: saved[name]["gamma"] for name in drafters if name in saved}


def _warm_up(model, drafters, cfg: BenchConfig, sampling, gammas: dict[str, int]) -> None:
  """Compile every executable the timed runs use (shape buckets as in the real prompts)."""
  ids = model.tokenizer.encode_prompt("Warm up.")
  generate(model.graphdef, model.state, model.config, ids, max_new_tokens=cfg.max_new_tokens,
           sampling=sampling, eos_ids=())
  for name, d in drafters.items():
    speculative_generate(model.graphdef, model.state, model.config, ids, d,
                         max_new_tokens=cfg.max_new_tokens, gamma=gammas[name],
                         threshold=cfg.threshold, sampling=sampling, eos_ids=())


def _run_prompt(model, prompt, drafters, cfg: BenchConfig, sampling, carried,
                gammas: dict[str, int] | None = None) -> list[dict]:
  turns = list(prompt.turns[: cfg.max_turns])
  recs = []
  ar_tokens: list[list[int]] = []
  for method in [metrics.AR] + list(drafters):
    answers: list[str] = []
    rec = dict(prompt_id=prompt.id, category=prompt.category, method=method, decode_tokens=0,
               decode_s=0.0, prefill_s=0.0, rounds=0, drafted=0, accepted=0, committed=0,
               draft_s=0.0, verify_s=0.0, rounds_s=0.0, selection_s=0.0, other_s=0.0,
               tokens=[])
    for t in range(len(turns)):
      ids = _chat_ids(model.tokenizer, turns[: t + 1], answers)
      kw = dict(max_new_tokens=cfg.max_new_tokens, sampling=sampling, seed=cfg.seed + t)
      if method == metrics.AR:
        g = generate(model.graphdef, model.state, model.config, ids, **kw)
        rec["verify_s"] += g.decode_s  # an AR step is a one-token verification
      else:
        rec["gamma"] = (gammas or {}).get(method, cfg.gamma)
        g = speculative_generate(model.graphdef, model.state, model.config, ids,
                                 drafters[method], gamma=rec["gamma"], threshold=cfg.threshold,
                                 drafter_state=carried.get(method), **kw)
        carried[method] = g.drafter_state
        for k in ("rounds", "drafted", "accepted", "committed", "draft_s", "verify_s",
                  "rounds_s", "selection_s", "other_s"):
          rec[k] += getattr(g, k)
      rec["decode_tokens"] += len(g.tokens) - 1
      rec["decode_s"] += g.decode_s
      rec["prefill_s"] += g.prefill_s
      rec["tokens"].append(g.tokens)
      answers.append(model.tokenizer.decode(g.tokens, skip_special=True))
    if method == metrics.AR:
      ar_tokens = rec["tokens"]
    else:  # sampled runs are not compared token for token (None, not a silent 0)
      rec["matches_ar"] = rec["tokens"] == ar_tokens if sampling.greedy else None
    recs.append(rec)
  return recs


def _postfix(records: list[dict]) -> str:
  s = metrics.summarize(records)
  return " ".join(f"{m}:{r['speedup']:.2f}x" for m, r in s.items()
                  if m != metrics.AR and r["speedup"])


def finish(cfg: BenchConfig, out_dir: Path, records: list[dict], verbose: bool,
           write_docs: bool = False) -> dict:
  overall = metrics.summarize(records)
  cats = metrics.by_category(records)
  table = _overall_table(overall)
  cat_table = _category_table(cats, [metrics.AR] + list(cfg.drafters))
  text = (f"# specjax bench: {cfg.model}\n\n{table}\n\nSpeedup vs AR by category:\n\n"
          f"{cat_table}\n")
  (out_dir / "summary.md").write_text(text)
  lengths_path = out_dir / "draft_lengths.json"
  lengths = _lengths_table(json.loads(lengths_path.read_text())) \
      if cfg.auto_gamma and lengths_path.exists() else ""
  if write_docs:
    _write_docs(cfg, table, cat_table, overall, lengths)
  _plot(cats, list(cfg.drafters), out_dir / "speedup.png")
  if verbose:
    print(f"\n{table}\n\nspeedup vs AR by category\n{cat_table}\n")
    print(f"results: {out_dir / 'results.jsonl'}  table: {out_dir / 'summary.md'}  "
          f"plot: {out_dir / 'speedup.png'}")
  figures = {
      "model": cfg.model,
      "prompts": overall.get(metrics.AR, {}).get("prompts", 0),
      "methods": {m: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                  for m, r in overall.items()},
  }
  return figures


def _overall_table(overall: dict) -> str:
  head = ("| method | tok/s | speedup | M | α | mismatches | draft | verify | device rounds "
          "| selection | other |")
  lines = [head, "|" + " --- |" * 11]
  for m, r in overall.items():
    if m == metrics.AR:
      lines.append(f"| AR | {r['tokens_per_s']:.1f} | 1.00 | – | – | – | – | – | – | – | – |")
    else:
      lines.append(
          f"| {m} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['M']:.2f} | "
          f"{r['alpha']:.2f} | {metrics.mismatch_text(r['mismatches'])} | {r['draft_share']:.0%} | "
          f"{r['verify_share']:.0%} | {r['rounds_share']:.0%} | {r['selection_share']:.0%} | "
          f"{r['other_share']:.1%} |")
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



def _lengths_table(saved: dict) -> str:
  """The chosen draft lengths and the measurements behind them, as a markdown table."""
  lines = ["| method | pilot α | draft step ÷ AR step | verify(γ) ÷ AR step | γ chosen |",
           "|" + " --- |" * 5]
  for name, r in sorted(saved.items()):
    verify = ", ".join(f"γ={g}: {v:.2f}" for g, v in
                       sorted(r["verify_cost"].items(), key=lambda kv: int(kv[0])))
    lines.append(f"| {name} | {r['alpha']:.3f} | {r['draft_cost']:.3f} | {verify} | "
                 f"{r['gamma']} |")
  return "\n".join(lines)


def _write_docs(cfg: BenchConfig, table: str, cat_table: str, overall: dict,
                lengths: str = "") -> None:
  """Regenerate this model's section of docs/BENCHMARKS.md."""
  n = overall.get(metrics.AR, {}).get("prompts", 0)
  threshold = ("per drafter (0.8; KnapSpec 0.7; 8bit 0)" if cfg.threshold is None
               else cfg.threshold)
  gamma = (f"γ per drafter (≤ {cfg.gamma}) of highest predicted tokens per time, from its "
           f"acceptance on a pilot prompt and its step costs measured here (table below)"
           if cfg.auto_gamma else f"γ ≤ {cfg.gamma}")
  body = "\n".join([
      f"## SSD vs AR on Spec-Bench ({cfg.model})", "",
      f"{n} prompts ({cfg.per_category} per category), {cfg.max_new_tokens} new tokens, "
      f"{gamma}, threshold {threshold}, "
      f"{'greedy' if cfg.temperature == 0 else f'T={cfg.temperature}'}; AR and every drafter "
      f"in the same process. Machine: {docs.machine()}.", "",
      table, "", "Speedup vs AR by category:", "", cat_table,
  ] + (["", "Draft lengths (`--auto-gamma`):", "", lengths] if lengths else []))
  docs.write_section(f"bench-{cfg.model}", body, _command(cfg))


def _command(cfg: BenchConfig) -> str:
  """The `specjax bench` command line that reproduces this run."""
  from specjax.data import SPEC_BENCH_CATEGORIES

  parts = [f"specjax bench --model {cfg.model} --per-category {cfg.per_category}",
           f"--max-new-tokens {cfg.max_new_tokens} --drafters {','.join(cfg.drafters)}",
           f"--gamma {cfg.gamma}" + (" --auto-gamma" if cfg.auto_gamma else "")
           + ("" if cfg.threshold is None else f" --threshold {cfg.threshold}"),
           f"--search-iterations {cfg.search_iterations}"]
  if tuple(cfg.categories) != SPEC_BENCH_CATEGORIES:
    parts.append(f"--categories {','.join(cfg.categories)}")
  if cfg.temperature:
    parts.append(f"--temperature {cfg.temperature} --top-p {cfg.top_p} --seed {cfg.seed}")
  return " ".join(parts + ["--write-docs"])
