"""Where a host-loop round's time goes: its draft and verify calls, round by round.

    python -m experiments.host_loop_rounds --model shape:smollm2-135m --tokens 64

The host loop (`speculative_generate(loop="host")`) books each round's draft call and
verify call apart. On an H200 (2026-11-27) its verify calls averaged 4.6-7.9 ms against
3.0 ms for verification timed alone as a host call. This script puts the two side by side
on one model, one process:

- each step alone, as a host call with one wait (`step_times(chain=1)`): the AR step,
  verification at γ, and a draft step under a plan keeping `--share` of the sub-layers,
  frozen into the executable and traced (a `lax.cond` per sub-layer);
- SSD with that plan (`StaticDrafter`, greedy, γ) in the host loop, traced and frozen, each
  `--repeats` + 1 times with `record_rounds` (the first run executes every program for the
  first time): per round, the draft call per drafted token and the verify call, as
  median, mean and 90th percentile, and the first run's first round apart.

If the loop's median verify call matches the step alone, the gap is in a few slow calls
(first executions, outliers); if the median is high too, in what the loop does around the
call, and the frozen run tells whether it follows the traced draft's conditionals. A table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from experiments.bench_forward import random_plan
from experiments.bench_gpu import Model
from specjax.decode.draft_length import step_times
from specjax.decode.engine import speculative_generate
from specjax.drafters.static import StaticDrafter


def summary(ms: list[float]) -> dict:
  a = np.asarray(ms)
  return {"median": float(np.median(a)), "mean": float(a.mean()),
          "p90": float(np.percentile(a, 90)), "n": int(a.size)}


def host_runs(model, plan, ids: list[int], args) -> dict:
  """Per-round draft (per drafted token) and verify call times over the host-loop runs."""
  drafter = StaticDrafter(plan)
  runs = [speculative_generate(model.graphdef, model.state, model.config, ids, drafter,
                               max_new_tokens=args.tokens, gamma=args.gamma, loop="host",
                               eos_ids=(), record_rounds=True)
          for _ in range(args.repeats + 1)]
  first, warm = runs[0], runs[1:]

  def per_round(gens):
    draft = [d / max(n, 1) * 1e3 for g in gens
             for (d, _), n in zip(g.round_seconds, g.round_drafted)]
    verify = [v * 1e3 for g in gens for _, v in g.round_seconds]
    return draft, verify

  draft, verify = per_round(warm)
  c_draft, c_verify = per_round([first])
  return {"draft_ms": summary(draft), "verify_ms": summary(verify),
          "cold_first_round_ms": {"draft": c_draft[0], "verify": c_verify[0]},
          "cold_run_ms": {"draft": summary(c_draft), "verify": summary(c_verify)},
          "ms_per_round": float(np.median([g.decode_s / g.rounds * 1e3 for g in warm])),
          "other_ms_per_round": float(np.median([g.other_s / g.rounds * 1e3 for g in warm])),
          "M": warm[-1].mean_accepted, "tokens": warm[-1].tokens}


def table(out: dict) -> str:
  alone = out["alone_ms"]
  lines = ["| ms | draft call per token: median / mean / p90 | verify call: median / mean / "
           "p90 | first call (cold run): draft / verify | round |",
           "| --- | --- | --- | --- | --- |",
           f"| step alone (host call, one wait) | traced {alone['draft traced']:.2f}, frozen "
           f"{alone['draft frozen']:.2f} | {alone['verify']:.2f} | | AR {alone['ar']:.2f} |"]
  for name in ("traced", "frozen"):
    r = out[f"host {name}"]
    d, v, c = r["draft_ms"], r["verify_ms"], r["cold_first_round_ms"]
    lines.append(f"| host loop, plan {name} | {d['median']:.2f} / {d['mean']:.2f} / "
                 f"{d['p90']:.2f} | {v['median']:.2f} / {v['mean']:.2f} / {v['p90']:.2f} | "
                 f"{c['draft']:.1f} / {c['verify']:.1f} | {r['ms_per_round']:.2f} "
                 f"(M {r['M']:.2f}) |")
  return "\n".join(lines)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="shape:smollm2-135m",
                  help="a registry model, or shape:NAME for random weights at NAME's shapes")
  ap.add_argument("--dtype", default="auto")
  ap.add_argument("--share", type=float, default=0.5, help="share of sub-layers the plan runs")
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()

  model = Model(args.model, args.dtype)
  plan = random_plan(model.config.num_layers, args.share, np.random.default_rng(0))
  t = step_times(model.graphdef, model.state, model.config,
                 {"traced": [plan], "frozen": [plan.freeze()]}, gammas=(args.gamma,),
                 context=len(model.ids) + args.tokens // 2, repeats=7, chain=1)
  out = {"model": args.model, "dtype": args.dtype, "share": args.share, "gamma": args.gamma,
         "alone_ms": {"ar": t.ar * 1e3, "verify": t.verify[args.gamma] * 1e3,
                      "draft traced": t.drafts["traced"] * 1e3,
                      "draft frozen": t.drafts["frozen"] * 1e3}}
  ids = model.ids
  for name, p in (("traced", plan), ("frozen", plan.freeze())):
    out[f"host {name}"] = host_runs(model, p, ids, args)
    print(f"host loop, plan {name}: {out[f'host {name}']['ms_per_round']:.2f} ms a round",
          flush=True)
  same = out["host traced"].pop("tokens") == out["host frozen"].pop("tokens")
  out["same_tokens"] = same
  import jax

  out["device"] = str(jax.devices()[0].device_kind)
  print(table(out))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
