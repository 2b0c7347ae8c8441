"""What the layer-selection DP costs: compiling it, and one selection, for CLaSp and KnapSpec.

    python -m experiments.bench_layer_dp [--model smollm2-135m-instruct] [--context 1024]

The DP (`specjax.selection.layer_dp`) runs on a real window: a chat prompt repeated to
`--context` tokens and prefilled, its last tokens with the full model's residuals. Each
drafter's default shape: CLaSp scores whole layers on the last verified token with L/2 + 1
budgets; KnapSpec scores sub-layers on its window of verified tokens (the paper's 5) with
the budgets up to K/2, its sub-layer weights those of the model's latency profile at this
context (`specjax profile`; without one, weights 1-3), and beside it the table over every
budget that it used before its table stopped at K/2. Nothing is pruned (τ = -1), so every
budget does its work. Compile time is one ahead-of-time compile (no compilation cache); a
selection is the median of `--repeats` calls, also in AR steps at the same context timed
in the same process (the unit of the KnapSpec paper's "about one AR step" on a GPU). A
first prompt pays the compile inside its first round; later selections pay the run.
Writes the `layer-dp-MODEL` section of docs/results/step-costs.md; the last line is JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import report
from experiments.bench_forward import PROMPT
from specjax.decode.draft_length import step_times
from specjax.decode.generate import prefill_step
from specjax.drafters.knapspec import KnapSpecDrafter, slots_for
from specjax.kv_cache import KVCache
from specjax.models.loader import load_model
from specjax.models.source import artefact_key
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams
from specjax.selection.layer_dp import layer_dp
from specjax.selection.layer_probe import Window, full_residuals
from specjax.selection.profiler import MissingProfileError, ProfileMismatchError, load_profile


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


def time_dp(m, ids, *, coupled: bool, window: int, slots: int, repeats: int,
            weights: np.ndarray | None = None) -> dict:
  """Compile seconds and the median selection in ms of one DP shape (`weights`: KnapSpec's
  run costs, one per sub-layer)."""
  cache, win = window_after_prefill(m, ids, window)
  L = m.config.num_layers
  items = L if coupled else 2 * L
  if coupled:  # CLaSp: a skipped layer costs 1
    run_cost, skip_cost = np.zeros(items, np.int32), np.ones(items, np.int32)
  else:  # KnapSpec: a sub-layer that runs costs its weight
    run_cost = np.asarray(weights, np.int32)
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


def knapspec_weights(m, context: int) -> tuple[np.ndarray, str]:
  """KnapSpec's sub-layer weights at `context` from the model's saved latency profile, or
  weights 1-3 without one; and where they came from."""
  try:
    profile = load_profile(artefact_key(m), m.config.num_layers)
  except (MissingProfileError, ProfileMismatchError):
    rng = np.random.default_rng(0)
    return rng.integers(1, 4, 2 * m.config.num_layers), "weights 1-3 (no latency profile)"
  return profile.weights(context), f"the latency profile's weights at {context} tokens"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--context", type=int, default=1024,
                  help="tokens in the cache the DP's window attends to")
  report.common_args(ap, results=False)
  args = ap.parse_args()

  m = load_model(args.model, dtype=args.dtype)
  prompt = m.tokenizer.encode_prompt(PROMPT)
  context = min(args.context, m.config.max_context - 64)
  ids = (prompt * -(-context // len(prompt)))[:context]
  L = m.config.num_layers
  defaults = {f.name: f.default for f in dataclasses.fields(KnapSpecDrafter)}
  weights, source = knapspec_weights(m, context)
  window, share = defaults["window"], defaults["max_budget_share"]
  shapes = {"clasp": dict(coupled=True, window=1, slots=L // 2 + 1),
            "knapspec": dict(coupled=False, window=window, weights=weights,
                             slots=slots_for(weights, share)),
            "knapspec, every budget": dict(coupled=False, window=window, weights=weights,
                                           slots=slots_for(weights))}
  ar_ms = step_times(m.graphdef, m.state, m.config, {}, gammas=(1,), context=context,
                     repeats=args.repeats).ar * 1e3
  figures = {"model": m.name, "layers": L, "context": context, "ar_step_ms": ar_ms,
             "knapspec_weights": source, "machine": report.machine()}
  rows = []
  for name, shape in shapes.items():
    f = time_dp(m, ids, repeats=args.repeats, **shape)
    f["ar_steps"] = f["select_ms"] / ar_ms
    figures[name] = f
    rows.append([name, f"{f['items']} {'layers' if shape['coupled'] else 'sub-layers'}",
                 f["window"], f["slots"], f"{f['compile_s']:.1f}", f"{f['select_ms']:.0f}",
                 f"{f['ar_steps']:.1f}"])
    print(f"{name}: compile {f['compile_s']:.1f} s, a selection {f['select_ms']:.0f} ms "
          f"({f['ar_steps']:.1f} AR steps)", flush=True)
  table = report.markdown_table(["drafter", "items", "window tokens", "budgets (slots)",
                                 "compile (s)", "a selection (ms)", "in AR steps"], rows)
  print(table)
  if args.write_docs:
    report.write_section(f"layer-dp-{m.name}", "\n".join([
        f"## Layer-selection DP: compile and selection time ({m.name})", "",
        f"Machine: {figures['machine']}. Commit {report.git_revision()}.", "",
        f"The DP of `specjax.selection.layer_dp` at each drafter's default shape, on a real "
        f"prompt's window over {context} cached tokens, nothing pruned; KnapSpec with "
        f"{source} (K = {int(np.sum(weights))}), its table to K/2 (the default) and to K "
        f"(before 2026-12-06); compile: one ahead-of-time compile, no compilation cache; a "
        f"selection: median of {args.repeats} calls, and in AR steps at the same context "
        f"({ar_ms:.1f} ms, timed in this process). The KnapSpec paper reports its DP at about "
        "one AR step on a GPU. The items are a `lax.scan` over layers; before `e14f0c4` they "
        "were unrolled, and compiling grew with the model's depth:", "",
        table, ""]))
  report.print_json(figures)


if __name__ == "__main__":
  main()
