"""How well `--auto-gamma` prices (γ, τ): the replayed tokens per AR step of a pilot against
the speedup the same settings reach when the pilot's prompts are really decoded.

    python -m experiments.replay_vs_real [--model smollm2-135m-instruct] [--drafter 8bit]
        [--pairs 8:0,8:0.4,4:0,4:0.4] [--prompts 3] [--max-new-tokens 64]

Pilots and step costs come from the same code as `specjax bench --auto-gamma`
(`specjax.decode.draft_length`): the first `--prompts` held-out search prompts (the bench's
pilots until 2026-11-27; it now takes other held-out prompts, `data.pilot_prompts`, so this
script's section stays reproducible) decoded at the largest γ with no early stop, replayed position by position under each (γ, τ) of `--pairs` and of the
fit. Then each pair decodes the same prompts for real (greedy, the device loop where the
drafter allows it) beside AR; `real` is AR decode time over SSD decode time, medians of
`--runs`. A replay that orders the pairs as the real runs do picks the right ones. Tables
and, last, a JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from experiments import report
from specjax import data
from specjax.bench import harness
from specjax.decode import draft_length
from specjax.decode.engine import speculative_generate
from specjax.decode.generate import generate
from specjax.drafters.factory import DrafterFactory
from specjax.models.loader import load_model


def parse_pairs(text: str) -> list[tuple[int, float]]:
  """'8:0,4:0.4' -> [(8, 0.0), (4, 0.4)]; anything else is refused with the form expected."""
  pairs = []
  for item in text.split(","):
    g, _, t = item.partition(":")
    try:
      pairs.append((int(g), float(t or 0)))
    except ValueError:
      raise SystemExit(f"--pairs: {item!r} is not γ:τ (e.g. 8:0,4:0.4)") from None
  return pairs


def decode_seconds(m, drafter, prompts, gamma: int | None, tau: float, tokens: int) -> float:
  """Decode time over all prompts (no compile, no prefill): AR when `gamma` is None."""
  total = 0.0
  for ids in prompts:
    if gamma is None:
      g = generate(m.graphdef, m.state, m.config, ids, max_new_tokens=tokens, eos_ids=())
    else:
      g = speculative_generate(m.graphdef, m.state, m.config, ids, drafter,
                               max_new_tokens=tokens, gamma=gamma, threshold=tau, eos_ids=())
    total += g.decode_s
  return total


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  report.common_args(ap, results=False)
  ap.add_argument("--drafter", default="8bit", help="a `specjax bench` drafter name")
  ap.add_argument("--pairs", default="8:0,8:0.4,4:0,4:0.4", help="γ:τ pairs to decode")
  ap.add_argument("--gamma-max", type=int, default=8, help="the pilots' γ and the fit's most")
  ap.add_argument("--prompts", type=int, default=3, help="held-out search prompts")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--runs", type=int, default=3, help="real decodes per pair (median)")
  ap.add_argument("--search-iterations", type=int, default=30, help="self_sd BO iterations")
  ap.add_argument("--data-dir", default=None)
  args = ap.parse_args()
  pairs = parse_pairs(args.pairs)
  if any(not 1 <= g <= args.gamma_max or not 0 <= t <= 1 for g, t in pairs):
    raise SystemExit(f"--pairs: γ in 1..{args.gamma_max}, τ in [0, 1]")

  m = load_model(args.model, dtype=args.dtype)
  _, search = data.evaluation_and_search(data.load_spec_bench(args.data_dir), 1)
  prompts = [harness.prompt_ids(m.tokenizer, p.turns[:1]) for p in search[:args.prompts]]
  with tempfile.TemporaryDirectory() as work:
    drafter = DrafterFactory(m, gamma=args.gamma_max, seed=0,
                             search_iterations=args.search_iterations, options={},
                             work_dir=Path(work), data_dir=args.data_dir,
                             search_prompts=search, verbose=False).make(args.drafter)
  pilot = draft_length.run_pilot(m.graphdef, m.state, m.config, drafter, prompts,
                                 gamma=args.gamma_max, max_new_tokens=args.max_new_tokens)
  tracks, costs = pilot.tracks, pilot.costs
  fit = draft_length.best_length_and_threshold(tracks, costs, args.gamma_max)
  pairs = pairs + [fit] * (fit not in pairs)

  runs = {p: [] for p in [None, *pairs]}
  for p in runs:  # compile every executable before anything is timed
    decode_seconds(m, drafter, prompts[:1], *(p or (None, 0.0)), args.max_new_tokens)
  for _ in tqdm(range(args.runs), desc="real decodes", unit="run"):
    for p, times in runs.items():  # round-robin: noise hits every pair alike
      times.append(decode_seconds(m, drafter, prompts, *(p or (None, 0.0)),
                                  args.max_new_tokens))
  ar = statistics.median(runs.pop(None))
  rows, figures = [], []
  for g, t in pairs:
    replayed = draft_length.replay_tpt(tracks, g, t, costs)
    real = ar / statistics.median(runs[(g, t)])
    rows.append([g, t, f"{replayed:.3f}", f"{real:.3f}", "fit" if (g, t) == fit else ""])
    figures.append({"gamma": g, "threshold": t, "replayed": round(replayed, 4),
                    "real": round(real, 4)})
  print(report.markdown_table(["γ", "τ", "replayed tokens per AR step", "real speedup", ""],
                              rows))

  def order(key: str) -> list[tuple[int, float]]:
    return [(f["gamma"], f["threshold"]) for f in sorted(figures, key=lambda f: -f[key])]

  report.print_json({"model": args.model, "drafter": args.drafter, "machine": report.machine(),
                     "pilot_positions": sum(len(t) for t in tracks), "fit": list(fit),
                     "draft_cost": round(costs.draft, 4), "pairs": figures,
                     "same_order": order("replayed") == order("real")})


if __name__ == "__main__":
  main()
