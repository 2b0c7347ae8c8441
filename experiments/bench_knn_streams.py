"""KNN-SSD on mixed task streams: SSD-F, SSD-M and KNN-SSD vs AR, in one process.

Streams of held-out prompts (never used to build the library) switch domain after each
prompt with probability r (`data.task_stream`). Methods, as in the KNN-SSD paper:
  * SSD-F: a Self-SD skip set searched on the stream's first prompt, then fixed;
  * SSD-M: a skip set searched on the stream's mixture (prompts spread over the stream,
    as many as the library has domains), searched again for each stream;
  * KNN-SSD: the library's skip set of the nearest anchor's domain, per prompt.
Also: domain classification accuracy of the 1-NN lookup on held-out prompts, the
similarity of out-of-domain prompts (HumanEval, no anchors) to their nearest anchor, and
KNN-SSD vs AR on them. Greedy outputs are checked against AR. Results are appended to
the shared results store as they are made; --resume continues a crashed run. The last output line
is one JSON object with the figures.

  python -m experiments.bench_knn_streams --model smollm2-135m-instruct --write-docs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from experiments import report
from specjax import data, plots
from specjax.bench import claims, harness, metrics
from specjax.bench.harness import RunSettings
from specjax.bench.results_store import ResultsStore
from specjax.drafters import KNNDrafter
from specjax.drafters.factory import DrafterFactory
from specjax.models.loader import load_model
from specjax.offline import knn_build
from specjax.offline.artefacts import ARTEFACT_OPTIONS
from specjax.offline.knn_build import domain_prompts, embed_all

METHODS = ("ssd_f", "ssd_m", "knn")


def classify(model, lib, held: dict, ood: list, store: ResultsStore, args) -> None:
  """1-NN domain of every held-out prompt (capped per domain) and of the OOD prompts."""
  for domain, prompts in [*held.items(), ("ood:humaneval", ood)]:
    unit = f"classify/{domain}"
    if store.done(unit):
      continue
    prompts = prompts[: args.classify_per_domain]
    x = embed_all(model, prompts, f"classify {domain}")
    recs = []
    for p, e in zip(prompts, x):
      m = lib.nearest(e)
      recs.append(dict(kind="classify", domain=domain, prompt_id=p.id, predicted=m.name,
                       similarity=m.similarity))
    store.add(unit, recs)


def knn_fields(name: str, g) -> dict:
  """The domain KNN-SSD routed the prompt to, and how close its anchor was."""
  if name != "knn":
    return {}
  return dict(knn_domain=g.drafter_state.domain, similarity=g.drafter_state.similarity)


def run(args) -> dict:
  out_dir = Path(args.out or f"runs/knn-streams-{args.model}")
  store = ResultsStore(out_dir, report.settings(args), resume=args.resume)
  model = load_model(args.model, dtype=args.dtype)
  factory = lambda search=None: DrafterFactory(
      model, gamma=args.gamma, seed=args.seed, search_iterations=args.search_iterations,
      work_dir=out_dir, data_dir=args.data_dir, search_prompts=search,
      # SSD-F and SSD-M draft with KNN-SSD's fixed stop, so the three differ in their
      # skip sets alone (Self-SD's adaptive draft-exiting also moves rounds to the host
      # loop, while KNN-SSD's fixed plan and stop decode on the device loop)
      options={"knn": {"search_prompts": args.knn_search_prompts},
               "self_sd": {"adaptive_stop": False}})
  lib = factory().store.knn_library()
  _, held = domain_prompts(args.data_dir, lib.domains)
  ood = fitting(model, data.load_humaneval(limit=max(args.classify_per_domain, args.ood)),
                args.max_new_tokens + args.gamma + 1)
  classify(model, lib, held, ood, store, args)

  knn = KNNDrafter(lib)
  settings = RunSettings(max_new_tokens=args.max_new_tokens, gamma=args.gamma, seed=args.seed)
  streams = {r: list(data.task_stream(held, args.stream_length, r, args.seed))
             for r in args.ratios}
  total = sum(len(s) for s in streams.values()) + args.ood
  bar = tqdm(total=total, desc="knn streams", unit="prompt")

  def decode(unit: str, p, drafters: dict, **tags) -> None:
    if not store.done(unit):
      store.add(unit, harness.run_prompt(
          model, p.turns, drafters, settings, extra=knn_fields,
          tags=dict(kind="decode", prompt_id=p.id, domain=p.category, **tags)))
    bar.update()

  for r, stream in streams.items():
    ssd_f = factory(stream[:1]).make("self_sd")  # searched on the stream's first prompt
    ssd_m = factory(mixture_of(stream, len(lib.domains))).make("self_sd")
    for j, p in enumerate(stream):
      decode(f"stream/{r}/{j}", p, {"ssd_f": ssd_f, "ssd_m": ssd_m, "knn": knn}, ratio=r,
             index=j)
  ssd_m = factory(mixture_of([p for s in streams.values() for p in s],
                             len(lib.domains))).make("self_sd")  # every stream's mixture
  for j, p in enumerate(ood[: args.ood]):
    decode(f"ood/{j}", p, {"ssd_m": ssd_m, "knn": knn}, ratio="ood", index=j)
  bar.close()
  return finish(model, lib, args, out_dir, store.records())


def fitting(model, prompts: list, room: int) -> list:
  """The prompts whose first turn leaves `room` tokens in the model's context; the others
  are named on stderr and left out (HumanEval's longest exceed a small model's window)."""
  keep = [p for p in prompts
          if len(knn_build.prompt_ids(model.tokenizer, p)) + room <= model.config.max_context]
  if len(keep) < len(prompts):
    print(f"left out {len(prompts) - len(keep)} HumanEval prompts longer than "
          f"{model.name}'s context of {model.config.max_context} tokens", file=sys.stderr)
  return keep


def mixture_of(stream: list, k: int) -> list:
  """k prompts spread evenly over the stream: what SSD-M searches on, so that its skip set
  serves the stream's mix of domains as a whole (the KNN-SSD paper's SSD-M)."""
  step = max(len(stream) / max(k, 1), 1.0)
  return [stream[int(i * step)] for i in range(min(k, len(stream)))]


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
      # per domain: Spearman's rho of the predicted objective against the measured one over
      # the library search's candidates (None for a library searched without timing)
      "rank_agreement": {d: lib.meta.get(d, {}).get("rank_agreement") for d in lib.domains},
      "mismatches": sum(metrics.total_mismatches(g) for g in summary.values()),
  }
  verdict = claims.knn_stable_and_ahead(summary)
  figures["verdicts"] = [verdict.to_json()]
  if args.write_docs:
    image = report.copy_image(plot, f"knn_streams_{model.name}{study_suffix(args)}.png")
    report.write_section(f"knn-streams-{model.name}{study_suffix(args)}", "\n".join([
        f"## KNN-SSD on task streams ({model.name})", "",
        f"Streams of {args.stream_length} held-out prompts over {len(lib.domains)} domains "
        f"({', '.join(lib.domains)}), switching domain after each prompt with probability r; "
        f"{args.max_new_tokens} new tokens, greedy, γ ≤ {args.gamma}; Self-SD searches of "
        f"{args.search_iterations} iterations, each candidate timed (SSD-F: on the stream's "
        f"first prompt; SSD-M: on {len(lib.domains)} prompts spread over the stream, searched "
        f"again per stream; KNN-SSD library: `specjax knn build`, "
        f"{lib.anchors.shape[0]} anchors, each domain's skip set searched on "
        f"{args.knn_search_prompts} of its prompts). All three draft with a fixed early "
        f"stop (KNN-SSD's; Self-SD's adaptive draft-exiting off for SSD-F and SSD-M), so "
        f"they differ in their skip sets alone. AR and every method in the same process; "
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
        f"above are KNN-SSD and SSD-M on {args.ood} of them.", "",
        "The library: per domain its anchors, the skip set its search chose, and how the "
        "predicted objective ranked that search's candidates against their measured "
        "speedups (Spearman's ρ; we time far fewer candidates than the paper's 1,000, and ρ "
        "says whether the quick objective could stand in):", "",
        knn_build.summary_table(lib), "", image, "",
        claims.section([verdict])]))
  return figures


def study_suffix(args) -> str:
  """'' for the model's section; a library searched on another number of prompts per
  domain (the search-prompt-count study) writes a section and a plot of its own."""
  n = args.knn_search_prompts
  return "" if n == ARTEFACT_OPTIONS["knn"]["search_prompts"] else f"-search-prompts{n}"


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
  p.add_argument("--ratios", default="0,0.3,0.7,1")
  p.add_argument("--stream-length", type=int, default=10)
  p.add_argument("--classify-per-domain", type=int, default=20)
  p.add_argument("--ood", type=int, default=4, help="HumanEval prompts decoded")
  p.add_argument("--max-new-tokens", type=int, default=48)
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--search-iterations", type=int, default=40)
  p.add_argument("--knn-search-prompts", type=int,
                 default=ARTEFACT_OPTIONS["knn"]["search_prompts"],
                 help="prompts each domain's skip set is searched on (its own library)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--data-dir")
  report.common_args(p)
  args = p.parse_args(argv)
  args.ratios = [float(r) for r in args.ratios.split(",") if r]
  report.print_json(run(args))


if __name__ == "__main__":
  main()
