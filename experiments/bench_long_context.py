"""AR vs Self-SD / SWIFT / CLaSp / KnapSpec on Spec-Bench prompts and on long prompts of
growing length, all in one process (speedups are ratios measured in the same run).

For each workload (Spec-Bench, then one per context length) and each prompt: AR, then
every drafter; greedy outputs are checked against AR's. Per method: tokens/s, speedup, M,
α, KnapSpec's predicted TPT, and the share of decode time spent in selection. Also:
  * the masks KnapSpec chose, over rounds and over context length (a plot);
  * how well KnapSpec's TPT predicts measured throughput across its candidates, against
    its acceptance estimate α̂ and its tokens per round alone (Pearson r each): the
    candidates of one selection, each decoded as a fixed plan with its own γ.
Results go to the shared results store prompt by prompt; --resume continues a crashed run
made with the same settings.
The last output line is one JSON object with the figures.

  python -m experiments.bench_long_context --model smollm2-135m-instruct \
      --contexts 1024,2048,4096 --write-docs
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import resource
import sys
from collections.abc import Collection
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from experiments import report
from specjax import data, plots
from specjax.bench import claims, harness, metrics
from specjax.bench.harness import RunSettings
from specjax.bench.results_store import ResultsStore
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import prefill_prompt
from specjax.drafters import KnapSpecDrafter, StaticDrafter, names
from specjax.drafters.factory import DrafterFactory
from specjax.models.loader import load_model
from specjax.offline.artefacts import ArtefactStore
from specjax.plan import DraftPlan
from specjax.selection import profiler

SPEC_CATEGORIES = ("writing", "qa", "math_reasoning", "translation", "summarization", "rag")


@dataclasses.dataclass(frozen=True)
class FixedDrafter(StaticDrafter):
  """A fixed plan with a fixed draft length: one KnapSpec candidate, measured alone."""

  name = "fixed"
  gamma: int = 4
  threshold = 0.7

  def draft_length(self, state) -> int:
    return self.gamma


def workloads(model, args) -> list[tuple[str, list[tuple[str, list]]]]:
  """[(workload, [(prompt id, turns or token ids)])]: Spec-Bench first, then each length."""
  spec = data.load_spec_bench(args.data_dir, SPEC_CATEGORIES, per_category=args.spec_bench)
  out = [("spec-bench", [(p.id, p.turns) for p in spec])] if args.spec_bench else []
  for n in args.contexts:
    if n + args.max_new_tokens + args.gamma + 1 > model.config.max_context:
      print(f"skipping {n}: beyond {model.name}'s context of {model.config.max_context}",
            file=sys.stderr)
      continue
    prompts = data.long_context_prompts(model.tokenizer, n, args.prompts, args.data_dir)
    out.append((f"ctx-{n}", [(p.id, list(p.ids)) for p in prompts]))
  return out


# Our variants, run beside the paper's method under their own names: (drafter, options).
VARIANTS = {
    # KnapSpec's DP at most once its measured cost fits 5 % of the decode time since the
    # last, at least 16 rounds apart, its candidates carried across prompts: on a CPU one DP
    # costs several draft steps (docs/FIDELITY.md).
    "knapspec-budget": ("knapspec", {"selection_budget": 0.05, "interval": 16}),
}


def make_drafters(model, args, out_dir: Path) -> dict:
  """Every drafter by its factory name, as its paper defines it unless `--option` says
  otherwise, and each of `VARIANTS` that was asked for, with its options on top."""
  # Self-SD searches once, on Spec-Bench prompts not used for evaluation.
  _, search_prompts = data.evaluation_and_search(
      data.load_spec_bench(args.data_dir, SPEC_CATEGORIES), args.spec_bench)
  drafters = {}
  for name in args.drafters:
    base, extra = VARIANTS.get(name, (name, {}))
    options = {part: dict(opts) for part, opts in args.options.items()}
    options.setdefault(base.split("+")[0], {}).update(extra)
    factory = DrafterFactory(model, gamma=args.gamma, search_iterations=args.search_iterations,
                             options=options, work_dir=out_dir, data_dir=args.data_dir,
                             search_prompts=search_prompts)
    drafters[name] = factory.make(base)
  return drafters


def options_prose(options: dict) -> str:
  """`--option` settings as the command line spells them."""
  return ", ".join(f"`{part}.{k}={v}`" for part, opts in sorted(options.items())
                   for k, v in sorted(opts.items()))


def knapspec_prose(drafters: dict) -> str:
  """How each KnapSpec drafter of the run selects, read off the drafters themselves."""
  out = []
  for name, d in drafters.items():
    while d is not None and not isinstance(d, KnapSpecDrafter):  # under an overlay
      d = getattr(d, "base", None)
    if d is None:
      continue
    when = (f"a DP once it costs ≤ {d.selection_budget:.0%} of the decode time since the "
            f"last, at least {d.interval} rounds apart, its candidates carried across prompts"
            if d.selection_budget is not None else
            "a DP after every round" if d.interval == 1 else
            f"a DP every {d.interval} rounds")
    share = ("every budget" if d.max_budget_share is None
             else f"budgets ≤ {d.max_budget_share:g}·K")
    out.append(f"`{name}`: {when}, over the last {d.window} verified tokens, {share}")
  return "; ".join(out)


def knapspec_fields(name: str, g) -> dict:
  """KnapSpec's selections (round, context, γ, the chosen masks and its candidates) and
  the (plan, γ) it ended the prompt with: with no selection in the prompt, that is the
  carried candidates' choice priced at this prompt's cache size, which it drafted with."""
  if not name.startswith("knapspec"):
    return {}
  state = g.drafter_state
  while not hasattr(state, "selections"):  # an overlay's state wraps its base's
    state = state.base
  return {"selections": [dict(round=s.round, context=s.context, gamma=s.gamma,
                              bits=np.asarray(s.chosen_bits).astype(int).tolist(),
                              predicted_tpt=s.predicted_tpt, candidates=s.candidates)
                         for s in state.selections],
          "final_plan": dict(bits=np.asarray(state.bits).astype(int).tolist(),
                             gamma=int(state.gamma))}


def plan_rows(runs: list[dict], order: list[str]) -> list[list]:
  """Per workload and KnapSpec drafter: the sub-layers run and γ the prompt ended with,
  and the DP runs within it (0: the carried plan, re-priced at this context)."""
  rows = []
  for w in order:
    for r in runs:
      if r["workload"] != w or "final_plan" not in r:
        continue
      b = np.asarray(r["final_plan"]["bits"], int)
      rows.append([w, r["prompt_tokens"], r["method"], f"{b[0::2].sum()}/{b.size // 2}",
                   f"{b[1::2].sum()}/{b.size // 2}", r["final_plan"]["gamma"],
                   len(r["selections"])])
  return rows


def peak_rss_gib() -> float:
  """This process's peak resident memory (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def prefill_selection(model, ids, drafter, args) -> dict:
  """KnapSpec's selection at this prompt's prefill, for the TPT study when the budgeted
  drafter drafted the prompt with a carried selection instead of selecting there."""
  while not isinstance(drafter, KnapSpecDrafter):  # under an overlay
    drafter = drafter.base
  fresh = dataclasses.replace(drafter, selection_budget=None)  # selects at init
  g = speculative_generate(model.graphdef, model.state, model.config, ids, fresh,
                           max_new_tokens=1, gamma=args.gamma)
  return knapspec_fields("knapspec", g)["selections"][0]


