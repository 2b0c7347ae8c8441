"""`specjax` command line: models, generate, bench, sweep, profile, router, knn, data."""

from __future__ import annotations

import argparse
import json
import sys

from specjax.errors import ConfigError, SpecjaxError
from specjax.models.registry import DEFAULT_MODEL, MODELS


def _cmd_models(args: argparse.Namespace) -> int:
  from specjax.models.hf_config import SUPPORTED
  from specjax.models.registry import is_installed
  from specjax.models.source import SOURCES

  print("--model takes " + "; ".join(SOURCES) + ".")
  print(f"Checkpoint architectures: {SUPPORTED}. GGUF: llama, qwen2, qwen3, gemma3.")
  print("A hub id may name a revision (org/name@rev); HF_HOME, HF_TOKEN and HF_HUB_OFFLINE "
        "apply.\n")
  rows = [("name", "arch", "installed", "get it with")]
  for spec in MODELS.values():
    rows.append((
        spec.name,
        spec.arch,
        "yes" if is_installed(spec) else "no",
        spec.install or "(built in: random init)",
    ))
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  for r in rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
  return 0


def _cmd_generate(args: argparse.Namespace) -> int:
  from specjax.decode.generate import TextStream, generate
  from specjax.drafters import names
  from specjax.models.loader import load_model
  from specjax.sampling import SamplingParams

  sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
  if not args.prompt.strip():
    raise ConfigError("the prompt is empty")
  options = names.parse_options(args.option)
  if args.drafter:
    names.parse(args.drafter)  # bad names and options fail before the model loads
    names.check_options(options)
  model = load_model(args.model, dtype=args.dtype, tensor_parallel=args.tensor_parallel)
  tok = model.tokenizer
  ids = tok.encode_prompt(args.prompt, chat=False if args.no_chat else None)
  stream = TextStream(lambda ids: tok.decode(ids, skip_special=True))
  on_token = None
  if not args.quiet:
    on_token = lambda t: print(stream.push(t), end="", flush=True)
  kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
  if args.drafter:
    return _speculate(args, model, ids, on_token, kw, options)
  result = generate(model.graphdef, model.state, model.config, ids, on_token=on_token, **kw)
  if not args.quiet:
    print()
  stats = {
      "model": args.model,
      "prompt_tokens": len(ids),
      "new_tokens": len(result.tokens),
      "compile_s": round(result.compile_s, 3),
      "prefill_s": round(result.prefill_s, 4),
      "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
      "stopped_on_eos": result.stopped_on_eos,
  }
  print(
      f"[{stats['new_tokens']} tokens, compile {result.compile_s:.1f} s, "
      f"prefill {result.prefill_s:.2f} s, "
      f"decode {stats['decode_tokens_per_s']:.1f} tok/s]",
      file=sys.stderr,
  )
  if args.json:
    print(json.dumps(stats))
  return 0


def _speculate(args: argparse.Namespace, model, ids: list[int], on_token, kw: dict,
               options: dict) -> int:
  """`generate --drafter`: self-speculate the prompt (streamed), then AR on the same
  prompt for the speedup and the losslessness check (unless --no-compare). Both are
  compiled on a warm-up prompt first, so the rates are decoding alone."""
  from specjax.decode.engine import speculative_generate
  from specjax.decode.generate import generate
  from specjax.drafters.factory import DrafterFactory

  factory = DrafterFactory(model, gamma=args.gamma, seed=args.seed,
                                           options=options,
                                           data_dir=args.data_dir)
  drafter = factory.make(args.drafter)
  g, s, c = model.graphdef, model.state, model.config
  ssd = lambda prompt, **extra: speculative_generate(g, s, c, prompt, drafter, gamma=args.gamma,
                                                     threshold=args.threshold, **kw, **extra)
  warm = model.tokenizer.encode_prompt("Warm up.")
  ssd(warm)
  out = ssd(ids, on_token=on_token)
  if on_token:
    print()
  stats = {"model": model.name, "drafter": args.drafter, "prompt_tokens": len(ids),
           "new_tokens": len(out.tokens), "rounds": out.rounds,
           "M": round(out.mean_accepted, 3), "alpha": round(out.acceptance_rate, 3),
           "tokens_per_s": round(out.decode_tokens_per_s, 2)}
  if (chosen := drafter.selections(out.drafter_state)) is not None:
    stats["selections"] = chosen  # plans chosen as it decoded (CLaSp's, KnapSpec's DPs)
  line = (f"[{args.drafter}: {stats['new_tokens']} tokens, M {out.mean_accepted:.2f}, "
          f"α {out.acceptance_rate:.2f}, {out.decode_tokens_per_s:.1f} tok/s")
  if not args.no_compare:
    generate(g, s, c, warm, **kw)
    ar = generate(g, s, c, ids, **kw)
    speedup = out.decode_tokens_per_s / ar.decode_tokens_per_s if ar.decode_s else None
    same = out.tokens == ar.tokens if kw["sampling"].greedy else None
    stats |= {"ar_tokens_per_s": round(ar.decode_tokens_per_s, 2),
              "speedup": speedup and round(speedup, 3), "matches_ar": same}
    line += (f"; AR {ar.decode_tokens_per_s:.1f} tok/s: {speedup:.2f}× speedup"
             + ("" if same is None else ", same tokens as AR" if same else
                ", TOKENS DIFFER FROM AR"))
  print(line + "]", file=sys.stderr)
  if args.json:
    print(json.dumps(stats))
  return 0 if stats.get("matches_ar") is not False else 1


