"""QuantSpec vs AR and vs sparse-KV drafts at growing context, and what the quantised KV
cache costs in memory.

Per context length and prompt, in one process: AR on a full-precision cache (the usual
baseline), AR on the quantised cache (the target QuantSpec verifies against: its greedy
tokens are what QuantSpec must reproduce), QuantSpec (4-bit KV + 4-bit MLP weights, or
8-bit weights), QuantSpec with 4-bit KV only, and the paper's rivals, sparse-KV
self-speculative drafts verified on the full-precision cache (`streaming_kv`:
StreamingLLM's sinks + recent window; `snapkv`: SnapKV's selection of the prompt + a
recent window), each reading the same number of slots. Reported: α, M, speedup vs
both ARs, mismatches vs each method's AR (must be 0) and whether the 8-bit-KV target
still equals the fp one.
Memory: bytes of the quantised cache (codes + scales, and the 2R buffer) vs a bf16 cache
at 4k/16k/32k tokens, from the shapes alone, and the whole footprint beside the
sparse-KV draft's (weights and caches: QuantSpec adds its 4-bit weight copy, the sparse
draft reads slices of the target's bf16 cache). On a CPU attention reads the quantised
slots from their codes with C++ kernels (`cpu_kernels.quant_attention`); elsewhere the jnp
path, which dequantises, is timed (the Pallas kernel is timed on a GPU by kernels_gpu.py).
The three runs on the quantised cache start from one prefill of it (at 16k tokens a CPU
prefill takes minutes; decoding excludes it anyway).
With --passes N every method decodes each prompt N times, the methods in turn, and the
pass of median speed is kept: single passes on a shared machine moved ratios by up to
1.7x. Results go to the shared results store prompt by prompt; --resume continues a
crashed run made with the same settings. The last output line is one JSON object with the
figures.

  python -m experiments.bench_quantspec --model smollm2-135m-instruct --contexts 1024,4096,8192
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from experiments import report
from specjax import (
  cpu_kernels,
  data,
  ops,
)
from specjax.bench import claims, harness, metrics
from specjax.bench.harness import Reference, RunSettings
from specjax.bench.results_store import ResultsStore
from specjax.drafters.factory import DrafterFactory
from specjax.kv_cache import KVCache
from specjax.models.loader import load_model
from specjax.quant_kv_cache import QuantKV, QuantKVCache

AR_FP, AR_Q = "ar", "ar_int8kv"
# The paper's draft: 4-bit weights over the hierarchical cache. `quantspec_w8` is our
# variant (8-bit weights, FIDELITY.md): in the table, judged by no claim of the paper.
PAPER_DRAFT = "quantspec_w4"
# The sparse-KV rivals, verified on the full-precision cache; QuantSpec must beat both.
SPARSE = ("streaming_kv", "snapkv")


def memory_rows(config, lengths=(4096, 16384, 32768), kv: QuantKV = QuantKV(),
                weight_bytes: int = 0, draft_weight_bytes: Mapping[str, int] | None = None
                ) -> list[dict]:
  """Cache bytes from shapes only (nothing allocated): bf16 vs quantised, buffer in bf16.
  `sparse_kv_saving[method]`: the sparse-KV draft's footprint over that QuantSpec's, each
  the target's weights (`weight_bytes`, bf16) and its caches: the sparse draft keeps none
  of its own (it reads the target's bf16 cache), QuantSpec keeps its hierarchical cache
  and its draft weights (`draft_weight_bytes[method]`)."""
  rows = []
  for n in lengths:
    full = jax.eval_shape(lambda: KVCache.create(_ctx(config, n), 1, n, jnp.bfloat16))
    quant = jax.eval_shape(lambda: QuantKVCache.create(
        _ctx(config, n), 1, n, group=kv.group, value_group=kv.value_group,
        residual=kv.residual, dtype=jnp.bfloat16))
    fp_b, q_b = tree_bytes(full), tree_bytes(quant)
    codes = tree_bytes((quant.k_codes, quant.v_codes))
    # A separate 4-bit draft cache beside an 8-bit target cache: its own upper codes and
    # group statistics (the recent-token buffer shared); the hierarchy stores them once.
    draft = tree_bytes([(h.upper, h.lo, h.scale) for h in (*quant.k_codes, *quant.v_codes)])
    rows.append(dict(tokens=n, bf16_bytes=fp_b, quant_bytes=q_b, codes_and_scales=codes,
                     ratio=q_b / fp_b, ratio_without_buffer=codes / fp_b,
                     separate_draft_saving=(q_b + draft) / q_b,
                     sparse_kv_saving={
                         m: (weight_bytes + fp_b) / (weight_bytes + b + q_b)
                         for m, b in (draft_weight_bytes or {}).items()}))
  return rows


def param_count(state) -> int:
  return sum(x.size for x in jax.tree.leaves(state))


def tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _ctx(config, n):
  """The config with a context of at least n (memory is computed beyond the model's)."""
  import dataclasses

  return dataclasses.replace(config, max_context=max(n, config.max_context))


def run(args) -> dict:
  store = ResultsStore(Path(args.out or f"runs/quantspec-{args.model}"), report.settings(args),
                       resume=args.resume)
  model = load_model(args.model, dtype=args.dtype)
  kv = QuantKV(group=args.group, residual=args.residual)
  drafters = {}
  for name, bits in (("quantspec_w4", 4), ("quantspec_w8", 8), ("quantspec_kv_only", 16)):
    options = {"quantspec": {"weight_bits": bits, "group": kv.group, "residual": kv.residual}}
    drafters[name] = DrafterFactory(model, gamma=args.gamma, options=options).make("quantspec")
  options = {"streaming_kv": {"sinks": args.sinks, "recent": args.recent},
             "snapkv": {"keep": args.snapkv_keep, "recent": args.snapkv_recent}}
  for name in SPARSE:
    drafters[name] = DrafterFactory(model, gamma=args.gamma, options=options).make(name)
  references = (Reference(AR_FP), Reference(AR_Q, kv))
  settings = RunSettings(max_new_tokens=args.max_new_tokens, gamma=args.gamma)
  work = []
  for n in args.contexts:
    if n + args.max_new_tokens + args.gamma + 1 > model.config.max_context:
      print(f"skipping {n}: beyond {model.name}'s context of {model.config.max_context}",
            file=sys.stderr)
      continue
    for p in data.long_context_prompts(model.tokenizer, n, args.prompts, args.data_dir):
      work.append((n, p))
  for n, p in tqdm(work, desc=f"quantspec {model.name}", unit="prompt"):
    unit = f"{n}/{p.id}"
    if store.done(unit):
      continue
    recs = harness.median_pass([
        harness.run_prompt(model, list(p.ids), drafters, settings, references=references,
                           tags=dict(context=n, prompt_id=p.id, category=str(n)))
        for _ in range(args.passes)])
    fp, q = recs[0], recs[1]
    q["matches_fp_ar"] = q["tokens"] == fp["tokens"]  # does the 8-bit cache change the target?
    store.add(unit, recs)
  return finish(model, args, kv, store.records(), draft_weight_bytes={
      m: tree_bytes(drafters[m].weights) for m in ("quantspec_w4", "quantspec_w8")})


def read_path() -> str:
  """How this run's attention read the quantised cache, for the section's prose."""
  if ops.quant_codes_on_cpu():
    return ("attention reads the quantised slots from their codes with C++ kernels "
            "(`ops.quant_attention`; the Pallas kernel is for GPUs)")
  return ("on the jnp path, where every step dequantises the whole cache before attending "
          "(the Pallas kernel, which reads the codes, is for GPUs)")


def weight_path() -> str:
  """How this run's quantised draft weights were read, for the section's prose."""
  ready = [k for k in ("int4_matmul", "int8_matmul") if cpu_kernels.runs_here(k)]
  if len(ready) == 2:
    return "the 4- and 8-bit matmuls read their codes with C++ kernels (`cpu_kernels`)"
  return (f"C++ kernels: {', '.join(ready) or 'none'}; the other quantised matrices are "
          f"dequantised inside each jitted step")


def int8_vs_fp(figures: dict) -> str:
  """The int8-KV AR's speed as a multiple of the fp AR's, over the contexts measured."""
  ratios = sorted(f["int8kv_ar_vs_fp_ar"] for f in figures.values())
  return f"{ratios[0]:.2f}×" if len(ratios) == 1 else f"{ratios[0]:.2f}–{ratios[-1]:.2f}×"


def sparse_rival(figures: Mapping[str, Mapping]) -> dict[int, float]:
  """Context -> the faster sparse-KV draft's speedup over the fp AR, at the contexts where
  every one of `SPARSE` ran (a comparison with rivals needs them all), each without its
  selection time: the rivals' benefit of the doubt."""
  return {int(n): max(f[m]["speedup_without_selection"] for m in SPARSE)
          for n, f in figures.items() if all(m in f for m in SPARSE)}


def verdicts(figures: Mapping[str, Mapping], mem: list[dict]) -> list[claims.Verdict]:
  """The paper's claim against the paper's draft (`PAPER_DRAFT`) alone, with its memory
  priced at the longest context of `mem`, where the claim's regime is deepest."""
  m = PAPER_DRAFT
  if not any(m in f for f in figures.values()):
    return []
  return [claims.quantspec_long_context(
      {int(n): {"alpha": f[m]["alpha"], "speedup": f[m]["speedup_vs_fp_ar"]}
       for n, f in figures.items() if m in f},
      sparse_kv_saving=mem[-1]["sparse_kv_saving"].get(m), method=m,
      sparse_kv=sparse_rival(figures))]


def finish(model, args, kv: QuantKV, records: list[dict],
           draft_weight_bytes: Mapping[str, int] | None = None) -> dict:
  runs = records
  contexts = sorted({r["context"] for r in runs})
  header = ["context", "method", "tok/s", "speedup vs fp AR", "speedup vs int8-KV AR", "M",
            "α", "selection share", "mismatches vs its AR"]
  rows, figures = [], {}
  for n in contexts:
    rs = [r for r in runs if r["context"] == n]
    s = metrics.summarize([dict(r, method=metrics.AR if r["method"] == AR_FP else r["method"])
                           for r in rs], references=(metrics.AR, AR_Q))
    q_tps = s[AR_Q]["tokens_per_s"]
    same = sum(r.get("matches_fp_ar", False) for r in rs if r["method"] == AR_Q)
    prompts = sum(r["method"] == AR_Q for r in rs)
    figures[str(n)] = {"int8kv_target_equals_fp_target": f"{same}/{prompts}",
                       "int8kv_ar_vs_fp_ar": s[AR_Q]["speedup"]}
    rows.append([n, "AR (bf16/fp32 KV)", round(s[metrics.AR]["tokens_per_s"], 1), "1.00", "–",
                 "–", "–", "–", "–"])
    rows.append([n, "AR (int8 KV)", round(q_tps, 1), f"{s[AR_Q]['speedup']:.2f}", "1.00", "–",
                 "–", "–", "–"])
    for m in ("quantspec_w4", "quantspec_w8", "quantspec_kv_only", *SPARSE):
      if m in s:
        rows.append([n, m, round(s[m]["tokens_per_s"], 1), f"{s[m]['speedup']:.2f}",
                     f"{s[m]['tokens_per_s'] / q_tps:.2f}", f"{s[m]['M']:.2f}",
                     f"{s[m]['alpha']:.3f}", f"{s[m]['selection_share']:.0%}",
                     s[m]["mismatches"]])
        figures[str(n)][m] = {"speedup_vs_fp_ar": s[m]["speedup"],
                              "speedup_vs_int8_ar": s[m]["tokens_per_s"] / q_tps,
                              # decoding alone: `snapkv` selects once per prompt, which
                              # SnapKV does inside the prefill
                              "speedup_without_selection":
                                  s[m]["speedup"] / (1.0 - s[m]["selection_share"]),
                              "M": s[m]["M"], "alpha": s[m]["alpha"],
                              "mismatches": s[m]["mismatches"]}
  table = report.markdown_table(header, rows)
  mem = memory_rows(model.config, kv=kv, weight_bytes=2 * param_count(model.state),
                    draft_weight_bytes=draft_weight_bytes)
  mem_table = report.markdown_table(
      ["tokens", "bf16 cache", "quantised cache (codes + scales + 2R bf16 buffer)", "ratio",
       "ratio without the buffer", "separate 4-bit draft cache ÷ shared",
       "sparse-KV draft's footprint ÷ QuantSpec's (w4 / w8)"],
      [[m["tokens"], f"{m['bf16_bytes'] / 2**20:.1f} MiB", f"{m['quant_bytes'] / 2**20:.1f} MiB",
        f"{m['ratio']:.3f}", f"{m['ratio_without_buffer']:.3f}",
        f"{m['separate_draft_saving']:.2f}",
        " / ".join(f"{v:.2f}" for v in m["sparse_kv_saving"].values())] for m in mem])
  print(f"\n{table}\n\n{mem_table}\n")
  mismatches = sum(f[m]["mismatches"] for f in figures.values() for m in f
                   if isinstance(f[m], dict))
  found = verdicts(figures, mem)
  out = {"model": model.name, "contexts": figures, "memory": mem, "mismatches": mismatches,
         "verdicts": [v.to_json() for v in found]}
  if args.write_docs:
    report.write_section(f"quantspec-{model.name}", "\n".join([
        f"## QuantSpec: 4-bit draft over the hierarchical KV cache ({model.name})", "",
        f"Long prompts built from Spec-Bench documents ({args.prompts} per length), "
        + (f"{args.passes} passes of every method in turn, each method's median kept, "
           if args.passes > 1 else "")
        + f"{args.max_new_tokens} new tokens, greedy, γ = {args.gamma} (no early stop, as in "
        f"QuantSpec); key groups G = {kv.group} tokens, value groups min(G, head_dim) "
        f"channels, buffer 2R = {2 * kv.residual} tokens flushed R at a time during "
        f"decoding, before a step reads it, once it holds more than 2R − {kv.max_step} "
        f"(the flush schedule depends on the committed length only, so AR and QuantSpec "
        f"verify against the same target). Draft weights: `quantspec_w4` the paper's 4-bit "
        f"MLP weights (groups of 128 rows), `quantspec_w8` 8-bit weights for every matmul "
        f"and the LM head (one scale per output channel; our variant, which no verdict "
        f"judges by the paper's claim), `quantspec_kv_only` the target's "
        f"own; {weight_path()}. The sparse-KV rivals, the target's own weights over part "
        f"of the full-precision cache, lossless against the fp AR: `streaming_kv` attends "
        f"to {args.sinks} sink and {args.recent} recent slots, `snapkv` to the "
        f"{args.snapkv_keep} prompt slots per kv head that SnapKV's observation window "
        f"attended to most and {args.snapkv_recent} recent ones. `snapkv` selects once per "
        f"prompt, recomputing the window's queries in one forward (SnapKV reads them off "
        f"the prefill; `selection share` is that time over its decode time), so the "
        f"verdict holds QuantSpec against the faster of the two at each context, each "
        f"without its selection time. All methods in the same "
        f"process; {read_path()}. QuantSpec is lossless with respect to the "
        f"target on the 8-bit cache: `mismatches` counts prompts whose tokens differ from "
        f"that AR. Contexts are prompt lengths; lengths that do not fit the model's window "
        f"of {model.config.max_context} tokens with the generation are not run. The int8-KV "
        f"AR runs at {int8_vs_fp(figures)} the fp AR's speed here, and QuantSpec is "
        f"compared with both. Machine: {report.machine()}.", "", table,
        "",
        "Does reading K/V at 8 bits change the target's greedy output? Prompts where the "
        "int8-KV AR equals the full-precision AR: " + ", ".join(
            f"{n}: {f['int8kv_target_equals_fp_target']}" for n, f in figures.items()) + ".",
        "", "Memory of the KV cache for one sequence (shapes only; bf16 baseline; "
        "`separate` prices the alternative to the hierarchy: an 8-bit target cache beside "
        "a separate 4-bit draft cache with its own group statistics; the last column is "
        "the whole footprint, bf16 weights included, of the sparse-KV draft over "
        "QuantSpec's with its 4- or 8-bit weight copy; `streaming_kv`'s, the smaller: "
        "`snapkv` also keeps a copy of its selected rows):", "", mem_table, "",
        claims.section(found, note=f"speedups over the fp AR; memory at "
                       f"{mem[-1]['tokens']} tokens")]))
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--contexts", default="1024,4096,8192,16384")
  p.add_argument("--prompts", type=int, default=1, help="long prompts per context length")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--gamma", type=int, default=4)
  p.add_argument("--group", type=int, default=128)
  p.add_argument("--residual", type=int, default=128)
  p.add_argument("--sinks", type=int, default=4, help="the sparse-KV draft's sink slots")
  p.add_argument("--recent", type=int, default=508,
                 help="the sparse-KV draft's recent window (with the sinks, its budget)")
  p.add_argument("--snapkv-keep", type=int, default=448,
                 help="the SnapKV draft's selected prompt slots per kv head")
  p.add_argument("--snapkv-recent", type=int, default=64,
                 help="its recent slots (SnapKV's observation window and the newest tokens)")
  p.add_argument("--passes", type=int, default=1,
                 help="passes of every method over each prompt, the median kept")
  p.add_argument("--data-dir")
  report.common_args(p)
  args = p.parse_args(argv)
  args.contexts = [int(n) for n in args.contexts.split(",") if n]
  report.print_json(run(args))


if __name__ == "__main__":
  main()