def tpt_correlation(model, ids, sel: dict, args, ar_tps: float) -> dict:
  """Decode with each of (up to) `args.tpt_candidates` candidates of one selection as a
  fixed plan with its own γ; Pearson r of predicted TPT vs measured tokens/s."""
  cands = sorted(sel["candidates"], key=lambda c: c["budget"])
  take = np.unique(np.linspace(0, len(cands) - 1, min(args.tpt_candidates, len(cands)))
                   .astype(int))
  rows = []
  pre = prefill_prompt(model.graphdef, model.state, model.config, ids,  # one prefill for all
                       max_new_tokens=args.max_new_tokens + args.gamma + 1)
  for i in take:
    c = cands[i]
    d = FixedDrafter(DraftPlan.from_bits(np.asarray(c["bits"], bool)), gamma=c["gamma"])
    g = speculative_generate(model.graphdef, model.state, model.config, ids, d,
                             max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                             prefilled=pre)
    rows.append(dict(budget=c["budget"], gamma=c["gamma"], alpha_hat=c["alpha"],
                     predicted=c["tpt"], measured=g.decode_tokens_per_s,
                     measured_alpha=g.acceptance_rate))
  return dict(rows=rows, pearson=predictor_correlations(rows)["tpt"], ar_tokens_per_s=ar_tps)


