"""What the layer-selection DP costs: compiling it, and one selection, for CLaSp and KnapSpec.

    python -m experiments.bench_layer_dp [--model smollm2-135m-instruct] [--repeats 7]

The DP (`specjax.selection.layer_dp`) runs on a real window: a chat prompt prefilled, its
last tokens with the full model's residuals. Each drafter's default shape: CLaSp scores
whole layers on the last verified token with L/2 + 1 budgets; KnapSpec scores sub-layers
on the last 4 with `--knapspec-slots` budgets (sub-layer weights 1-3 here, so every budget
is reachable). Nothing is pruned (τ = -1), so every budget does its work. Compile time is
one ahead-of-time compile (no compilation cache); a selection is the median of `--repeats`
calls. A first prompt pays the compile inside its first round; later selections pay the
run. Writes the `layer-dp-MODEL` section of docs/results/step-costs.md; the last line is
JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import report
from experiments.bench_forward import PROMPT
from specjax.decode.generate import prefill_step
from specjax.kv_cache import KVCache
from specjax.models.loader import load_model
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams
from specjax.selection.layer_dp import layer_dp
from specjax.selection.layer_probe import Window, full_residuals


def window_after_prefill(m, ids: list[int], size: int) -> tuple[KVCache, Window]:
  """The cache after prefilling `ids` but their last `size` tokens, and a window over those."""
  n = len(ids) - size
  cache = KVCache.create(m.config, 1, len(ids) + 64)
  tokens = jnp.asarray([ids[:n] + [0] * (cache.size - n)], jnp.int32)
  full = DraftPlan.full(m.config.num_layers)
  _, cache = prefill_step(m.state, cache, tokens, jnp.int32(n), full, jax.random.key(0),
                          graphdef=m.graphdef, sampling=SamplingParams())
  span = jnp.asarray(ids[n:], jnp.int32)
  res, top = full_residuals(m.state, cache, span, jnp.int32(n), graphdef=m.graphdef)
  return cache, Window(tokens=span, positions=jnp.arange(n, n + size, dtype=jnp.int32),
                       next_tokens=top, residuals=res, valid=jnp.ones((size,), bool))


def time_dp(m, ids, *, coupled: bool, window: int, slots: int, repeats: int) -> dict:
  """Compile seconds and the median selection in ms of one DP shape."""
  cache, win = window_after_prefill(m, ids, window)
  L = m.config.num_layers
  items = L if coupled else 2 * L
  if coupled:  # CLaSp: a skipped layer costs 1
    run_cost, skip_cost = np.zeros(items, np.int32), np.ones(items, np.int32)
  else:  # KnapSpec: a sub-layer that runs costs its weight
    run_cost = np.random.default_rng(0).integers(1, 4, items).astype(np.int32)
    skip_cost = np.zeros(items, np.int32)
  args = (m.state, cache, win, jnp.asarray(run_cost), jnp.asarray(skip_cost), jnp.float32(-1))
  t0 = time.perf_counter()
  exe = layer_dp.lower(*args, graphdef=m.graphdef, coupled=coupled, slots=slots,
                       agreement=not coupled).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(exe(*args))
  runs = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(exe(*args))
    runs.append(time.perf_counter() - t)
  return {"compile_s": compile_s, "select_ms": statistics.median(runs) * 1e3,
          "window": window, "slots": slots, "items": items}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--knapspec-slots", type=int, default=128)
  report.common_args(ap, results=False)
  args = ap.parse_args()

  m = load_model(args.model, dtype=args.dtype)
  ids = m.tokenizer.encode_prompt(PROMPT)
  L = m.config.num_layers
  shapes = {"clasp": dict(coupled=True, window=1, slots=L // 2 + 1),
            "knapspec": dict(coupled=False, window=4, slots=args.knapspec_slots)}
  figures = {"model": m.name, "layers": L, "machine": report.machine()}
  rows = []
  for name, shape in shapes.items():
    f = time_dp(m, ids, repeats=args.repeats, **shape)
    figures[name] = f
    rows.append([name, f"{f['items']} {'layers' if shape['coupled'] else 'sub-layers'}",
                 f["window"], f["slots"], f"{f['compile_s']:.1f}", f"{f['select_ms']:.0f}"])
    print(f"{name}: compile {f['compile_s']:.1f} s, a selection {f['select_ms']:.0f} ms",
          flush=True)
  table = report.markdown_table(["drafter", "items", "window tokens", "budgets (slots)",
                                 "compile (s)", "a selection (ms)"], rows)
  print(table)
  if args.write_docs:
    report.write_section(f"layer-dp-{m.name}", "\n".join([
        f"## Layer-selection DP: compile and selection time ({m.name})", "",
        f"Machine: {figures['machine']}. Commit {report.git_revision()}.", "",
        "The DP of `specjax.selection.layer_dp` at each drafter's default shape, on a real "
        "prompt's window, nothing pruned; compile: one ahead-of-time compile, no compilation "
        f"cache; a selection: median of {args.repeats} calls. The items are a `lax.scan` over "
        "layers; before `e14f0c4` they were unrolled, and compiling grew with the model's "
        "depth (the intro has that A/B):", "",
        table, ""]))
  report.print_json(figures)


if __name__ == "__main__":
  main()
