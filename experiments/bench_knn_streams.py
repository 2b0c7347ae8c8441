"""KNN-SSD on mixed task streams: SSD-F, SSD-M and KNN-SSD vs AR, in one process.

Streams of held-out prompts (never used to build the library) switch domain after each
prompt with probability r (`data.task_stream`). Methods, as in the KNN-SSD paper:
  * SSD-F: a Self-SD skip set searched on the stream's first prompt, then fixed;
  * SSD-M: one skip set searched on a mixture (one representative prompt per domain);
  * KNN-SSD: the library's skip set of the nearest anchor's domain, per prompt.
Also: domain classification accuracy of the 1-NN lookup on held-out prompts, the
similarity of out-of-domain prompts (HumanEval, no anchors) to their nearest anchor, and
KNN-SSD vs AR on them. Greedy outputs are checked against AR. Results are appended to
results.jsonl as they are made; --resume continues a crashed run. The last output line
is one JSON object with the figures.

  python experiments/bench_knn_streams.py --model smollm2-135m-instruct --write-docs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import report  # noqa: E402

from specjax import bench, data, metrics, plots  # noqa: E402
from specjax.drafters import KNNDrafter, StaticDrafter, self_sd  # noqa: E402
from specjax.drafters.static import load_plan, save_plan  # noqa: E402
from specjax.engine import speculative_generate  # noqa: E402
from specjax.generate import generate  # noqa: E402
from specjax.knn_build import domain_prompts, embed_all, prompt_ids  # noqa: E402
from specjax.loader import load_model  # noqa: E402

METHODS = ("ssd_f", "ssd_m", "knn")


class Results:
  """results.jsonl: one JSON object per finished unit of work, keyed for --resume."""

  def __init__(self, path: Path, resume: bool):
    if path.exists() and not resume:
      raise SystemExit(f"{path} exists: pass --resume to continue it, or choose another --out")
    self.path = path
    self.records = bench._read_records(path)
    self.done = {r["key"] for r in self.records}

  def add(self, key: str, recs: list[dict]) -> None:
    recs = [dict(r, key=key) for r in recs]
    with self.path.open("a") as f:
      f.write("".join(json.dumps(r) + "\n" for r in recs))
    self.records += recs
    self.done.add(key)


def searched_plan(model, path: Path, prompts: list[data.Prompt], args):
  """A Self-SD skip set searched on `prompts`, saved beside the results (reused on resume)."""
  if path.exists():
    return load_plan(path, model=model.name)
  ids = [prompt_ids(model.tokenizer, p) for p in prompts]
  res = self_sd.search(model.graphdef, model.state, model.config, ids,
                       iterations=args.search_iterations, gamma=args.gamma, seed=args.seed)
  save_plan(path, res.plan, model=model.name, alpha=res.alpha, objective=res.objective,
            search_prompts=[p.id for p in prompts])
  return res.plan


def classify(model, lib, held: dict, ood: list, results: Results, args) -> None:
  """1-NN domain of every held-out prompt (capped per domain) and of the OOD prompts."""
  for domain, prompts in [*held.items(), ("ood:humaneval", ood)]:
    key = f"classify/{domain}"
    if key in results.done:
      continue
    prompts = prompts[: args.classify_per_domain]
    x = embed_all(model, prompts, f"classify {domain}")
    recs = []
    for p, e in zip(prompts, x):
      m = lib.nearest(e)
      recs.append(dict(kind="classify", domain=domain, prompt_id=p.id, predicted=m.name,
                       similarity=m.similarity))
    results.add(key, recs)


def run_prompt(model, prompt, drafters: dict, args, **tags) -> list[dict]:
  ids = prompt_ids(model.tokenizer, prompt)
  kw = dict(max_new_tokens=args.max_new_tokens)
  ar = generate(model.graphdef, model.state, model.config, ids, **kw)
  base = dict(kind="decode", prompt_id=prompt.id, domain=prompt.category,
              prompt_tokens=len(ids), **tags)
  recs = [dict(base, method=metrics.AR, decode_tokens=len(ar.tokens) - 1,
               decode_s=ar.decode_s, verify_s=ar.decode_s)]
  for name, d in drafters.items():
    g = speculative_generate(model.graphdef, model.state, model.config, ids, d,
                             gamma=args.gamma, **kw)
    rec = dict(base, method=name, decode_tokens=len(g.tokens) - 1, decode_s=g.decode_s,
               matches_ar=g.tokens == ar.tokens,
               **{k: getattr(g, k) for k in ("rounds", "drafted", "accepted", "committed",
                                              "draft_s", "verify_s", "selection_s",
                                              "other_s")})
    if name == "knn":
      rec.update(knn_domain=g.drafter_state.domain, similarity=g.drafter_state.similarity)
    recs.append(rec)
  return recs


def run(args) -> dict:
  out_dir = Path(args.out or f"runs/knn-streams-{args.model}")
  out_dir.mkdir(parents=True, exist_ok=True)
  results = Results(out_dir / "results.jsonl", args.resume)
  model = load_model(args.model)
  cfg = bench.BenchConfig(
      model=model.name, drafters=("knn",), per_category=1, categories=(),
      max_new_tokens=args.max_new_tokens, max_turns=1, gamma=args.gamma, threshold=None,
      temperature=0.0, top_p=1.0, seed=args.seed, search_iterations=args.search_iterations,
      plan_file=None)
  lib = bench.knn_library(model, cfg, args.data_dir)
  build, held = domain_prompts(args.data_dir, lib.domains)
  ood = data.load_humaneval(limit=max(args.classify_per_domain, args.ood))
  classify(model, lib, held, ood, results, args)

  by_id = {p.id: p for ps in build.values() for p in ps}
  mixture = [by_id[lib.meta[d]["search_ids"][0]] for d in lib.domains]
  ssd_m = StaticDrafter(searched_plan(model, out_dir / "ssd_m_plan.json", mixture, args))
  knn = KNNDrafter(lib)
  streams = {r: list(data.task_stream(held, args.stream_length, r, args.seed))
             for r in args.ratios}
  total = sum(len(s) for s in streams.values()) + args.ood
  bar = tqdm(total=total, desc="knn streams", unit="prompt")
  for r, stream in streams.items():
    ssd_f = StaticDrafter(searched_plan(model, out_dir / f"ssd_f_plan_r{r}.json", stream[:1],
                                        args))
    drafters = {"ssd_f": ssd_f, "ssd_m": ssd_m, "knn": knn}
    for j, p in enumerate(stream):
      key = f"stream/{r}/{j}"
      if key not in results.done:
        results.add(key, run_prompt(model, p, drafters, args, ratio=r, index=j))
      bar.update()
  for j, p in enumerate(ood[: args.ood]):
    key = f"ood/{j}"
    if key not in results.done:
      results.add(key, run_prompt(model, p, {"ssd_m": ssd_m, "knn": knn}, args, ratio="ood",
                                  index=j))
    bar.update()
  bar.close()
  return finish(model, lib, args, out_dir, results.records)


def per_prompt_speedups(runs: list[dict], method: str) -> list[float]:
  ar = {(r["ratio"], r["index"]): r for r in runs if r["method"] == metrics.AR}
  out = []
  for r in runs:
    if r["method"] == method:
      a = ar[(r["ratio"], r["index"])]
      out.append((r["decode_tokens"] / r["decode_s"]) / (a["decode_tokens"] / a["decode_s"]))
  return out


def finish(model, lib, args, out_dir: Path, records: list[dict]) -> dict:
  cls = [r for r in records if r.get("kind") == "classify"]
  in_dom = [r for r in cls if not r["domain"].startswith("ood")]
  ood_cls = [r for r in cls if r["domain"].startswith("ood")]
  accuracy = {d: float(np.mean([r["predicted"] == d for r in in_dom if r["domain"] == d]))
              for d in lib.domains}
  overall_acc = float(np.mean([r["predicted"] == r["domain"] for r in in_dom]))
  sim_in = float(np.median([r["similarity"] for r in in_dom]))
  sim_ood = float(np.median([r["similarity"] for r in ood_cls])) if ood_cls else None
  ood_domains = {d: sum(r["predicted"] == d for r in ood_cls) for d in lib.domains}

  runs = [r for r in records if r.get("kind") == "decode"]
  groups = list(args.ratios) + (["ood"] if args.ood else [])
  summary = {str(g): metrics.summarize([r for r in runs if r["ratio"] == g]) for g in groups}
  medians = {str(g): {m: float(np.median(per_prompt_speedups(
      [r for r in runs if r["ratio"] == g], m))) for m in summary[str(g)] if m != metrics.AR}
      for g in groups}
  header = ["stream r", "method", "tok/s", "speedup", "median per-prompt speedup", "M", "α",
            "lookup share", "mismatches"]
  rows = []
  for g in groups:
    s = summary[str(g)]
    rows.append([g, "AR", round(s[metrics.AR]["tokens_per_s"], 1), "1.00", "–", "–", "–",
                 "–", "–"])
    for m in METHODS:
      if m in s:
        rows.append([g, m, round(s[m]["tokens_per_s"], 1), f"{s[m]['speedup']:.2f}",
                     f"{medians[str(g)][m]:.2f}", f"{s[m]['M']:.2f}", f"{s[m]['alpha']:.2f}",
                     f"{s[m]['selection_share']:.2%}" if m == "knn" else "–",
                     s[m]["mismatches"]])
  table = report.markdown_table(header, rows)
  knn_runs = [r for r in runs if r["method"] == "knn" and r["ratio"] != "ood"]
  routed = float(np.mean([r["knn_domain"] == r["domain"] for r in knn_runs]))
  acc_table = report.markdown_table(
      ["domain", "held-out prompts", "1-NN accuracy"],
      [[d, sum(r["domain"] == d for r in in_dom), f"{accuracy[d]:.2f}"] for d in lib.domains]
      + [["all", len(in_dom), f"{overall_acc:.2f}"]])
  plot = plot_streams(summary, medians, args, out_dir / "knn_streams.png")
  print(f"\n{table}\n\n{acc_table}\n\nmedian cosine to the nearest anchor: held-out "
        f"{sim_in:.3f}, HumanEval (no anchors) {sim_ood}; HumanEval routed to {ood_domains}\n")
  figures = {
      "model": model.name,
      "streams": {g: {m: {k: (round(v, 4) if isinstance(v, float) else v)
                          for k, v in s.items()} for m, s in summary[g].items()}
                  for g in summary},
      "median_speedup": medians,
      "classification_accuracy": accuracy, "classification_accuracy_all": overall_acc,
      "stream_routing_accuracy": routed,
      "median_similarity": {"held_out": sim_in, "ood_humaneval": sim_ood},
      "ood_routed_to": ood_domains,
      "mismatches": sum(metrics.total_mismatches(g) for g in summary.values()),
  }
  if args.write_docs:
    image = report.copy_image(plot, f"knn_streams_{model.name}.png")
    report.write_section(f"knn-streams-{model.name}", "\n".join([
        f"## KNN-SSD on task streams ({model.name})", "",
        f"Streams of {args.stream_length} held-out prompts over {len(lib.domains)} domains "
        f"({', '.join(lib.domains)}), switching domain after each prompt with probability r; "
        f"{args.max_new_tokens} new tokens, greedy, γ ≤ {args.gamma}; Self-SD searches of "
        f"{args.search_iterations} iterations (SSD-F: on the stream's first prompt; SSD-M: "
        f"one representative prompt per domain; KNN-SSD library: `specjax knn build`, "
        f"{lib.anchors.shape[0]} anchors). AR and every method in the same process; "
        f"`speedup` is total tokens over total decode time, the median is over prompts. "
        f"`lookup share` is KNN-SSD's lookup time over its decode time (the prompt "
        f"embedding itself is pooled inside the prefill executable). Machine: "
        f"{report.machine()}.", "", table, "",
        "Domain classification by 1-NN over the anchors, on held-out prompts "
        f"(up to {args.classify_per_domain} per domain); in the streams KNN-SSD routed "
        f"{routed:.0%} of prompts to their own domain:", "", acc_table, "",
        f"Out of domain: HumanEval prompts (no code domain in the library) have median "
        f"cosine {sim_ood:.3f} to their nearest anchor, against {sim_in:.3f} for held-out "
        f"in-domain prompts; they were routed to "
        f"{', '.join(f'{d} ({n})' for d, n in ood_domains.items() if n)}. The `ood` rows "
        f"above are KNN-SSD and SSD-M on {args.ood} of them.", "", image]))
  return figures


def plot_streams(summary: dict, medians: dict, args, path: Path) -> Path | None:
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  xs = list(args.ratios)
  for m, style in zip(METHODS, ("o-", "s--", "^-")):
    ax.plot(xs, [summary[str(r)][m]["speedup"] for r in xs], style, label=m)
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_xlabel("mix ratio r (probability of a domain switch)")
  ax.set_ylabel("speedup vs AR (same run)")
  ax.legend()
  plots.save(fig, path)
  return path


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--ratios", default="0,0.3,0.7,1")
  p.add_argument("--stream-length", type=int, default=10)
  p.add_argument("--classify-per-domain", type=int, default=20)
  p.add_argument("--ood", type=int, default=4, help="HumanEval prompts decoded")
  p.add_argument("--max-new-tokens", type=int, default=48)
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--search-iterations", type=int, default=40)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--data-dir")
  p.add_argument("--out")
  p.add_argument("--resume", action="store_true")
  p.add_argument("--write-docs", action="store_true")
  args = p.parse_args(argv)
  args.ratios = [float(r) for r in args.ratios.split(",") if r]
  report.print_json(run(args))


if __name__ == "__main__":
  main()