def _cmd_bench(args: argparse.Namespace) -> int:
  from pathlib import Path

  from specjax import data
  from specjax.bench import runner as bench
  from specjax.drafters.names import parse_options

  drafters = tuple(d for d in args.drafters.split(",") if d)
  cats = tuple(c for c in args.categories.split(",") if c) or data.SPEC_BENCH_CATEGORIES
  cfg = bench.BenchConfig(
      model=args.model, drafters=drafters, per_category=args.per_category, categories=cats,
      max_new_tokens=args.max_new_tokens, max_turns=args.max_turns, gamma=args.gamma,
      threshold=args.threshold, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
      search_iterations=args.search_iterations, plan_file=args.plan, dtype=args.dtype,
      auto_gamma=args.auto_gamma, options=parse_options(args.option), llama_cpp=args.llama_cpp,
      tensor_parallel=args.tensor_parallel,
  )
  out = Path(args.out or f"runs/bench-{args.model}")
  figures = bench.run(cfg, out, data_dir=args.data_dir, resume=args.resume,
                      write_docs=args.write_docs, docs_section=args.docs_section,
                      spec_bench_out=args.specbench_out)
  print(json.dumps(figures, sort_keys=True))
  return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
  from pathlib import Path

  from specjax.bench import sweep

  spec = sweep.load(args.file)
  out = Path(args.out or f"runs/sweep-{spec.name}")
  command = f"specjax sweep {args.file}" + (f" --out {args.out}" if args.out else "")
  figures = sweep.run(spec, out, data_dir=args.data_dir, resume=args.resume,
                      write_docs=args.write_docs, command=command + " --write-docs")
  print(json.dumps(figures, sort_keys=True))
  return 0


def _cmd_profile(args: argparse.Namespace) -> int:
  from specjax.models.loader import load_model
  from specjax.selection import profiler

  lengths = tuple(int(n) for n in args.lengths.split(",") if n)
  profiler.check_lengths(lengths, args.gamma, args.loop_steps)  # before loading the model
  model = load_model(args.model, dtype=args.dtype, tensor_parallel=args.tensor_parallel)
  weights = None
  if args.draft_weights != "target":
    from specjax.offline.artefacts import ArtefactStore

    weights = ArtefactStore(model, verbose=False).draft_weights(args.draft_weights)
  prof = profiler.measure(model, lengths=lengths, gamma=args.gamma, repeats=args.repeats,
                          draft_weights=weights, loop_steps=args.loop_steps)
  path = profiler.save_profile(prof, args.out)
  print(profiler.table(prof))
  print(f"t_attn(n) = {prof.t_attn(1) - prof.t_attn(0):.3e}·n + {prof.t_attn(0):.3e} s, "
        f"t_mlp = {prof.t_mlp():.3e} s ({prof.timing}); saved to {path}", file=sys.stderr)
  # The whole profile, loadable as it is (`LatencyProfile.from_json` ignores "path"): a
  # lent machine's run leaves its profile in its log for the next run to reuse.
  print(json.dumps({**prof.to_json(), "path": str(path)}))
  return 0