def predictor_correlations(rows: list[dict]) -> dict[str, float | None]:
  """Pearson r of the candidates' measured tokens/s with each predictor: KnapSpec's TPT,
  its acceptance estimate α̂ alone, and the tokens a round is expected to commit at that
  α̂ and γ (TPL, (1 − α̂^{γ+1}) / (1 − α̂)); None with fewer than 3 candidates or a
  predictor that does not vary."""
  meas = np.asarray([r["measured"] for r in rows], float)
  alpha = np.asarray([r["alpha_hat"] for r in rows], float)
  gamma = np.asarray([r["gamma"] for r in rows], float)
  tpl = np.where(alpha < 1, (1 - alpha ** (gamma + 1)) / np.maximum(1 - alpha, 1e-9),
                 gamma + 1)
  predictors = {"tpt": np.asarray([r["predicted"] for r in rows], float), "alpha": alpha,
                "tpl": tpl}
  return {name: (float(np.corrcoef(x, meas)[0, 1]) if len(rows) > 2 and np.std(x) > 0
                 and np.std(meas) > 0 else None) for name, x in predictors.items()}


def run(args) -> dict:
  out_dir = Path(args.out or f"runs/long-context-{args.model}")
  store = ResultsStore(out_dir, report.settings(args), resume=args.resume)
  model = load_model(args.model, dtype=args.dtype)
  drafters = make_drafters(model, args, out_dir)
  settings = RunSettings(max_new_tokens=args.max_new_tokens, gamma=args.gamma)
  work = workloads(model, args)
  bar = tqdm(total=sum(len(ps) for _, ps in work), desc=f"long-context {model.name}",
             unit="prompt")
  carried = store.load_carried()  # SWIFT and budgeted KnapSpec learn across prompts
  for workload, prompts in work:
    for j, (pid, prompt) in enumerate(prompts):
      unit = f"{workload}/{pid}"
      if not store.done(unit):
        recs = median_run(model, prompt, drafters, settings, carried, args.passes,
                          tags=dict(workload=workload, prompt_id=pid, category=workload))
        ks = [r for r in recs if r["method"].startswith("knapspec") and r["selections"]]
        knap = [d for n, d in drafters.items() if n.startswith("knapspec")]
        if j == 0 and workload != "spec-bench" and args.tpt_candidates and knap:
          sel = (ks[0]["selections"][0] if ks
                 else prefill_selection(model, prompt, knap[0], args))
          ar_tps = recs[0]["decode_tokens"] / recs[0]["decode_s"]
          recs.append(dict(workload=workload, prompt_id=pid, method="tpt_correlation",
                           **tpt_correlation(model, prompt, sel, args, ar_tps)))
        store.add(unit, recs)
        store.save_carried(carried)
      bar.update()
  bar.close()
  return finish(model, args, out_dir, store.records(), knapspec_prose(drafters))


def median_run(model, prompt, drafters: dict, settings, carried: dict, passes: int,
               tags: dict) -> list[dict]:
  """Every method decodes the prompt `passes` times, the methods in turn, and keeps its
  pass of median speed. Each pass starts from the same carried drafter states (SWIFT's
  search, budgeted KnapSpec's candidates), so no pass learns from another's decoding of
  this prompt, and each drafter carries on from the state of the pass it kept."""
  runs = []
  for _ in range(passes):
    states = copy.deepcopy(carried) if passes > 1 else carried
    runs.append((harness.run_prompt(model, prompt, drafters, settings, carried=states,
                                    extra=knapspec_fields, tags=tags), states))
  picks = harness.median_passes([recs for recs, _ in runs])
  kept = [runs[i][0][k] for k, i in enumerate(picks)]
  for rec, i in zip(kept, picks):
    if rec["method"] in runs[i][1]:
      carried[rec["method"]] = runs[i][1][rec["method"]]
  return kept


