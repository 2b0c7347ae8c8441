"""The greedy choice on a CPU: `cpu_kernels.f32_argmax` against XLA's reductions.

    python -m experiments.bench_greedy [--shapes 1x49152,5x49152,1x151936,5x151936]
        [--repeats 300]

Every step picks its tokens from its logits: the AR step and a verification by argmax,
a draft by argmax and its top probability (its confidence). For each shape of logits
(rows x vocabulary: one row for a step, γ + 1 for a verification; SmolLM2's and Qwen2.5's
vocabularies by default) this times the XLA forms (`sampling._argmax_xla`,
`sampling.top_probability`) and the kernel (`sampling.argmax`,
`sampling.argmax_and_top_probability` where it runs), each jitted alone, round-robin, and
takes off the cost of a jitted call that only reads one logit. Medians in µs; the last
line is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from experiments import report
from specjax import cpu_kernels, sampling

FORMS = {
    "xla argmax": sampling._argmax_xla,
    "kernel argmax": sampling.argmax,
    "xla argmax + top probability": lambda l: (sampling._argmax_xla(l),
                                               sampling.top_probability(l)),
    "kernel, both": sampling.argmax_and_top_probability,
}


def shapes(text: str) -> list[tuple[int, int]]:
  """'1x49152,5x49152' -> [(1, 49152), (5, 49152)]."""
  try:
    out = [tuple(int(n) for n in s.split("x")) for s in text.split(",")]
  except ValueError:
    out = []
  if not out or any(len(s) != 2 or min(s) < 1 for s in out):
    raise SystemExit(f"--shapes: ROWSxVOCAB[,ROWSxVOCAB...], e.g. 5x49152; got {text!r}")
  if max(rows for rows, _ in out) > cpu_kernels.FEW_ROWS:  # sampling takes XLA's form there
    raise SystemExit(f"--shapes: at most {cpu_kernels.FEW_ROWS} rows, the most the kernel "
                     f"takes; got {text!r}")
  return out


def timed(calls: dict, x: jax.Array, repeats: int) -> dict[str, float]:
  """Median µs of each call on x, round-robin, less the median of a call that reads one
  logit (a jitted call's own cost)."""
  calls = {"call": lambda l: l[..., 0] + 1} | calls
  jitted = {name: jax.jit(fn) for name, fn in calls.items()}
  for fn in jitted.values():
    jax.block_until_ready(fn(x))
  times: dict[str, list[float]] = {name: [] for name in jitted}
  for _ in range(repeats):
    for name, fn in jitted.items():
      t = time.perf_counter()
      jax.block_until_ready(fn(x))
      times[name].append(time.perf_counter() - t)
  base = statistics.median(times.pop("call"))
  return {name: max(0.0, (statistics.median(v) - base) * 1e6) for name, v in times.items()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="1x49152,5x49152,1x151936,5x151936",
                  help="ROWSxVOCAB of the logits, comma-separated")
  ap.add_argument("--repeats", type=int, default=300)
  args = ap.parse_args()
  status = cpu_kernels.kernel_status("f32_argmax")
  if jax.default_backend() != "cpu" or status != "ready":
    raise SystemExit(f"the f32_argmax kernel does not run here ({jax.default_backend()}, "
                     f"{status}): nothing to compare")
  rows, figures = [], {"machine": report.machine(), "us": {}}
  for R, V in shapes(args.shapes):
    x = 3.0 * jax.random.normal(jax.random.key(0), (R, V), jnp.float32)
    us = timed(FORMS, x, args.repeats)
    figures["us"][f"{R}x{V}"] = {name: round(t, 1) for name, t in us.items()}
    rows.append([f"{R} × {V}", *(f"{us[name]:.0f}" for name in FORMS)])
  print(f"{figures['machine']}; µs per call less a jitted call's own cost "
        f"(medians of {args.repeats}, round-robin)")
  print(report.markdown_table(["logits", *FORMS], rows))
  report.print_json(figures)


if __name__ == "__main__":
  main()
