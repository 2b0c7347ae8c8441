"""DynaSpec router ablation on one set of training pairs: how the router's recall at the
positions a draft predicts depends on what it reads (the paper's [E(x_t), h̃_{t−1}] or our
h_t), how it grows with its training text, and what weighing the model's own
continuations up does.

The pairs are those `specjax router train --keep-pairs` stored (they are computed again,
resumably, when absent: one target forward per sequence). Every router variant is trained
on them with the same clusters and evaluated on the same held-out sequences: every fourth
of the continued training sequences (prompt + the model's greedy continuation), never
trained on. Recall is measured at the positions inside their continuations (what a draft
predicts) and over all their positions but each sequence's first (where h̃_{t−1} does not
exist), the same positions for every input. Every router learns the same soft labels (the
target's next-token mass per cluster), so inputs differ in nothing else. Variants, for the
first input of --inputs: the first n training sequences (in the order the build reads
them) for each n of --sizes, and the largest n with each continuation weight of
--weights; each other input at the largest n. Each variant is saved as it ends (--resume
goes on).

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
from specjax.models.source import artefact_key, resolve
from specjax.offline import shortlists
from specjax.offline.router import (
  INPUTS,
  collect_pairs,
  is_current,
  load_bundle,
  recall_at,
  select,
  train_router,
)

KS = (16, 32, 64)
HOLD_EVERY = 4  # every 4th continued sequence is held out for evaluation


def variants(sizes: list[int], weights: list[float], inputs: list[str] = INPUTS[:1]
             ) -> list[tuple[int, float, str]]:
  """(training sequences, continuation weight, router input): for the first input each
  size at weight 1, then the largest size at each other weight; each other input at the
  largest size and weight 1."""
  top, first = max(sizes), inputs[0]
  return ([(n, 1.0, first) for n in sorted(sizes)]
          + [(top, w, first) for w in weights if w != 1.0]
          + [(top, 1.0, i) for i in inputs[1:]])


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
  p.add_argument("--inputs", default=",".join(INPUTS),
                 help="router inputs, comma-separated; the first gets the size and weight "
                 "variants (embed_prev: the paper's [E(x_t), h_{t-1}]; hidden: h_t)")
  p.add_argument("--clusters", type=int, default=1024,
                 help="the router's clusters (its folder: `specjax router train --clusters`)")
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--epochs", type=int, default=10)
  p.add_argument("--data-dir")
  report.common_args(p, default_model="qwen2.5-coder-1.5b-instruct")
  args = p.parse_args(argv)
  sizes = ([int(s) for s in args.sizes.split(",") if s] if args.sizes else
           [args.router_prompts // 4, args.router_prompts // 2, args.router_prompts])
  weights = [float(w) for w in args.weights.split(",") if w]
  inputs = [i for i in args.inputs.split(",") if i]
  if not inputs or set(inputs) - set(INPUTS):
    raise SystemExit(f"--inputs takes some of {', '.join(INPUTS)}, got {args.inputs!r}")
  folder = shortlists.folder(resolve(args.model).key, args.clusters)
  if not is_current(folder / "router"):  # said before a model load of seconds to minutes
    clusters = f" --clusters {args.clusters}" if args.clusters != shortlists.CLUSTERS else ""
    raise SystemExit(f"no router for {args.model}: run `specjax router train --model "
                     f"{args.model} --prompts {args.prompts} --router-prompts "
                     f"{args.router_prompts}{clusters} --keep-pairs` first")
  store = ResultsStore(Path(args.out or f"runs/router-ablation-{args.model}"),
                       report.settings(args), resume=args.resume)

  model = load_model(args.model, dtype=args.dtype)
  bundle = load_bundle(folder / "router", model=artefact_key(model))  # clusters label pairs
  continued = shortlists.training_prompts(model.tokenizer, args.prompts, args.data_dir)
  seqs = shortlists.sequences(model, folder, continued, args.new_tokens)
  texts = shortlists.router_texts(model.tokenizer, seqs, continued, args.router_prompts,
                                  args.data_dir)
  pairs = collect_pairs(model, texts, bundle.clusters, save_dir=folder / "pairs")
  lengths = [len(q) for q in continued]
  held = held_out(len(continued))
  # Positions marked, not selected: an "embed_prev" router reads the row before each.
  scored = np.isin(pairs.group, held) & np.isin(np.arange(pairs.group.size),
                                                pairs.usable("embed_prev"))
  evaluation = {"outputs": scored & shortlists.in_continuation(pairs, lengths), "all": scored}

  ks = [k for k in KS if k <= bundle.clusters.num_clusters] or [bundle.k_max]
  for n, w, reads in variants(sizes, weights, inputs):
    unit = f"n={n},w={w:g},inputs={reads}"
    if store.done(unit):
      continue
    train = first_sequences(pairs, n, held)
    t0 = time.perf_counter()
    result = train_router(train, bundle.clusters, k_max=bundle.k_max, hidden=args.hidden,
                          inputs=reads, epochs=args.epochs,
                          weight=shortlists.continuation_weights(train, lengths, w))
    rec = dict(sequences=int(np.unique(train.group).size), weight=w, inputs=reads,
               pairs=int(train.target.size), train_s=time.perf_counter() - t0,
               best_val_loss=float(min(result.val_loss)))
    for where, mask in evaluation.items():
      rec[where] = {str(k): recall_at(result.router, pairs, bundle.clusters, k, where=mask)
                    for k in ks}
    store.add(unit, [rec])
    print(json.dumps({unit: rec}), file=sys.stderr)

  rows = store.records()
  header = ["router input", "training sequences", "pairs", "continuation weight"] + [
      f"recall@{k} at outputs" for k in ks] + [f"recall@{k} all positions" for k in ks]
  table = report.markdown_table(header, [
      [r.get("inputs", "hidden"), r["sequences"], r["pairs"], f"{r['weight']:g}"]
      + [f"{r[where][str(k)]:.3f}" for where in ("outputs", "all") for k in ks]
      for r in rows])
  print(f"\n{table}\n")
  figures = dict(model=model.name, held_out_sequences=int(held.size),
                 eval_positions={k: int(v.sum()) for k, v in evaluation.items()},
                 variants=rows)
  if args.write_docs:
    plot = Path(store.folder) / "router_ablation.png"
    plot_scaling(rows, plot, model.name, ks)
    image = report.copy_image(plot, f"router_ablation_{model.name}.png")
    report.write_section(f"router-ablation-{model.name}", "\n".join([
        f"## DynaSpec router: input, training text and continuation weight "
        f"({model.name})", "",
        f"One set of training pairs (the target's final hidden state, the token's "
        f"embedding and its next-token "
        f"mass over {bundle.clusters.num_clusters} clusters at every position of "
        f"{len(texts)} training sequences: {args.prompts} prompts with the model's own "
        f"{args.new_tokens}-token continuation, then prompts alone). Held out: "
        f"{held.size} continued sequences (every {HOLD_EVERY}th), evaluated at the "
        f"{evaluation['outputs'].sum()} positions inside their continuations (what "
        f"a draft predicts) and at all {evaluation['all'].sum()} of their positions but "
        f"the first. Router inputs: embed_prev, the paper's [E(x_t), h_{{t-1}}]; hidden, "
        f"h_t. Each router: hidden {args.hidden}, {args.epochs} epochs, the epoch of lowest "
        f"validation loss kept; recall of the target's top token at the top-k clusters. "
        f"The held-out sequences come from the training pool (GSM8K train, Spec-Bench "
        f"past the evaluation prompts), so their recall runs above the evaluation "
        f"prompts' (`bench_vocab.py`). Machine: {report.machine()}.", "", table, "",
        findings(rows, ks[0]), "", image]))
  report.print_json({**figures, "findings": findings(rows, ks[0])})


def findings(rows: list[dict], k: int = KS[0]) -> str:
  """What the table says, in words that follow its numbers: recall@k at the outputs as
  the text grows, what each continuation weight changed at the largest size, and each
  other router input against the first at that size."""
  reads = lambda r: r.get("inputs", "hidden")  # runs before the input was a variant: h_t
  main_input = reads(rows[0]) if rows else None
  flat = sorted((r for r in rows if r["weight"] == 1.0 and reads(r) == main_input),
                key=lambda r: r["sequences"])
  at = lambda r: r["outputs"][str(k)]
  text = [f"Recall@{k} at the outputs goes " + " → ".join(
      f"{at(r):.3f} ({r['sequences']} sequences)" for r in flat) + "."]
  top = flat[-1] if flat else None
  for r in rows:
    if not top or r["sequences"] != top["sequences"]:
      continue
    if r["weight"] != 1.0 and reads(r) == main_input:
      text.append(f"Weighing the continuations {r['weight']:g}× moves it by "
                  f"{at(r) - at(top):+.3f}.")
    elif reads(r) != main_input:
      text.append(f"A router reading {reads(r)} instead of {main_input} moves it by "
                  f"{at(r) - at(top):+.3f}.")
  return " ".join(text)


def plot_scaling(rows: list[dict], path: Path, name: str, ks=KS) -> None:
  """Recall at the held-out outputs against the clusters per shortlist: one line per router
  input and amount of training text (continuation weight 1)."""
  plt = plots.pyplot()
  fig, ax = plt.subplots(figsize=(5.5, 3.4))
  reads = lambda r: r.get("inputs", "hidden")
  flat = sorted((r for r in rows if r["weight"] == 1.0), key=lambda r: r["sequences"])
  styles = dict(zip(dict.fromkeys(reads(r) for r in flat), ("o-", "s--", "^:")))
  for r in flat:
    ax.plot(list(ks), [r["outputs"][str(k)] for k in ks], styles[reads(r)],
            label=f"{reads(r)}, {r['sequences']} sequences")
  ax.set_xscale("log", base=2)
  ax.set_xticks(list(ks), [str(k) for k in ks])
  ax.minorticks_off()
  ax.set_xlabel("clusters per shortlist (k)")
  ax.set_ylabel("recall at held-out outputs")
  ax.legend()
  ax.set_title(f"DynaSpec router, {name}")
  plots.save(fig, path)


if __name__ == "__main__":
  main()