def _cmd_router_train(args: argparse.Namespace) -> int:
  from pathlib import Path

  from specjax.models.loader import load_model
  from specjax.offline import shortlists

  if not 1 <= args.k_max <= args.clusters:
    raise ConfigError(f"--k-max must be in 1..--clusters ({args.clusters}), got {args.k_max}")
  model = load_model(args.model, tensor_parallel=args.tensor_parallel)
  out = Path(args.out or shortlists.folder(model, args.clusters, args.inputs))
  counts, bundle, curves = shortlists.build(
      model, out, prompts=args.prompts, new_tokens=args.new_tokens,
      router_prompts=args.router_prompts, clusters=args.clusters, k_max=args.k_max,
      hidden=args.hidden, inputs=args.inputs, epochs=args.epochs, decay=args.decay,
      continuation_weight=args.continuation_weight, keep_pairs=args.keep_pairs,
      data_dir=args.data_dir)
  sizes = bundle.clusters.sizes()
  print(f"router for {model.name} in {out / 'router'} (curves: {out / 'curves.png'}); "
        f"{bundle.clusters.num_clusters} clusters of {sizes.min()}..{sizes.max()} tokens",
        file=sys.stderr)
  print(json.dumps({"model": model.name, "out": str(out), "clusters": int(sizes.size),
                    "capacity": bundle.clusters.capacity, "k_max": bundle.k_max,
                    "val_loss": curves.get("val_loss"), "val_recall": curves.get("val_recall"),
                    "counted_tokens": int(counts.sum())}))
  return 0


def _cmd_knn_build(args: argparse.Namespace) -> int:
  from pathlib import Path

  from specjax.drafters import SelfSDDrafter
  from specjax.models.loader import load_model
  from specjax.offline import knn_build

  build, _ = knn_build.domain_prompts(args.data_dir, knn_build.domain_names(args.domains))
  model = load_model(args.model, tensor_parallel=args.tensor_parallel)
  build = {d: ps[: args.prompts_per_domain] for d, ps in build.items()}
  out = Path(args.out) if args.out else None
  lib = knn_build.build(model, build, out, anchors=args.anchors,
                        search_prompts=args.search_prompts, iterations=args.iterations,
                        gamma=args.gamma, seed=args.seed, objective=args.objective,
                        drafter_of=SelfSDDrafter)
  print(knn_build.summary_table(lib))
  print(json.dumps({"model": lib.model, "out": str(out or knn_build.default_dir(lib.model)),
                    "domains": {d: {"anchors": int((lib.anchor_domain == i).sum()),
                                    "skipped": int((~lib.attn[i]).sum() + (~lib.mlp[i]).sum()),
                                    "alpha": lib.meta[d].get("alpha")}
                                for i, d in enumerate(lib.domains)}}))
  return 0


def _cmd_data_fetch(args: argparse.Namespace) -> int:
  from specjax import data

  path = data.fetch_spec_bench(args.data_dir)
  print(f"Spec-Bench saved to {path}")
  return 0


def _option_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument("--option", action="append", metavar="DRAFTER.OPTION=VALUE",
                 help="a drafter's option, repeatable (knapspec.tau=0.3, frspec.size=16384, "
                 "quantspec.weight_bits=4); see specjax.drafters.names")


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
  from specjax.models.loader import DTYPE_CHOICES

  p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                 help="weights, activations and KV cache (auto: bfloat16 on a GPU, float32 on "
                      "a CPU); mixed: bfloat16 weights computed in float32, where greedy SSD "
                      "stays token-exact with AR on real models; gguf: the GGUF file's own "
                      "4-8-bit blocks, dequantised in registers to its float32 weights "
                      "(CPU only)")


def _model_arg(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=DEFAULT_MODEL,
                 help="a registered name (`specjax models`), a .gguf file, a Hugging Face "
                 "checkpoint folder or a hub id org/name[@revision] (default: %(default)s)")
  p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                 help="split the model over N devices (a mesh; on a CPU, fake them with "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=N)")


