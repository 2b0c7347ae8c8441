"""Do CUDA-graph conditionals take the host out of a traced plan? One GPU check, no weights.

    python -m experiments.gpu_conditionals --model shape:smollm2-135m --out cond.jsonl

XLA:GPU runs a `lax.cond` by copying its predicate to the host and waiting before it
launches a branch, and a `while_loop` whose trip count depends on data does the same each
iteration, unless command buffers (CUDA graphs) hold the conditionals:
`XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE`. That decides how a GPU
should run a traced plan (one `lax.cond` per sub-layer: SWIFT, CLaSp and KnapSpec, whose
plans change every round) and what the device loops' own `while_loop`s cost.

For each flag setting (`--settings`), a child process (XLA reads its flags once) times on
the same random-init model (`bench_gpu.SHAPES`; timing does not depend on the weights):

- inside one jitted loop (`step_times(loop=)`: device time alone): the AR step, and a draft
  step at 50 % of sub-layers frozen into the executable and traced;
- greedy AR decoding (`generate`: a `while_loop` over tokens), tokens/s;
- SSD with that 50 % plan (`StaticDrafter`): the device round loop, plan frozen and plan
  traced, and the host loop (traced, as the adaptive drafters run): ms per round, and
  whether its tokens equal AR's.

A table per setting, then one JSON line. Each child's figures are appended to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "default": "",
    "cmdbuf": "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE",
}
PLAN_SHARE = 0.5


def measure(model: str, context: int, steps: int, repeats: int, tokens: int) -> dict:
  """This process's figures, under whatever XLA_FLAGS it was started with."""
  import jax
  import numpy as np
  from flax import nnx

  from experiments.bench_forward import random_plan
  from experiments.bench_gpu import SHAPES
  from specjax.decode.draft_length import step_times
  from specjax.decode.engine import speculative_generate
  from specjax.decode.generate import generate
  from specjax.drafters.static import StaticDrafter
  from specjax.model import init_model
  from specjax.models.loader import resolve_dtype, with_precision

  config = with_precision(SHAPES[model.removeprefix("shape:")], "auto")
  graphdef, state = nnx.split(init_model(config, seed=0, dtype=resolve_dtype("auto")))
  L = config.num_layers
  plan = random_plan(L, PLAN_SHARE, np.random.default_rng(0))
  t = step_times(graphdef, state, config, {"frozen": [plan.freeze()], "traced": [plan]},
                 context=context, repeats=repeats, loop=steps)
  out = {"loop_ar_ms": t.ar * 1e3, "loop_frozen_over_ar": t.drafts["frozen"] / t.ar,
         "loop_traced_over_ar": t.drafts["traced"] / t.ar}

  ids = list(range(1, 33))
  ar = [generate(graphdef, state, config, ids, max_new_tokens=tokens, eos_ids=())
        for _ in range(3)][1:]  # the first compiles
  out["ar_tok_s"] = float(np.median([g.decode_tokens_per_s for g in ar]))
  drafter = StaticDrafter(plan)
  for name, kw in (("device frozen", dict(loop="device", static_plan=True)),
                   ("device traced", dict(loop="device", static_plan=False)),
                   ("host traced", dict(loop="host"))):
    gens = [speculative_generate(graphdef, state, config, ids, drafter, max_new_tokens=tokens,
                                 eos_ids=(), **kw) for _ in range(3)][1:]
    g = gens[-1]
    out[f"ssd {name}"] = {
        "ms_per_round": float(np.median([x.decode_s / x.rounds * 1e3 for x in gens])),
        "tok_s": float(np.median([x.decode_tokens_per_s for x in gens])),
        "M": g.mean_accepted, "same_as_ar": g.tokens == ar[-1].tokens}
  out["device"] = str(jax.devices()[0].device_kind)
  return out


def table(rows: list[dict]) -> str:
  keys = [("loop_ar_ms", "AR step in a loop, ms"),
          ("loop_frozen_over_ar", "50 % draft frozen ÷ AR (loop)"),
          ("loop_traced_over_ar", "50 % draft traced ÷ AR (loop)"),
          ("ar_tok_s", "AR decode, tok/s")]
  lines = ["| | " + " | ".join(r["setting"] for r in rows) + " |",
           "| --- |" + " --- |" * len(rows)]
  for k, label in keys:
    lines.append(f"| {label} | " + " | ".join(f"{r.get(k, float('nan')):.3f}" for r in rows)
                 + " |")
  for name in ("device frozen", "device traced", "host traced"):
    cells = []
    for r in rows:
      s = r.get(f"ssd {name}")
      cells.append(f"{s['ms_per_round']:.2f} ms/round, M {s['M']:.2f}, "
                   f"{'=' if s['same_as_ar'] else '≠'} AR" if s else "-")
    lines.append(f"| SSD {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="shape:smollm2-135m")
  ap.add_argument("--settings", default=",".join(SETTINGS), help=f"of {list(SETTINGS)}")
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--loop-steps", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--timeout", type=float, default=150, help="seconds per setting")
  ap.add_argument("--out", type=Path, help="append each setting's JSON line here")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  unknown = sorted(set(args.settings.split(",")) - set(SETTINGS))
  if unknown:
    ap.error(f"unknown setting {unknown[0]!r}; known: {', '.join(SETTINGS)}")
  if args.child:
    print(json.dumps(measure(args.model, args.context, args.loop_steps, args.repeats,
                             args.tokens)))
    return
  from experiments import report  # here: the children, not this process, import jax first

  rows = []
  for setting in args.settings.split(","):
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), SETTINGS[setting]) if f)
    env = {**os.environ, "XLA_FLAGS": flags}
    argv = report.child("gpu_conditionals", "--child", *sys.argv[1:])
    t0 = time.perf_counter()
    try:
      p = subprocess.run(argv, env=report.child_env(env), capture_output=True, text=True,
                         timeout=args.timeout)
      lines = p.stdout.strip().splitlines()
      row = json.loads(lines[-1]) if p.returncode == 0 and lines else {
          "error": (p.stderr or p.stdout).strip().splitlines()[-3:]}
    except subprocess.TimeoutExpired:
      row = {"error": f"over {args.timeout:.0f} s"}
    row |= {"setting": setting, "xla_flags": SETTINGS[setting], "model": args.model,
            "seconds": time.perf_counter() - t0}
    print(f"{setting}: {json.dumps(row)}", flush=True)
    rows.append(row)
    if args.out:
      with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")
  print(table([r for r in rows if "error" not in r]))
  print(json.dumps({"model": args.model, "settings": rows}))


if __name__ == "__main__":
  main()