def finish(model, args, out_dir: Path, records: list[dict], ks_prose: str = "") -> dict:
  runs = [r for r in records if r["method"] != "tpt_correlation"]
  methods = [metrics.AR] + list(args.drafters)
  order = list(dict.fromkeys(r["workload"] for r in runs))
  summary = {w: metrics.summarize([r for r in runs if r["workload"] == w]) for w in order}
  ctx_len = {w: int(np.mean([r["prompt_tokens"] for r in runs if r["workload"] == w]))
             for w in order}
  tpt = {}
  for w in order:
    ks = [s for r in runs if r["workload"] == w and r["method"].startswith("knapspec")
          for s in r["selections"]]
    tpt[w] = float(np.mean([s["predicted_tpt"] for s in ks])) if ks else None
  header = ["workload", "prompt tokens", "method", "tok/s", "speedup", "M", "α",
            "selection share", "speedup w/o selection", "mismatches"]
  rows = []
  for w in order:
    for m in methods:
      s = summary[w].get(m)
      if not s:
        continue
      if m == metrics.AR:
        rows.append([w, ctx_len[w], "AR", round(s["tokens_per_s"], 1), "1.00", "–", "–", "–",
                     "–", "–"])
      else:
        rows.append([w, ctx_len[w], m, round(s["tokens_per_s"], 1), f"{s['speedup']:.2f}",
                     f"{s['M']:.2f}", f"{s['alpha']:.2f}", f"{s['selection_share']:.0%}",
                     f"{s['speedup'] / max(1 - s['selection_share'], 1e-9):.2f}",
                     s["mismatches"]])
  table = report.markdown_table(header, rows)
  corr = [r for r in records if r["method"] == "tpt_correlation"]
  rs = {c["workload"]: predictor_correlations(c["rows"]) for c in corr}
  shown = lambda v: "n/a" if v is None else f"{v:.2f}"
  corr_rows = [[c["workload"], len(c["rows"]), shown(rs[c["workload"]]["tpt"]),
                shown(rs[c["workload"]]["alpha"]), shown(rs[c["workload"]]["tpl"]),
                f"{min(x['measured'] for x in c['rows']):.1f}–"
                f"{max(x['measured'] for x in c['rows']):.1f}",
                f"{min(x['predicted'] for x in c['rows']):.1f}–"
                f"{max(x['predicted'] for x in c['rows']):.1f}"] for c in corr]
  corr_table = report.markdown_table(
      ["workload", "candidates", "r: TPT", "r: α̂", "r: TPL", "measured tok/s",
       "predicted TPT"], corr_rows)
  plans = report.markdown_table(
      ["workload", "prompt tokens", "method", "attention run", "MLP run", "γ", "DP runs"],
      plan_rows(runs, order))
  profile = ArtefactStore(model, gamma=args.gamma, verbose=False).latency_profile
  found = verdicts(args.drafters, summary, ctx_len, rs, metrics.summarize(runs),
                   attention_shares(profile, ctx_len.values()), altered=set(args.options))
  masks_png = plot_masks(runs, order, out_dir / "knapspec_masks.png")
  rss = peak_rss_gib()
  print(f"\n{table}\n\nKnapSpec's plan at each prompt's end\n{plans}\n\n"
        f"KnapSpec predicted TPT vs measured throughput\n{corr_table}\n\n"
        f"peak resident memory {rss:.1f} GiB\n")
  figures = {
      "model": model.name,
      "workloads": {w: {m: {k: (round(v, 4) if isinstance(v, float) else v)
                            for k, v in s.items()} for m, s in summary[w].items()}
                    for w in order},
      "prompt_tokens": ctx_len,
      "knapspec_predicted_tpt": tpt,
      "tpt_pearson": {w: r["tpt"] for w, r in rs.items()},
      "predictor_pearson": rs,
      "peak_rss_gib": round(rss, 2),
      "mismatches": sum(metrics.total_mismatches(summary[w]) for w in order),
      "verdicts": [v.to_json() for v in found],
  }
  if args.write_docs:
    image = report.copy_image(masks_png, f"knapspec_masks_{model.name}.png")
    body = "\n".join([
        f"## Long context: layer-skipping drafters vs AR ({model.name})", "",
        f"Spec-Bench ({args.spec_bench} prompt per category of {', '.join(SPEC_CATEGORIES)}) "
        f"and long prompts built from Spec-Bench rag/summarization documents "
        f"({args.prompts} per length), {args.max_new_tokens} new tokens, greedy, γ ≤ "
        f"{args.gamma}; every drafter as its paper defines it"
        + (f" but for `--option` {options_prose(args.options)}" if args.options else "")
        + (f". KnapSpec: {ks_prose}" if ks_prose else "")
        + ". AR and every drafter in the same process"
        + (f", {args.passes} passes of every method in turn over each prompt, each "
           "method's pass of median speed kept" if args.passes > 1 else "") + ". "
        f"Machine: {report.machine()}.", "", table, "",
        "Latency profile (`specjax profile`, medians; what KnapSpec's weights come from):",
        "", profiler.table(profile), "",
        *quantised_profile_lines(model, args),
        "`speedup w/o selection` removes the measured selection time (DP, search) from the "
        "decode time: what the drafts themselves achieve, i.e. the speedup if selection ran "
        "off the critical path or on a device where the batched DP is nearly free.", "",
        "The (plan, γ) each KnapSpec prompt ended drafting with; with no DP run in the "
        "prompt it is the carried candidates' choice priced at the prompt's cache size:",
        "", plans, "",
        "KnapSpec's candidates of one selection, each decoded as a fixed plan with its own "
        "γ: how well its tokens-per-time (TPT), its acceptance estimate α̂ alone and the "
        "tokens a round is expected to commit (TPL) predict their measured throughput "
        "(Pearson r):", "", corr_table,
        "", f"Peak resident memory of the run: {rss:.1f} GiB.", "", image, "",
        claims.section(found)])
    report.write_section(f"long-context-{model.name}", body)
  return figures


