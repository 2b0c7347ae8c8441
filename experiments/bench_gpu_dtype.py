"""What `--dtype mixed` costs against bf16 on a GPU, and which draft weight bits pay in each.

    python -m experiments.bench_gpu_dtype --models shape:smollm2-135m,shape:llama-8b

`auto` is bf16 on a GPU: half the bytes of float32, but a verification forward's γ + 1 rows
round differently from the AR step's one row, and bf16 activations carry that difference
into the tokens (docs/BENCHMARKS.md: on an H100, 6 and 7 of 12 Spec-Bench prompts left
AR's tokens). `mixed` keeps the bf16 weights and computes in float32 (float32 KV cache,
HIGHEST-precision dots), which is token-exact. Whether `auto` should be `mixed` on a GPU
depends on what that costs, which is what this measures, per model and dtype, in one
process: the AR step and verification of γ + 1 = 5 tokens inside one jitted loop
(`step_times(loop=)`: device time, no host dispatch), draft steps with every sub-layer on
reading 8-bit weights (every matmul and the LM head) or QuantSpec's 4-bit MLP weights, and
greedy AR decoding (`generate`, the on-device loop).
`shape:` models are random-init at a real model's shapes (`bench_gpu.SHAPES`). Each
model's figures are appended to `--out` as they finish; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from experiments import report
from experiments.bench_gpu import Model, draft_plans
from specjax.decode.draft_length import step_times
from specjax.decode.generate import generate, precision_name

DTYPES = ("bfloat16", "mixed")


def quantised_plans(m: Model) -> dict:
  """{name: [frozen plan]}: bench_gpu's drafts with every sub-layer on, reading 8-bit or
  4-bit-MLP weights."""
  plans, _ = draft_plans(m)
  return {k: plans[k] for k in ("8-bit", "4-bit MLP")}


def measure(name: str, dtype: str, args) -> dict:
  t0 = time.perf_counter()
  m = Model(name, dtype)
  jax.block_until_ready(m.state)
  t = step_times(m.graphdef, m.state, m.config, quantised_plans(m), gammas=(4,),
                 context=args.context, repeats=args.repeats, loop=args.loop_steps)
  gens = [generate(m.graphdef, m.state, m.config, m.ids, max_new_tokens=args.tokens,
                   eos_ids=()) for _ in range(args.runs + 1)][1:]  # the first compiles
  return {"model": name, "dtype": precision_name(m.config, m.state), "context": args.context,
          "loop_ar_ms": t.ar * 1e3, "loop_verify_over_ar": t.verify[4] / t.ar,
          "loop_draft_over_ar": {k: v / t.ar for k, v in t.drafts.items()},
          "loop_steps": args.loop_steps,
          "decode_tok_s": float(np.median([g.decode_tokens_per_s for g in gens])),
          "seconds": time.perf_counter() - t0}


def table(rows: list[dict]) -> str:
  """One row per model and dtype; mixed's AR step and decode speed also ÷ bf16's."""
  bf16 = {r["model"]: r for r in rows if r["dtype"] == "bfloat16"}
  lines = []
  for r in rows:
    base = bf16.get(r["model"])
    lines.append([r["model"], r["dtype"], f"{r['loop_ar_ms']:.3f}",
                  f"{r['loop_ar_ms'] / base['loop_ar_ms']:.2f}" if base else "–",
                  f"{r['loop_verify_over_ar']:.3f}",
                  *(f"{r['loop_draft_over_ar'][k]:.3f}" for k in ("8-bit", "4-bit MLP")),
                  f"{r['decode_tok_s']:.1f}",
                  f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}" if base else "–"])
  return report.markdown_table(
      ["model", "dtype", "AR step in the loop (ms)", "÷ bf16", "verify γ+1=5 ÷ AR",
       "8-bit draft ÷ AR", "4-bit MLP draft ÷ AR", "decode tok/s", "÷ bf16"], lines)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="shape:smollm2-135m,shape:llama-8b")
  ap.add_argument("--dtypes", default=",".join(DTYPES))
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--loop-steps", type=int, default=32)
  ap.add_argument("--tokens", type=int, default=128)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--out", type=Path, help="append each row's JSON line here")
  args = ap.parse_args()

  # a copy of the tree without .git (a lent GPU machine) names its commit in the environment
  machine = report.machine()
  commit = report.git_revision() or "unknown"
  rows = []
  for name in args.models.split(","):
    for dtype in args.dtypes.split(","):
      rows.append(measure(name, dtype, args) | {"machine": machine, "commit": commit})
      print(json.dumps(rows[-1]), flush=True)
      if args.out:
        with args.out.open("a") as f:
          f.write(json.dumps(rows[-1]) + "\n")
  print(f"\nMachine: {machine}. Commit {commit}.\n")
  print(table(rows))
  report.print_json({"rows": rows})


if __name__ == "__main__":
  main()
