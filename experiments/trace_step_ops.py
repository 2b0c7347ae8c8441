"""Where a verification's extra time goes, op by op: one AR step against one verification.

    python -m experiments.trace_step_ops [--model smollm2-135m-instruct] [--gamma 4]
        [--context 256] [--steps 20]

`profile_round.py` says what a verification of γ + 1 tokens costs in AR steps; this says
which operations the excess sits in. It runs the AR step and the verification forward of
`profile_round.py` under `jax.profiler.trace`, and sums the durations of XLA's thunks by
kind: the fusion or call name without its number (`ynn_fusion`: YNNPACK's dots, e.g.
attention over the cache; `copy_*`: layout shuffles), and each C++ kernel call by its
target and its largest operand (`f32_matmul_io f32[576,960]`: the q/k/v matmul), read
from the executable's HLO.
Thunks run on several threads, so the sums are CPU time and the steps run slower under
the profiler. Compare the two columns, not either with a wall-clock step. The last line
is JSON.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import report
from experiments.profile_round import verify_step
from specjax.decode.generate import decode_step
from specjax.jit_cache import compiled
from specjax.kv_cache import KVCache
from specjax.models.loader import load_model
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams

# XLA's instruction names (`ynn_fusion.175`, `ffi_call.0`, `add_dynamic-update-slice_fusion`);
# the runtime's own events (`ThunkExecutor::Execute`, `Handle inputs`, Python frames) are not.
_OP_NAME = re.compile(r"[a-z][\w.-]*")


def op_kind(name: str) -> str:
  """`ynn_fusion.175` -> `ynn_fusion`: one row per kind of operation."""
  return re.sub(r"\.\d+$", "", name)


# `%ffi_call.244 = f32[1,5,960]{2,1,0} custom-call(...), custom_call_target="specjax_f32_matmul_io",
# operand_layout_constraints={f32[1,5,576]{2,1,0}, f32[576,960]{1,0}}, api_version=...`
_CUSTOM_CALL = re.compile(r"%([\w.-]+) = .*custom_call_target=\"(?:specjax_)?(\w+)\""
                          r"(?:, operand_layout_constraints=\{(.*?)\}, api_version)?")
_SHAPE = re.compile(r"\w+\[[\d,]*\]")


def _elements(shape: str) -> int:
  return math.prod(int(d) for d in re.findall(r"\d+", shape.split("[", 1)[1]))


def kernel_calls(hlo: str) -> dict[str, str]:
  """Each custom call's instruction name -> its target and, where it has several operands,
  the shape of its largest (a matmul's weights, attention's cache layer), which both steps
  share: which kernel, on which matrix (`f32_matmul_io f32[576,960]`: q/k/v), a thunk of
  the trace was."""
  calls = {}
  for name, target, operands in _CUSTOM_CALL.findall(hlo):
    shapes = _SHAPE.findall(operands)
    calls[name] = f"{target} {max(shapes, key=_elements)}" if len(shapes) > 1 else target
  return calls


def thunk_ms(trace_dir: Path, steps: int, calls: dict[str, str]) -> dict[str, float]:
  """ms per step of each kind of thunk in the perfetto trace under `trace_dir`; a custom
  call counts under its entry in `calls` (`kernel_calls`)."""
  (path,) = trace_dir.glob("**/*.trace.json.gz")
  totals: collections.Counter = collections.Counter()
  for event in json.load(gzip.open(path))["traceEvents"]:
    name = event.get("name", "")
    if event.get("ph") == "X" and _OP_NAME.fullmatch(name):
      totals[calls.get(name) or op_kind(name)] += event.get("dur", 0) / 1e3 / steps
  return dict(totals)


def traced(run, steps: int, calls: dict[str, str]) -> dict[str, float]:
  """Thunk ms per step of `run()` (which blocks until its step is done), after warm-up;
  `calls` names its executable's custom calls (`kernel_calls`)."""
  for _ in range(3):
    run()
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(steps):
        run()
    return thunk_ms(Path(tmp), steps, calls)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--steps", type=int, default=20, help="traced steps of each (after 3 untraced)")
  ap.add_argument("--top", type=int, default=12, help="op kinds in the table")
  report.common_args(ap, results=False)
  args = ap.parse_args()

  m = load_model(args.model, dtype=args.dtype)
  full = DraftPlan.full(m.config.num_layers)
  fresh = lambda: KVCache.create(m.config, 1, args.context + 64).with_length(args.context)
  key, tok = jax.random.key(0), jnp.ones((1,), jnp.int32)
  seq = jnp.ones((1, args.gamma + 1), jnp.int32)
  ar = compiled(decode_step, m.state, fresh(), tok, full, key, graphdef=m.graphdef,
                sampling=SamplingParams())
  verify = compiled(verify_step, m.state, fresh(), seq, full, graphdef=m.graphdef)
  holder = {"cache": fresh()}  # each step donates the cache: carry the returned one

  def step(fn, *rest):
    def run():
      out, cache = fn(m.state, holder["cache"].with_length(args.context), *rest)
      holder["cache"] = cache
      out.block_until_ready()
    return run

  ms = {"ar": traced(step(ar, tok, full, key), args.steps, kernel_calls(ar.as_text())),
        "verify": traced(step(verify, seq, full), args.steps,
                         kernel_calls(verify.as_text()))}
  kinds = sorted(set(ms["ar"]) | set(ms["verify"]),
                 key=lambda k: ms["ar"].get(k, 0.0) - ms["verify"].get(k, 0.0))
  total = {side: sum(v.values()) for side, v in ms.items()}
  rows = [[k, ms["ar"].get(k, 0.0), ms["verify"].get(k, 0.0),
           ms["verify"].get(k, 0.0) - ms["ar"].get(k, 0.0)] for k in kinds[:args.top]]
  rows.append(["all", total["ar"], total["verify"], total["verify"] - total["ar"]])
  print(f"{args.model}, cache {args.context} of {args.context + 64} slots, "
        f"{report.machine()}: thunk ms per step, by the verification's excess")
  print(report.markdown_table(["op kind", "AR step", f"verify T={args.gamma + 1}", "excess"],
                              rows))
  report.print_json({"model": args.model, "machine": report.machine(), "gamma": args.gamma,
                     "context": args.context, "steps": args.steps,
                     "total_ms": {k: round(v, 3) for k, v in total.items()},
                     "ms": {side: {k: round(v, 4) for k, v in d.items()}
                            for side, d in ms.items()}})


if __name__ == "__main__":
  main()