def quantised_profile_lines(model, args) -> list[str]:
  """The profiles KnapSpec selected with under quantised draft weights, for the names that
  ran (`knapspec+8bit`, `knapspec+4bit`, `knapspec+quantspec`): their sub-layers at the
  copy's times."""
  from specjax.quant import WEIGHT_KINDS

  factory = DrafterFactory(model, gamma=args.gamma, verbose=False)
  users: dict[str, list[str]] = {}
  for name in (d for d in args.drafters if d.startswith("knapspec")):
    kind = factory.draft_kind(VARIANTS.get(name, (name,))[0])
    if kind is not None:
      users.setdefault(kind, []).append(f"`{name}`")
  lines = []
  for kind, who in sorted(users.items()):
    lines += [f"The same with the draft steps reading {WEIGHT_KINDS[kind]} (what "
              f"{', '.join(who)} prices its sub-layers by; `specjax profile "
              f"--draft-weights {kind}`):", "",
              profiler.table(factory.store.latency_profile_for(kind)), ""]
  return lines


def attention_shares(profile, lengths) -> dict[int, float]:
  """Attention's share of a layer's time at each prompt length, from the latency profile:
  how much a context-aware price can move a plan there."""
  return {int(n): profile.t_attn(n) / (profile.t_attn(n) + profile.t_mlp(n)) for n in lengths}


def verdicts(drafters: list[str], summary: dict, ctx_len: dict, correlations: dict,
             overall: dict, attention_share: dict | None = None,
             altered: Collection[str] = ()) -> list[claims.Verdict]:
  """Each paper's drafter against AR on every workload; KnapSpec against its rivals over
  context and its TPT prediction; each composition against its parts over all workloads.
  A drafter whose options were `altered` no longer runs its paper's method: not judged by
  its claims, as our drafts (8bit) and `VARIANTS` are not."""
  out = []
  for m in drafters:
    if "+" in m:
      out.append(claims.composition_beats_parts(
          m, {k: r["speedup"] for k, r in overall.items()}))
    elif m in claims.PAPERS and m not in altered:
      out.append(claims.faster_than_ar(m, {w: s.get(m) for w, s in summary.items()}))
  ks = "knapspec" if "knapspec" in drafters and "knapspec" not in altered else None
  if ks:
    contexts = {w: n for w, n in ctx_len.items() if w.startswith("ctx-")}
    out.append(claims.beats_rivals_as_context_grows(summary, contexts, method=ks,
                                                    attention_share=attention_share))
    out.append(claims.tpt_predicts_throughput(correlations))
  return out


