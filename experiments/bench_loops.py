"""The device round loop against the host loop, per drafter, on a real model.

    python -m experiments.bench_loops --model smollm2-135m-instruct --drafters clasp,8bit

`speculative_generate(loop="host")` dispatches a draft call and a verify call per round
and reads the device between them; `loop="device"` runs rounds inside one jitted loop
(for CLaSp and SWIFT, the rounds between their selections). For each drafter, both loops
decode the prompts (one Spec-Bench prompt of each of `--categories`, `--max-new-tokens`
tokens, greedy, γ = `--gamma`) in alternation, each loop handing the drafter's state
from prompt to prompt as `specjax bench` does (SWIFT's search spans prompts); `--repeats`
+ 1 passes, the first compiles and is dropped. Greedy AR decoding (`generate`) of the same
prompts, timed the same way, is the reference: the table gives AR's decode tokens/s, each
loop's (total tokens over total time; the median over passes), the device loop's speedup
over AR, whether the two loops commit identical tokens, and on how many prompts the device
loop's tokens differ from AR's (mismatches: 0 for a lossless drafter). The last line is
JSON.
"""

from __future__ import annotations

import argparse
import statistics

from experiments import report
from specjax import data
from specjax.bench.harness import prompt_ids
from specjax.cli import add_dtype_arg
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.drafters.factory import DrafterFactory
from specjax.models.loader import load_model

LOOPS = ("host", "device")


def first_of_each(prompts, categories: list[str]) -> list:
  """The first prompt of each category, in `categories` order."""
  firsts = {}
  for p in prompts:
    firsts.setdefault(p.category, p)
  missing = [c for c in categories if c not in firsts]
  if missing:
    raise SystemExit(f"no Spec-Bench prompt of category {missing[0]!r}")
  return [firsts[c] for c in categories]


def autoregressive(model, prompts: list[list[int]], args) -> tuple[float, list[list[int]]]:
  """Greedy AR decoding of the prompts: the median over repeats of its decode tokens/s,
  and each prompt's tokens."""
  rates = []
  for rep in range(args.repeats + 1):
    gens = [generate(model.graphdef, model.state, model.config, ids,
                     max_new_tokens=args.max_new_tokens) for ids in prompts]
    if rep:  # the first pass compiles
      rates.append(sum(len(g.tokens) - 1 for g in gens) / sum(g.decode_s for g in gens))
  return statistics.median(rates), [g.tokens for g in gens]


def measure(model, drafter, prompts: list[list[int]], ar_tokens: list[list[int]], args
            ) -> dict:
  """Per loop, the median over repeats of the decode tokens/s over all prompts; whether
  every prompt's tokens agree between the loops; on how many prompts the device loop's
  differ from AR's (`ar_tokens`)."""
  totals = {loop: [] for loop in LOOPS}
  same = True
  mismatches = 0
  for rep in range(args.repeats + 1):
    sums = {loop: [0, 0.0] for loop in LOOPS}
    carried = dict.fromkeys(LOOPS)  # a drafter's state, prompt to prompt, as the bench does
    for ids, ar in zip(prompts, ar_tokens):
      gens = {loop: speculative_generate(model.graphdef, model.state, model.config, ids,
                                         drafter, max_new_tokens=args.max_new_tokens,
                                         gamma=args.gamma, loop=loop,
                                         drafter_state=carried[loop])
              for loop in LOOPS}
      same &= gens["host"].tokens == gens["device"].tokens
      if rep == 0:
        mismatches += gens["device"].tokens != ar
      for loop, g in gens.items():
        sums[loop][0] += len(g.tokens) - 1
        sums[loop][1] += g.decode_s
        carried[loop] = g.drafter_state
    if rep:  # the first pass compiles
      for loop, (n, s) in sums.items():
        totals[loop].append(n / s)
  tok_s = {loop: statistics.median(v) for loop, v in totals.items()}
  return {"host_tok_s": tok_s["host"], "device_tok_s": tok_s["device"],
          "device_over_host": tok_s["device"] / tok_s["host"], "same_tokens": same,
          "mismatches": mismatches,
          "runs": {loop: [round(v, 3) for v in vals] for loop, vals in totals.items()}}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--drafters", default="clasp", help="comma-separated `specjax bench` names")
  ap.add_argument("--categories", default="writing,math,coding,extraction")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--data-dir", help="Spec-Bench's folder (default: SPECJAX_DATA_DIR)")
  add_dtype_arg(ap)
  args = ap.parse_args()

  model = load_model(args.model, dtype=args.dtype)
  chosen = first_of_each(data.load_spec_bench(args.data_dir), args.categories.split(","))
  prompts = [prompt_ids(model.tokenizer, p.turns[:1]) for p in chosen]
  factory = DrafterFactory(model, gamma=args.gamma, data_dir=args.data_dir)
  ar_tok_s, ar_tokens = autoregressive(model, prompts, args)
  print(f"AR: {ar_tok_s:.2f} tok/s", flush=True)
  rows = {}
  for name in args.drafters.split(","):
    rows[name] = r = measure(model, factory.make(name), prompts, ar_tokens, args)
    r["speedup"] = r["device_tok_s"] / ar_tok_s
    print(f"{name}: host {r['host_tok_s']:.2f} tok/s, device {r['device_tok_s']:.2f} "
          f"({r['device_over_host']:.3f}×; {r['speedup']:.3f}× AR), same tokens: "
          f"{r['same_tokens']}, mismatches with AR: {r['mismatches']}", flush=True)
  print(report.markdown_table(
      ["drafter", "host loop tok/s", "device loop tok/s", "device ÷ host", "device ÷ AR",
       "same tokens", "mismatches"],
      [[n, f"{r['host_tok_s']:.2f}", f"{r['device_tok_s']:.2f}",
        f"{r['device_over_host']:.3f}", f"{r['speedup']:.3f}", r["same_tokens"],
        r["mismatches"]] for n, r in rows.items()]))
  report.print_json({"model": args.model, "dtype": args.dtype, "machine": report.machine(),
                     "commit": report.git_revision(), "ar_tok_s": ar_tok_s,
                     "prompts": len(prompts),
                     "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
                     "repeats": args.repeats, "drafters": rows})


if __name__ == "__main__":
  main()
