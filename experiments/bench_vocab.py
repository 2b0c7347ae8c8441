"""Vocabulary shortlists for the draft head: full head vs FR-Spec vs DynaSpec, alone and
on a KnapSpec layer plan, against AR in the same process.

1. Builds (or reuses) FR-Spec's token counts and DynaSpec's clusters + router from
   training prompts (`specjax router train`; never the evaluation prompts).
2. Times one draft step (median) with the full head, FR-Spec 8k/16k/32k and DynaSpec.
3. Decodes Spec-Bench evaluation prompts with AR and each drafter; greedy outputs are
   checked against AR's. Reports tokens/s, speedup, M, α and the share of
   full-vocabulary M kept (vs the all-layer full-head draft).
4. Router recall: is the target's top token, at the positions where AR wrote its outputs
   on the evaluation prompts (what the draft predicts), in the router's top-k clusters,
   alone and with the frequency core? And the shortlist sizes for each k.
The last line is one JSON object with the figures.

  python -m experiments.bench_vocab --model gemma3-270m --write-docs
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments import report
from specjax import data
from specjax.bench import claims, harness, metrics
from specjax.bench.harness import RunSettings
from specjax.bench.results_store import ResultsStore
from specjax.decode.round import draft_step, shortlist_rows
from specjax.drafters.factory import DrafterFactory
from specjax.jit_cache import compiled
from specjax.kv_cache import KVCache
from specjax.models.loader import load_model
from specjax.offline import shortlists
from specjax.offline.artefacts import ArtefactStore
from specjax.offline.router import (
  DEFAULT_INPUTS,
  INPUTS,
  collect_pairs,
  k_schedule,
  recall_at,
)
from specjax.offline.token_counts import frequent_shortlist
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams
from specjax.selection.profiler import median_time

CATEGORIES = ("writing", "coding", "qa", "math_reasoning", "translation", "summarization",
              "extraction", "rag")
FR_SIZES = (1024, 8192, 16384, 32768)  # 1k: FR-Spec at about DynaSpec's size
DYNASPEC_KS = (32, 64, 128)
ROUTER_INPUT = {"embed_prev": "the paper's [E(x_t), h_{t-1}] (the token's embedding and the "
                              "final hidden state before it)",
                "hidden": "the draft step's own final hidden state h_t (our variant)"}
CORE = 1024  # `dynaspec-core1k`: FR-Spec's 1k most frequent tokens beside the routed clusters
# The rows that run a paper's method: DynaSpec at its defaults, FR-Spec at the shortlist
# sizes its paper reports (8k-64k). The others (FR-Spec at 1k; DynaSpec at another k, with
# a core, or reading h_t) are our variants: in the tables, judged by no paper's claim.
PAPERS_OWN = frozenset({"dynaspec", *(f"frspec-{n // 1024}k" for n in FR_SIZES
                                      if 8192 <= n <= 65536)})
# Method -> (drafter_factory name, its options given the number of layers L).
METHODS = {
    "full-vocab": ("early_exit", lambda L: {"early_exit": {"k": L}}),  # every layer
    **{f"frspec-{n // 1024}k": ("frspec", lambda L, n=n: {"frspec": {"size": n}})
       for n in FR_SIZES},
    "dynaspec": ("dynaspec", lambda L: {}),  # the router's k_max clusters
    # The same router at more clusters per shortlist (k is a decoding setting).
    **{f"dynaspec-k{k}": ("dynaspec", lambda L, k=k: {"dynaspec": {"k": k}})
       for k in DYNASPEC_KS},
    "dynaspec-core1k": ("dynaspec", lambda L: {"dynaspec": {"core": CORE}}),
    # A router reading the draft step's h_t instead of --router-inputs (the paper's by
    # default): trained on the same text, drafting at the same k schedule.
    "dynaspec-ht": ("dynaspec", lambda L: {"dynaspec": {"inputs": "hidden"}}),
    "knapspec": ("knapspec", lambda L: {}),
    "dynaspec+knapspec": ("knapspec+dynaspec", lambda L: {}),
    "frspec-32k+knapspec": ("knapspec+frspec", lambda L: {"frspec": {"size": 32768}}),
    "8bit": ("8bit", lambda L: {}),  # every layer, 8-bit weights, the full head
    "8bit+dynaspec": ("8bit+dynaspec", lambda L: {}),
    "8bit+dynaspec-core1k": ("8bit+dynaspec", lambda L: {"dynaspec": {"core": CORE}}),
}


def verdicts(methods: list[str], summary: dict, shorts: dict[str, float]
             ) -> list[claims.Verdict]:
  """Each paper's shortlist (`PAPERS_OWN`) against the full head; DynaSpec's M against
  the full head's and FR-Spec's at every size run (`shorts`: its mean shortlist size);
  each composition against its parts."""
  out = [claims.shortlist_pays(m, summary) for m in methods if m in PAPERS_OWN]
  fr = {int(m.split("-")[1][:-1]) * 1024: summary[m]["M"] for m in methods
        if m.startswith("frspec") and "+" not in m}
  if "dynaspec" in methods and "full-vocab" in summary:
    d = summary["dynaspec"]
    out.append(claims.shortlist_keeps_m(summary["full-vocab"]["M"],
                                        {"M": d["M"], "shortlist": shorts["dynaspec"]}, fr,
                                        method="dynaspec"))
  speedups = {m: r["speedup"] for m, r in summary.items()}
  out += [claims.composition_beats_parts(m, speedups) for m in methods if "+" in m]
  return out


def draft_step_times(model, plans: dict, gamma: int, repeats: int) -> dict[str, float]:
  """Median seconds per draft token: γ draft steps (no early stop) over a 512-slot cache."""
  cfg = model.config
  cache = KVCache.create(cfg, 1, 512).with_length(300)
  key, last = jax.random.key(0), jnp.int32(11)
  hidden = jnp.zeros((cfg.embed_dim,), jnp.float32)  # h_{t-1} for a router reading it
  out = {}
  for name, plan in plans.items():
    exe = compiled(draft_step, model.state, cache, last, plan, key, jnp.int32(gamma), hidden,
                   graphdef=model.graphdef, vocab=cfg.vocab_size, gamma=gamma, threshold=0.0,
                   sampling=SamplingParams())
    run = lambda: exe(model.state, cache, last, plan, key, jnp.int32(gamma), hidden).n
    out[name] = median_time(run, repeats) / gamma
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--categories", default=",".join(CATEGORIES))
  p.add_argument("--per-category", type=int, default=1)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--train-prompts", type=int, default=48)
  p.add_argument("--clusters", type=int, default=1024)
  p.add_argument("--k-max", type=int, default=16, help="clusters per DynaSpec shortlist")
  p.add_argument("--router-prompts", type=int, default=320,
                 help="training prompts the router reads (no continuation needed)")
  p.add_argument("--continuation-weight", type=float, default=1.0,
                 help="router loss weight inside the model's own continuations")
  p.add_argument("--router-inputs", choices=INPUTS, default=DEFAULT_INPUTS,
                 help="what the router reads: the paper's [E(x_t), h_{t-1}] (embed_prev) or "
                 "the draft step's h_t (hidden)")
  p.add_argument("--methods", default="full-vocab,frspec-1k,frspec-8k,frspec-32k,dynaspec,"
                 "dynaspec-k64,knapspec,dynaspec+knapspec")
  p.add_argument("--data-dir")
  report.common_args(p, default_model="gemma3-270m")
  args = p.parse_args(argv)
  cats = tuple(c for c in args.categories.split(",") if c)
  methods = [m for m in args.methods.split(",") if m]
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    raise SystemExit(f"unknown method {unknown[0]!r}; methods: {', '.join(METHODS)}")
  if args.per_category > shortlists.RESERVED:  # evaluation never overlaps training
    raise SystemExit(f"--per-category must be <= {shortlists.RESERVED} (the prompts the router "
                     f"never trains on)")
  store = ResultsStore(Path(args.out or f"runs/vocab-{args.model}"), report.settings(args),
                       resume=args.resume)

  model = load_model(args.model, dtype=args.dtype)
  cfg = model.config
  folder = shortlists.folder(model, args.clusters, args.router_inputs)
  counts, bundle, curves = shortlists.build(
      model, folder, prompts=args.train_prompts, router_prompts=args.router_prompts,
      clusters=args.clusters, k_max=args.k_max, inputs=args.router_inputs,
      continuation_weight=args.continuation_weight, data_dir=args.data_dir)
  L = cfg.num_layers
  full = DraftPlan.full(L)
  fr = {n: frequent_shortlist(counts, min(n, cfg.vocab_size), cfg.eos_ids) for n in FR_SIZES}

  # 2. Draft-step cost.
  step_plans = {"full head": full}
  rows = lambda p: p.replace(head_rows=shortlist_rows(model.state, p.vocab, p.weights,
                                                       graphdef=model.graphdef))
  step_plans |= {f"FR-Spec {n // 1024}k": rows(full.with_shortlist(fr[n], cfg.vocab_size,
                                                                    cfg.eos_ids))
                 for n in FR_SIZES}  # its rows gathered once, as the engine does
  step_plans["DynaSpec"] = full.replace(router=bundle.plan_field(args.gamma, decay=True))
  cored = rows(full.with_shortlist(fr[CORE], cfg.vocab_size, cfg.eos_ids))
  step_plans["DynaSpec + 1k core"] = cored.replace(
      router=bundle.plan_field(args.gamma, core=cored.vocab, decay=True))
  step_plans |= {f"DynaSpec k{k}": full.replace(router=bundle.plan_field(args.gamma, k, decay=True))
                 for k in DYNASPEC_KS if f"dynaspec-k{k}" in methods}
  steps = draft_step_times(model, step_plans, args.gamma, args.repeats)

  # 3. End to end: every method is a factory name with its options.
  inputs_of = lambda m: METHODS[m][1](L).get("dynaspec", {}).get("inputs", args.router_inputs)
  bundles = {args.router_inputs: bundle}
  for reads in sorted({inputs_of(m) for m in methods if "dynaspec" in m} - set(bundles)):
    other = shortlists.folder(model, args.clusters, reads)
    shortlists.share_continuations(folder, other)  # the same text, not generated again
    bundles[reads] = shortlists.build(
        model, other, prompts=args.train_prompts, router_prompts=args.router_prompts,
        clusters=args.clusters, k_max=args.k_max, inputs=reads,
        continuation_weight=args.continuation_weight, data_dir=args.data_dir)[1]
  artefacts = {"counts": counts, "bundle": bundle}
  if any("knapspec" in m for m in methods):
    artefacts["profile"] = ArtefactStore(model, gamma=args.gamma).latency_profile
  drafters = {}
  for m in methods:
    name, options = METHODS[m]
    factory = DrafterFactory(model, gamma=args.gamma, options=options(L),
                             artefacts={**artefacts, "bundle": bundles[inputs_of(m)]})
    drafters[m] = factory.make(name)
  settings = RunSettings(max_new_tokens=args.max_new_tokens, gamma=args.gamma)
  prompts = data.load_spec_bench(args.data_dir, cats, per_category=args.per_category)
  carried = store.load_carried()  # drafter states handed from prompt to prompt (KnapSpec)
  for prompt in tqdm(prompts, desc=f"vocab {model.name}", unit="prompt"):
    if not store.done(prompt.id):
      store.add(prompt.id, harness.run_prompt(model, prompt.turns, drafters, settings,
                                              carried=carried,
                                              tags=dict(prompt_id=prompt.id,
                                                        category=prompt.category)))
      store.save_carried(carried)
  runs = store.records()
  summary = metrics.summarize(runs)

  # 4. Router recall on AR's outputs for the evaluation prompts (held out from training):
  # at the positions that predict an output token, which the draft does, and (as earlier
  # runs reported it) over prompt and output.
  ar_runs = [r for r in runs if r["method"] == metrics.AR]
  heads = [harness.prompt_ids(model.tokenizer, next(p for p in prompts
                                                    if p.id == r["prompt_id"]).turns[:1])
           for r in ar_runs]
  pairs = collect_pairs(model, [h + r["tokens"][0] for h, r in zip(heads, ar_runs)],
                        bundle.clusters, verbose=False)
  # Positions marked, not selected: a router reading h_{t-1} reads the row before each.
  decode = np.concatenate([np.arange(len(h) + len(r["tokens"][0])) >= len(h) - 1
                           for h, r in zip(heads, ar_runs)])
  sched = bundle.plan_field(args.gamma, decay=True).ks  # the drafter's (the paper's) schedule
  M = bundle.clusters.num_clusters
  # Each DynaSpec method's k (the same router for every k).
  k_of = {m: METHODS[m][1](L).get("dynaspec", {}).get("k", bundle.k_max) for m in methods
          if "dynaspec" in m}
  ks = sorted({k for k in (2, 4, 8, 16, 32, 64) if k <= M} | set(sched) | set(k_of.values()))
  core_of = {m: CORE if "core" in m else 0 for m in k_of}
  recall = {k: recall_at(bundle.router, pairs, bundle.clusters, k, where=decode) for k in ks}
  recall_core = {k: recall_at(bundle.router, pairs, bundle.clusters, k, fr[CORE], where=decode)
                 for k in ks}
  recall_all = {k: recall_at(bundle.router, pairs, bundle.clusters, k) for k in ks}
  def scores_of(b):
    """A router's cluster scores at the positions it reads among those predicting outputs."""
    rows = pairs.usable(b.inputs)
    rows = rows[decode[rows]]
    return rows.size, np.asarray(b.router(jnp.asarray(pairs.features(rows, b.inputs))))
  scored = {reads: scores_of(b) for reads, b in bundles.items()}
  n_scored = scored[args.router_inputs][0]

  def real(k: int, core: int = 0, reads: str = args.router_inputs) -> float:
    """Mean real shortlist at k clusters along the outputs (the router reading `reads`):
    the core and its clusters' tokens outside it."""
    sizes = bundle.clusters.sizes(fr[CORE] if core else None)
    top = np.argsort(-scored[reads][1], 1)[:, :k]
    return core + float(np.mean(np.take(sizes, top).sum(1)))
  decays = {m: METHODS[m][1](L).get("dynaspec", {}).get("decay", True) for m in k_of}
  shorts = {m: float(np.mean([real(k, core_of[m], inputs_of(m))
                              for k in k_schedule(k, args.gamma, decays[m])]))
            for m, k in k_of.items()}  # each DynaSpec method's mean shortlist, as it drafts

  def kept(m: str) -> float | None:
    """A shortlist's M over the same draft's with the full head: `full-vocab`, or the
    composition's other part (None without a shortlist)."""
    parts = m.split("+")
    others = [p for p in parts if not p.startswith(("frspec", "dynaspec"))]
    if len(others) == len(parts):
      return None
    ref = others[0] if others else "full-vocab"
    return summary[m]["M"] / summary[ref]["M"] if m in summary and ref in summary else None
  step_rows = [[n, f"{t * 1e3:.2f}", f"{steps['full head'] / t:.2f}×"] for n, t in steps.items()]
  e2e_rows = [["AR", f"{summary[metrics.AR]['tokens_per_s']:.1f}", "1.00", "–", "–", "–",
               "–", "–"]]
  for m in methods:
    s = summary[m]
    short = ("full" if m in ("full-vocab", "knapspec", "8bit") else
             f"{int(m.split('-')[1].split('k')[0]) * 1024}" if m.startswith("frspec") else
             f"{shorts[m]:.0f} (mean)")
    e2e_rows.append([m, f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}", f"{s['M']:.2f}",
                     f"{s['alpha']:.2f}", "–" if kept(m) is None else f"{kept(m):.1%}",
                     short, s["mismatches"]])
  step_table = report.markdown_table(["draft head", "ms per draft step", "vs full head"],
                                     step_rows)
  e2e_table = report.markdown_table(
      ["method", "tok/s", "speedup", "M", "α", "M kept vs the full head", "shortlist",
       "mismatches"], e2e_rows)
  rec_table = report.markdown_table(
      ["k clusters", "padded shortlist", "mean real shortlist", "recall at the outputs",
       f"with the {CORE // 1024}k core (mean shortlist)", "recall over prompt and output"],
      [[k, k * bundle.clusters.capacity, f"{real(k):.0f}", f"{recall[k]:.3f}",
        f"{recall_core[k]:.3f} ({real(k, CORE):.0f})", f"{recall_all[k]:.3f}"] for k in ks])
  print(f"\n{step_table}\n\n{e2e_table}\n\n{rec_table}\n")
  found = verdicts(methods, summary, shorts)
  figures = dict(model=model.name, draft_step_ms={k: round(v * 1e3, 3) for k, v in steps.items()},
                 methods={m: {k: (round(v, 4) if isinstance(v, float) else v)
                              for k, v in s.items()} for m, s in summary.items()},
                 m_kept={m: kept(m) for m in methods}, router_recall=recall,
                 router_recall_with_core=recall_core, router_recall_all_positions=recall_all,
                 dynaspec_mean_shortlist=shorts, k_schedule=list(sched),
                 router_val_loss=curves.get("val_loss"),
                 mismatches=metrics.total_mismatches(summary),
                 verdicts=[v.to_json() for v in found])
  if args.write_docs:
    image = report.copy_image(folder / "curves.png", f"router_curves_{model.name}.png")
    body = "\n".join([
        f"## Vocabulary shortlists: FR-Spec and DynaSpec ({model.name})", "",
        f"{len(prompts)} Spec-Bench prompts ({args.per_category} per category of "
        f"{', '.join(cats)}), {args.max_new_tokens} new tokens, greedy, γ ≤ {args.gamma}. "
        f"FR-Spec counts from {args.train_prompts} training prompts (GSM8K train + "
        f"Spec-Bench prompts past the first {shortlists.RESERVED} of each category) and the "
        f"model's continuations of them. DynaSpec: {bundle.clusters.num_clusters} clusters "
        f"(capacity {bundle.clusters.capacity}), k per draft position {list(sched)}, a "
        f"router reading {ROUTER_INPUT[bundle.inputs]} distilled from the target's "
        f"distributions at {curves.get('pairs', '?')} positions of those sequences and "
        f"{args.router_prompts} training prompts (no continuation), the positions inside "
        f"the continuations weighted {curves.get('continuation_weight', 1.0):g}"
        + (f"; `dynaspec-ht`: a router reading {ROUTER_INPUT['hidden']}, trained on the "
           f"same text, at the same k" if "dynaspec-ht" in methods else "")
        + ". AR and every drafter in the same process. "
        f"Machine: {report.machine()}.", "",
        "Draft step (all layers; median of "
        f"{args.repeats}, γ = {args.gamma} steps per call):", "", step_table, "",
        "End to end (M kept: a shortlist's M over the same draft's with the full head, "
        "`full-vocab` or the composition's other part):", "", e2e_table, "",
        f"Router on the evaluation prompts (held out): recall of the target's top token at "
        f"the {n_scored} positions that predict AR's output tokens (what the "
        f"draft predicts), alone and with FR-Spec's {CORE} most frequent tokens always "
        f"scored (`dynaspec-core1k`), and over every prompt and output position (as earlier "
        f"runs of this script reported it):", "", rec_table, "",
        image, "", claims.section(found, note=(
            "the papers' own rows: DynaSpec at its defaults, FR-Spec at the sizes its "
            "paper reports; the other rows are our variants"))])
    report.write_section(f"vocab-{model.name}", body)
  report.print_json(figures)


if __name__ == "__main__":
  main()
