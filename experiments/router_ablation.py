"""DynaSpec router ablation on one set of training pairs: how the router's recall at the
positions a draft predicts grows with its training text, and what weighing the model's own
continuations up does.

The pairs are those `specjax router train --keep-pairs` stored (they are computed again,
resumably, when absent: one target forward per sequence). Every router variant is trained
on them with the same clusters and evaluated on the same held-out sequences: every fourth
of the continued training sequences (prompt + the model's greedy continuation), never
trained on. Recall is measured at the positions inside their continuations (what a draft
predicts) and over all their positions. Variants: the first n training sequences (in the
order the build reads them) for each n of --sizes, and the largest n with each
continuation weight of --weights. Each variant is saved as it ends (--resume goes on).

  python -m experiments.router_ablation --model qwen2.5-coder-1.5b-instruct \\
      --prompts 64 --router-prompts 640 --sizes 160,320,640 --weights 4,16 --write-docs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from experiments import report
from specjax import plots
from specjax.bench.results_store import ResultsStore
from specjax.models.loader import load_model
from specjax.models.source import resolve
from specjax.offline import shortlists
from specjax.offline.router import (
  collect_pairs,
  is_current,
  load_bundle,
  recall_at,
  select,
  train_router,
)
from specjax.storage import cache_root

KS = (16, 32, 64)
HOLD_EVERY = 4  # every 4th continued sequence is held out for evaluation


def variants(sizes: list[int], weights: list[float]) -> list[tuple[int, float]]:
  """(training sequences, continuation weight): each size at weight 1, then the largest
  size at each other weight."""
  top = max(sizes)
  return [(n, 1.0) for n in sorted(sizes)] + [(top, w) for w in weights if w != 1.0]


def held_out(continued: int) -> np.ndarray:
  """The evaluation sequences: every HOLD_EVERY-th continued one."""
  return np.arange(0, continued, HOLD_EVERY)


def first_sequences(pairs, n: int, held: np.ndarray):
  """The pairs of the first `n` sequences that are not held out."""
  groups = np.setdiff1d(np.unique(pairs.group), held)[:n]
  return select(pairs, np.isin(pairs.group, groups))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=48,
                 help="continued training prompts the pairs were built with")
  p.add_argument("--new-tokens", type=int, default=48)
  p.add_argument("--router-prompts", type=int, default=320,
                 help="training prompts the pairs were built with")
  p.add_argument("--sizes", help="training sequences per variant, comma-separated "
                 "(default: a quarter, half and all of --router-prompts)")
  p.add_argument("--weights", default="4,16",
                 help="continuation weights tried at the largest size")
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--epochs", type=int, default=10)
  p.add_argument("--data-dir")
  report.common_args(p, default_model="qwen2.5-coder-1.5b-instruct")
  args = p.parse_args(argv)
  sizes = ([int(s) for s in args.sizes.split(",") if s] if args.sizes else
           [args.router_prompts // 4, args.router_prompts // 2, args.router_prompts])
  weights = [float(w) for w in args.weights.split(",") if w]
  folder = cache_root() / "shortlists" / resolve(args.model).key
  if not is_current(folder / "router"):  # said before a model load of seconds to minutes
    raise SystemExit(f"no router for {args.model}: run `specjax router train --model "
                     f"{args.model} --prompts {args.prompts} --router-prompts "
                     f"{args.router_prompts} --keep-pairs` first")
  store = ResultsStore(Path(args.out or f"runs/router-ablation-{args.model}"),
                       report.settings(args), resume=args.resume)

  model = load_model(args.model, dtype=args.dtype)
  bundle = load_bundle(folder / "router", model=model.name)  # its clusters label the pairs
  continued = shortlists.training_prompts(model.tokenizer, args.prompts, args.data_dir)
  seqs = shortlists.sequences(model, folder, continued, args.new_tokens)
  texts = shortlists.router_texts(model.tokenizer, seqs, continued, args.router_prompts,
                                  args.data_dir)
  pairs = collect_pairs(model, texts, bundle.clusters, save_dir=folder / "pairs")
  lengths = [len(q) for q in continued]
  held = held_out(len(continued))
  is_held = np.isin(pairs.group, held)
  evaluation = {"outputs": select(pairs, is_held & shortlists.in_continuation(pairs, lengths)),
                "all": select(pairs, is_held)}

  for n, w in variants(sizes, weights):
    unit = f"n={n},w={w:g}"
    if store.done(unit):
      continue
    train = first_sequences(pairs, n, held)
    t0 = time.perf_counter()
    result = train_router(train, bundle.clusters, k_max=bundle.k_max, hidden=args.hidden,
                          epochs=args.epochs,
                          weight=shortlists.continuation_weights(train, lengths, w))
    rec = dict(sequences=int(np.unique(train.group).size), weight=w,
               pairs=int(train.target.size), train_s=time.perf_counter() - t0,
               best_val_loss=float(min(result.val_loss)))
    for where, ev in evaluation.items():
      rec[where] = {str(k): recall_at(result.router, ev, bundle.clusters, k) for k in KS}
    store.add(unit, [rec])
    print(json.dumps({unit: rec}), file=sys.stderr)

  rows = store.records()
  header = ["training sequences", "pairs", "continuation weight"] + [
      f"recall@{k} at outputs" for k in KS] + [f"recall@{k} all positions" for k in KS]
  table = report.markdown_table(header, [
      [r["sequences"], r["pairs"], f"{r['weight']:g}"]
      + [f"{r[where][str(k)]:.3f}" for where in ("outputs", "all") for k in KS]
      for r in rows])
  print(f"\n{table}\n")
  figures = dict(model=model.name, held_out_sequences=int(held.size),
                 eval_positions={k: int(v.target.size) for k, v in evaluation.items()},
                 variants=rows)
  if args.write_docs:
    plot = Path(store.folder) / "router_ablation.png"
    plot_scaling(rows, plot, model.name)
    image = report.copy_image(plot, f"router_ablation_{model.name}.png")
    report.write_section(f"router-ablation-{model.name}", "\n".join([
        f"## DynaSpec router: training text and continuation weight ({model.name})", "",
        f"One set of training pairs (the target's final hidden state and its next-token "
        f"mass over {bundle.clusters.num_clusters} clusters at every position of "
        f"{len(texts)} training sequences: {args.prompts} prompts with the model's own "
        f"{args.new_tokens}-token continuation, then prompts alone). Held out: "
        f"{held.size} continued sequences (every {HOLD_EVERY}th), evaluated at the "
        f"{evaluation['outputs'].target.size} positions inside their continuations (what "
        f"a draft predicts) and at all {evaluation['all'].target.size} of their positions. "
        f"Each router: hidden {args.hidden}, {args.epochs} epochs, the epoch of lowest "
        f"validation loss kept; recall of the target's top token at the top-k clusters. "
        f"The held-out sequences come from the training pool (GSM8K train, Spec-Bench "
        f"past the evaluation prompts), so their recall runs above the evaluation "
        f"prompts' (`bench_vocab.py`). Machine: {report.machine()}.", "", table, "",
        findings(rows), "", image]))
  report.print_json(figures)


def findings(rows: list[dict], k: int = KS[0]) -> str:
  """What the table says, in words that follow its numbers: recall@k at the outputs as
  the text grows, and what each continuation weight changed at the largest size."""
  flat = sorted((r for r in rows if r["weight"] == 1.0), key=lambda r: r["sequences"])
  at = lambda r: r["outputs"][str(k)]
  text = [f"Recall@{k} at the outputs goes " + " → ".join(
      f"{at(r):.3f} ({r['sequences']} sequences)" for r in flat) + "."]
  top = flat[-1] if flat else None
  for r in rows:
    if top and r["weight"] != 1.0 and r["sequences"] == top["sequences"]:
      text.append(f"Weighing the continuations {r['weight']:g}× moves it by "
                  f"{at(r) - at(top):+.3f}.")
  return " ".join(text)


def plot_scaling(rows: list[dict], path: Path, name: str) -> None:
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(5, 3.2))
  flat = sorted((r for r in rows if r["weight"] == 1.0), key=lambda r: r["sequences"])
  for k in KS:
    ax.plot([r["sequences"] for r in flat],
            [r["outputs"][str(k)] for r in flat], "o-",
            label=f"top-{k} clusters")
  ax.set_xscale("log", base=2)
  ax.set_xticks([r["sequences"] for r in flat], [str(r["sequences"]) for r in flat])
  ax.minorticks_off()
  ax.set_xlabel("router training sequences")
  ax.set_ylabel("recall at held-out outputs")
  ax.legend()
  ax.set_title(f"DynaSpec router, {name}")
  plots.save(fig, path)


if __name__ == "__main__":
  main()