def plot_masks(runs: list[dict], order: list[str], path: Path) -> Path | None:
  """Left: the sub-layers KnapSpec ran at each selection of one prompt per workload
  (columns), attention and MLP rows apart. Right: share of attention / MLP sub-layers
  run vs prompt length."""
  plt = plots.pyplot()
  ks = [r for r in runs if r["method"].startswith("knapspec")]
  if not ks:
    return None
  first = {}
  for r in ks:
    first.setdefault(r["workload"], r)
  cols, labels = [], []
  for w in order:
    if w in first:
      for s in first[w]["selections"]:
        cols.append(s["bits"])
        labels.append(f"{w}@{s['round']}")
  bits = np.asarray(cols, float).T  # [2L, selections]
  L = bits.shape[0] // 2
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5),
                                 gridspec_kw=dict(width_ratios=[2.2, 1]))
  ax1.imshow(np.concatenate([bits[0::2], bits[1::2]]), aspect="auto", cmap="Greys",
             interpolation="nearest")
  ax1.axhline(L - 0.5, color="r", lw=1)
  ax1.set_yticks([L / 2, 1.5 * L], ["attention", "MLP"])
  ax1.set_xticks(range(len(labels)), labels, rotation=70, fontsize=6)
  ax1.set_title("sub-layers run (black) at each selection")
  xs, att, mlp = [], [], []
  for r in ks:
    for s in r["selections"]:
      b = np.asarray(s["bits"], float)
      xs.append(s["context"])
      att.append(b[0::2].mean())
      mlp.append(b[1::2].mean())
  ax2.scatter(xs, att, s=10, label="attention run")
  ax2.scatter(xs, mlp, s=10, marker="x", label="MLP run")
  carried = [r for r in ks if not r["selections"] and "final_plan" in r]  # re-priced only
  if carried:
    b = np.asarray([r["final_plan"]["bits"] for r in carried], float)
    n = [r["prompt_tokens"] for r in carried]
    ax2.scatter(n, b[:, 0::2].mean(1), s=30, facecolors="none", edgecolors="C0",
                label="attention run (carried, re-priced)")
    ax2.scatter(n, b[:, 1::2].mean(1), s=30, marker="s", facecolors="none",
                edgecolors="C1", label="MLP run (carried, re-priced)")
  ax2.set_xscale("log")
  ax2.set_xlabel("context tokens")
  ax2.set_ylabel("share of sub-layers run")
  ax2.legend(fontsize=8)
  plots.save(fig, path)
  return path


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--contexts", default="1024,2048,4096")
  p.add_argument("--prompts", type=int, default=2, help="long prompts per context length")
  p.add_argument("--spec-bench", type=int, default=1, help="Spec-Bench prompts per category")
  p.add_argument("--drafters", default="self_sd,swift,clasp,knapspec")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--option", action="append", metavar="DRAFTER.OPTION=VALUE",
                 help="a drafter option for every drafter of that part (knapspec.window=4); "
                      f"variants run beside the paper's: {', '.join(VARIANTS)}")
  p.add_argument("--passes", type=int, default=1,
                 help="passes of every method over each prompt, the median kept")
  p.add_argument("--tpt-candidates", type=int, default=6)
  p.add_argument("--search-iterations", type=int, default=40)
  p.add_argument("--data-dir")
  report.common_args(p)
  args = p.parse_args(argv)
  args.contexts = [int(n) for n in args.contexts.split(",") if n]
  args.drafters = [d for d in args.drafters.split(",") if d]
  args.options = names.parse_options(args.option)
  del args.option  # the parsed form is the setting
  report.print_json(run(args))


if __name__ == "__main__":
  main()