def build_parser() -> argparse.ArgumentParser:
  from specjax.bench.runner import DEFAULT_DRAFTERS
  from specjax.drafters.names import BASES, OVERLAYS

  parser = argparse.ArgumentParser(
      prog="specjax", description="Self-speculative decoding in JAX/Flax."
  )
  sub = parser.add_subparsers(dest="command", required=True)

  p = sub.add_parser("models", help="list the models and how to install their weights")
  p.set_defaults(func=_cmd_models)

  p = sub.add_parser("generate", help="autoregressive generation, streamed")
  _model_arg(p)
  p.add_argument("--prompt", required=True)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  p.add_argument("--quiet", action="store_true", help="do not stream the text")
  p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
  p.add_argument("--drafter", help="self-speculate with this drafter (any `specjax bench` "
                 "name, e.g. knapspec or self_sd+8bit) and report M, α and the speedup over AR")
  p.add_argument("--gamma", type=int, default=4, help="with --drafter: maximum draft length")
  p.add_argument("--threshold", type=float, default=None,
                 help="with --drafter: draft early-stop top-1 prob (default: the drafter's)")
  p.add_argument("--no-compare", action="store_true",
                 help="with --drafter: do not run AR on the prompt for the comparison")
  _option_arg(p)
  p.add_argument("--data-dir", help="with --drafter: prompts for a drafter's offline build "
                 "(Self-SD search, KNN library, router)")
  add_dtype_arg(p)
  p.set_defaults(func=_cmd_generate)

  p = sub.add_parser("bench", help="AR vs every drafter on a Spec-Bench subset")
  _model_arg(p)
  p.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS),
                 help="comma-separated; layer drafters: " + ", ".join(BASES) + "; overlays "
                 "(alone: over the full model, or after a layer drafter with '+'): "
                 + ", ".join(OVERLAYS) + " (e.g. knapspec+8bit+dynaspec)")
  _option_arg(p)
  p.add_argument("--plan", help="plan file for the static drafter")
  p.add_argument("--llama-cpp", action="store_true",
                 help="also decode every prompt with llama.cpp on the same GGUF file, greedy, "
                 "in the same process: a baseline row (pip install llama-cpp-python)")
  p.add_argument("--categories", default="", help="comma-separated; default all 13")
  p.add_argument("--per-category", type=int, default=1,
                 help="prompts per category (13 categories); 1 takes ~10 min on 2 CPU cores")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--max-turns", type=int, default=1, help="MT-bench prompts have 2 turns")
  p.add_argument("--gamma", type=int, default=4, help="maximum draft length")
  p.add_argument("--auto-gamma", action="store_true",
                 help="per drafter, the γ <= --gamma and early-stop threshold (unless --threshold "
                 "is given) of highest tokens per time, replaying its rounds on four held-out "
                 "pilot prompts (one per category, spread over the set) "
                 "with its draft/verify costs measured here (the threshold alone for drafters "
                 "that pick their own γ, as KnapSpec)")
  p.add_argument("--threshold", type=float, default=None,
                 help="draft early-stop top-1 prob (default: each drafter's, 0.8 / KnapSpec 0.7)")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--search-iterations", type=int, default=60, help="self_sd BO iterations")
  p.add_argument("--data-dir", help="folder holding spec_bench/question.jsonl "
                 "(default $SPECJAX_DATA_DIR or ~/.cache/specjax/data)")
  p.add_argument("--out", help="output folder (default runs/bench-MODEL)")
  p.add_argument("--resume", action="store_true", help="continue an interrupted run")
  p.add_argument("--write-docs", action="store_true",
                 help="put this run on docs/results/spec-bench.md (the leaderboard) and "
                 "regenerate this model's section of docs/results/spec-bench-runs.md")
  p.add_argument("--docs-section", help="with --write-docs: the section to write (default "
                 "bench-MODEL, or bench-MODEL-DTYPE; name another to keep this run's "
                 "per-category tables beside the default one)")
  p.add_argument("--specbench-out", metavar="DIR",
                 help="also write each method's answers as Spec-Bench model-answer JSON lines "
                 "in DIR, for its evaluation/speed.py (AR's file is the baseline) and equal.py")
  add_dtype_arg(p)
  p.set_defaults(func=_cmd_bench)

  p = sub.add_parser("sweep", help="an ablation grid from a sweep file (TOML; see "
                     "experiments/sweeps/), resumable, with a table and plots")
  p.add_argument("file", help="sweep file, e.g. experiments/sweeps/clasp.toml")
  p.add_argument("--data-dir", help="folder holding spec_bench/question.jsonl")
  p.add_argument("--out", help="output folder (default runs/sweep-NAME)")
  p.add_argument("--resume", action="store_true", help="continue an interrupted sweep")
  p.add_argument("--write-docs", action="store_true",
                 help="write the table and plots to docs/results/sweeps.md")
  p.set_defaults(func=_cmd_sweep)

  p = sub.add_parser("profile", help="time attention / MLP sub-layers and verification "
                     "at several context lengths (KnapSpec reads it)")
  _model_arg(p)
  p.add_argument("--lengths", default="256,1024,2048,4096", help="cache sizes to time")
  p.add_argument("--gamma", type=int, default=4, help="verification is timed on γ+1 tokens")
  p.add_argument("--repeats", type=int, default=7, help="timed repeats per point (median)")
  p.add_argument("--loop-steps", type=int, default=None,
                 help="steps chained per timed jitted loop, as the device loop runs them "
                 "(default 16, draft_length.LOOP_STEPS); 0 times each step as a call from the "
                 "host, as the host loop runs them")
  p.add_argument("--out", help="profile file (default: the specjax cache, per model/device)")
  p.add_argument("--draft-weights", choices=("target", "int8", "int4", "q4_0"),
                 default="target",
                 help="the weights the timed draft steps read: int8 prices sub-layers for "
                 "knapspec+8bit (and knapspec+quantspec at 8 weight bits), int4 for "
                 "knapspec+quantspec at QuantSpec's 4-bit weights, q4_0 for knapspec+4bit "
                 "(CPU only)")
  add_dtype_arg(p)
  p.set_defaults(func=_cmd_profile)

  p = sub.add_parser("router", help="DynaSpec router / FR-Spec counts")
  router_sub = p.add_subparsers(dest="router_command", required=True)
  q = router_sub.add_parser("train", help="token counts, clusters and router from training "
                            "prompts (never the evaluation ones)")
  _model_arg(q)
  q.add_argument("--prompts", type=int, default=48, help="training prompts (FR-Spec counts)")
  q.add_argument("--new-tokens", type=int, default=48, help="own continuation per prompt")
  q.add_argument("--router-prompts", type=int, default=320,
                 help="training prompts the router reads (no continuation needed)")
  q.add_argument("--clusters", type=int, default=1024, help="M token clusters")
  q.add_argument("--k-max", type=int, default=16, help="clusters per shortlist")
  q.add_argument("--decay", action="store_true",
                 help="save the paper's k schedule (k_max for two positions, then shrinking) "
                 "as the bundle's own; the dynaspec drafter uses it whatever the bundle says "
                 "(--option dynaspec.decay=false: flat k)")
  q.add_argument("--hidden", type=int, default=1024, help="router MLP width")
  q.add_argument("--inputs", choices=("embed_prev", "hidden"), default="embed_prev",  # INPUTS
                 help="what the router reads: embed_prev, the paper's [E(x_t), h_{t-1}] "
                 "(default), or hidden, the draft step's own h_t (our variant; "
                 "--option dynaspec.inputs=hidden decodes with it)")
  q.add_argument("--epochs", type=int, default=10)
  q.add_argument("--continuation-weight", type=float, default=1.0,
                 help="loss weight of positions inside the model's own continuations (what "
                 "a draft predicts) against prompt text's 1")
  q.add_argument("--keep-pairs", action="store_true",
                 help="keep the training pairs (for experiments/router_ablation.py)")
  q.add_argument("--data-dir")
  q.add_argument("--out", help="folder (default: the specjax cache, per model)")
  q.set_defaults(func=_cmd_router_train)

  p = sub.add_parser("knn", help="KNN-SSD skip library")
  knn_sub = p.add_subparsers(dest="knn_command", required=True)
  q = knn_sub.add_parser("build", help="anchors (k-means) and a Self-SD skip set per domain, "
                         "from the domains' build prompts (never the held-out ones)")
  _model_arg(q)
  q.add_argument("--domains", help="comma-separated: Spec-Bench categories, mt_bench, gsm8k "
                 "(default: summarization,math_reasoning,translation,qa,rag, the nearest to "
                 "the paper's five)")
  q.add_argument("--prompts-per-domain", type=int, default=40, help="prompts embedded")
  q.add_argument("--anchors", type=int, default=10, help="k-means anchors per domain")
  q.add_argument("--search-prompts", type=int, default=8,
                 help="representative prompts the Self-SD search scores on")
  q.add_argument("--iterations", type=int, default=120, help="Self-SD search iterations")
  q.add_argument("--objective", default="measured", choices=("measured", "predicted"),
                 help="what scores a skip set: its measured speedup decoding the search "
                 "prompts (the paper's), or the predicted one (agreement x a byte cost model)")
  q.add_argument("--gamma", type=int, default=4)
  q.add_argument("--seed", type=int, default=0)
  q.add_argument("--data-dir")
  q.add_argument("--out", help="library folder (default: the specjax cache, per model)")
  q.set_defaults(func=_cmd_knn_build)

  p = sub.add_parser("data", help="prompt sets")
  data_sub = p.add_subparsers(dest="data_command", required=True)
  q = data_sub.add_parser("fetch", help="download Spec-Bench (needs network)")
  q.add_argument("--data-dir")
  q.set_defaults(func=_cmd_data_fetch)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  from specjax import compile_cache

  compile_cache.enable()  # before the first compile: jax decides then, once
  try:
    return args.func(args)
  except SpecjaxError as err:  # the user's to fix: the message says how; anything else is a bug
    print(f"specjax: error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
