"""What each drafter compiles over a stream of prompts: executables, seconds, wall time.

    python -m experiments.bench_compiles --model smollm2-135m-instruct --drafters clasp,knapspec

Compilation is booked apart from decoding (`SSDGeneration.compile_s`), so a drafter that
compiles again and again looks no slower in tokens/s; a user still waits for it. For each
drafter, in a fresh process state (`jit_cache.clear()` first), `speculative_generate`
decodes the first `--prompts` Spec-Bench prompts (`--max-new-tokens` tokens, greedy, γ =
`--gamma`, `loop="auto"`, the drafter's state carried from prompt to prompt, as `specjax
bench` does) and the table gives the compiles and the seconds they took over all prompts,
the decode tokens/s (compiles excluded) and the wall time. The last line is JSON.
"""

from __future__ import annotations

import argparse
import time

from experiments import report
from specjax import (
  data,
  jit_cache,
)
from specjax.bench.harness import prompt_ids
from specjax.cli import add_dtype_arg
from specjax.decode.engine import speculative_generate
from specjax.drafters.factory import DrafterFactory
from specjax.models.loader import load_model


def measure(model, drafter, prompts: list[list[int]], args) -> dict:
  jit_cache.clear()  # every drafter starts from nothing compiled
  state, compiles, compile_s, decode_s, tokens = None, 0, 0.0, 0.0, 0
  t0 = time.perf_counter()
  for ids in prompts:
    g = speculative_generate(model.graphdef, model.state, model.config, ids, drafter,
                             max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                             drafter_state=state)
    state = g.drafter_state
    compiles += g.compiles
    compile_s += g.compile_s
    decode_s += g.decode_s
    tokens += len(g.tokens) - 1
  return {"compiles": compiles, "compile_s": compile_s, "decode_tok_s": tokens / decode_s,
          "wall_s": time.perf_counter() - t0}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--drafters", default="clasp,swift,knapspec",
                  help="comma-separated `specjax bench` names")
  ap.add_argument("--prompts", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--data-dir", help="Spec-Bench's folder (default: SPECJAX_DATA_DIR)")
  add_dtype_arg(ap)
  args = ap.parse_args()

  model = load_model(args.model, dtype=args.dtype)
  chosen = data.load_spec_bench(args.data_dir)[: args.prompts]
  prompts = [prompt_ids(model.tokenizer, p.turns[:1]) for p in chosen]
  factory = DrafterFactory(model, gamma=args.gamma, data_dir=args.data_dir)
  rows = {}
  for name in args.drafters.split(","):
    rows[name] = r = measure(model, factory.make(name), prompts, args)
    print(f"{name}: {r['compiles']} compiles, {r['compile_s']:.1f} s compiling, "
          f"{r['decode_tok_s']:.2f} tok/s decoding, {r['wall_s']:.1f} s wall", flush=True)
  print(report.markdown_table(
      ["drafter", "compiles", "compile s", "decode tok/s", "wall s"],
      [[n, r["compiles"], f"{r['compile_s']:.1f}", f"{r['decode_tok_s']:.2f}",
        f"{r['wall_s']:.1f}"] for n, r in rows.items()]))
  report.print_json({"model": args.model, "dtype": args.dtype, "machine": report.machine(),
                     "commit": report.git_revision(), "prompts": len(prompts),
                     "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
                     "drafters": rows})


if __name__ == "__main__":
  main()
