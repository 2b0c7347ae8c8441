"""Where an SSD round's time goes: draft step vs verification vs an AR step.

    python -m experiments.profile_round [--model smollm2-135m-instruct] [--gamma 4]

Times, in one process and round-robin (median of `--repeats`): one AR decode step (T=1,
full model), one verification forward (T=γ+1, full model), and one draft step (T=1)
under early-exit plans keeping 25/50/75 % of the layers. With these, a round drafting n
tokens costs n·t_draft + t_verify, and the speedup at mean accepted length M is
M·t_ar / (n·t_draft + t_verify): the script prints the M each plan needs to break even.
Writes the `round-MODEL` section of docs/results/step-costs.md; the last line is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from experiments import report
from specjax.decode.generate import decode_step, positions_for
from specjax.jit_cache import compiled
from specjax.kv_cache import KVCache
from specjax.model import apply
from specjax.models.loader import load_model
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams, argmax
from specjax.selection.cost import expected_tokens


def verify_fn(state, cache, tokens, plan, *, graphdef):
  out, cache = apply(state, cache, tokens, positions_for(cache, tokens.shape[1], 1), plan,
                     graphdef=graphdef, logits="all")
  return argmax(out.logits), cache  # the engine's argmax: XLA:CPU's own is slower


verify_step = jax.jit(verify_fn, static_argnames=("graphdef",), donate_argnames=("cache",))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=30)
  report.common_args(ap, results=False)
  args = ap.parse_args()

  m = load_model(args.model, dtype=args.dtype)
  L = m.config.num_layers
  cache = KVCache.create(m.config, 1, args.context + 64).with_length(args.context)
  key, tok = jax.random.key(0), jnp.ones((1,), jnp.int32)
  full = DraftPlan.full(L)
  plans = {"full (AR step)": full} | {
      f"first {int(f * 100)} % layers": DraftPlan.first_layers(L, round(f * L))
      for f in (0.25, 0.5, 0.75)
  }
  # The AR step runs the dense model; draft plans are traced (one executable for all).
  exes = {name: compiled(decode_step, m.state, cache, tok, plan, key, graphdef=m.graphdef,
                         sampling=SamplingParams()) for name, plan in plans.items()}
  seq = jnp.ones((1, args.gamma + 1), jnp.int32)
  verify = compiled(verify_step, m.state, cache, seq, full, graphdef=m.graphdef)
  times: dict[str, list[float]] = {k: [] for k in plans} | {"verify": []}
  for _ in range(args.repeats):
    for name, plan in plans.items():
      cache = cache.with_length(args.context)
      t = time.perf_counter()
      tok, cache = exes[name](m.state, cache, tok, plan, key)
      tok.block_until_ready()
      times[name].append(time.perf_counter() - t)
    cache = cache.with_length(args.context)
    t = time.perf_counter()
    out, cache = verify(m.state, cache, seq, full)
    out.block_until_ready()
    times["verify"].append(time.perf_counter() - t)
  med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
  t_ar, t_v = med["full (AR step)"], med["verify"]
  rows = [["AR step (T=1, full)", t_ar, 1.0, "–"],
          [f"verify (T={args.gamma + 1}, full)", t_v, t_v / t_ar, "–"]]
  for name in list(plans)[1:]:
    # Break-even M when drafting γ tokens: M·t_ar = γ·t_draft + t_verify.
    need = (args.gamma * med[name] + t_v) / t_ar
    rows.append([f"draft step, {name}", med[name], med[name] / t_ar, f"{need:.2f}"])
  header = ["step", "median ms", "÷ AR step", f"M needed to break even (γ={args.gamma})"]
  table = report.markdown_table(header, rows)
  print(table)
  figures = {"model": args.model, "machine": report.machine(), "gamma": args.gamma,
             "context": args.context, "ms": {k: round(v, 3) for k, v in med.items()}}
  half = (args.gamma * med["first 50 % layers"] + t_v) / t_ar
  figures["break_even_M_half_layers"] = round(half, 3)
  if args.write_docs:
    report.write_section(f"round-{args.model}", "\n".join([
        f"## Round cost breakdown ({args.model}, context {args.context})", "",
        f"Machine: {figures['machine']}. Commit {report.git_revision()}.", "", table, "",
        f"Verifying γ+1 = {args.gamma + 1} tokens costs {t_v / t_ar:.2f} AR steps here. "
        + break_even_text(half, args.gamma)]))
  report.print_json(figures)


def break_even_text(m_needed: float, gamma: int) -> str:
  """What the measured break-even M means, in words that follow the number."""
  if m_needed > gamma + 1:
    return (f"A round drafting γ = {gamma} tokens with half the layers would have to commit "
            f"M ≥ {m_needed:.2f} tokens, more than the γ + 1 = {gamma + 1} a round can: no "
            "acceptance rate makes it beat AR at these step costs.")
  lo, hi = 0.0, 1.0  # M(α) grows with α: bisect for M(α) = need
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if expected_tokens(mid, gamma) < m_needed else (lo, mid)
  return (f"A round drafting γ = {gamma} tokens with half the layers breaks even at "
          f"M = {m_needed:.2f} of at most {gamma + 1} tokens, an acceptance rate of "
          f"α ≈ {hi:.2f} per token if drafts are accepted independently.")


if __name__ == "__main__":
  main()
