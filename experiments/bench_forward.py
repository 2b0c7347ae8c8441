"""Draft-step time vs share of active sub-layers, and AR decode speed vs transformers.

    python experiments/bench_forward.py [--model smollm2-135m-instruct] [--tokens 128]

Part 1: one decode step (T = 1, context `--context`) under random plans with 25 / 50 /
75 / 100 % of the 2L sub-layers active, as ratios to the full step. Fractions are timed
round-robin and the median taken, so machine noise hits them alike.
Part 2: greedy AR decoding of `--tokens` tokens on one prompt: specjax vs HF transformers
(torch, fp32, same GGUF) and llama.cpp when `llama-cpp-python` is installed; medians of
`--runs` runs, prefill included (end-to-end) and decode-only.
Writes the `forward` section of docs/BENCHMARKS.md; the last line is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

from specjax.generate import decode_step, generate  # noqa: E402
from specjax.jit_cache import compiled  # noqa: E402
from specjax.kv_cache import KVCache  # noqa: E402
from specjax.loader import load_model  # noqa: E402
from specjax.plan import DraftPlan  # noqa: E402
from specjax.registry import get_spec  # noqa: E402
from specjax.sampling import SamplingParams  # noqa: E402

PROMPT = "Explain why the sky is blue to a ten-year-old, in a few short paragraphs."
FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def random_plan(L: int, frac: float, rng: np.random.Generator) -> DraftPlan:
  """Exactly round(frac * 2L) active sub-layers, chosen at random."""
  on = np.zeros(2 * L, bool)
  on[rng.choice(2 * L, int(round(frac * 2 * L)), replace=False)] = True
  return DraftPlan.from_masks(on[:L], on[L:])


def draft_step_ratios(m, context: int, rounds: int, steps: int) -> dict[float, float]:
  cfg = m.config
  rng = np.random.default_rng(0)
  plans = {f: [random_plan(cfg.num_layers, f, rng) for _ in range(3)] for f in FRACTIONS}
  cache = KVCache.create(cfg, 1, context + 64).with_length(context)
  tok, key = jnp.ones((1,), jnp.int32), jax.random.key(0)
  step = compiled(decode_step, m.state, cache, tok, plans[1.0][0], key,
                  graphdef=m.graphdef, sampling=SamplingParams())
  times = {f: [] for f in FRACTIONS}
  for _ in range(rounds):
    for f in FRACTIONS:
      for plan in plans[f]:
        for _ in range(steps):
          cache = cache.with_length(context)  # every step reads the same context
          t = time.perf_counter()
          tok, cache = step(m.state, cache, tok, plan, key)
          tok.block_until_ready()
          times[f].append(time.perf_counter() - t)
  med = {f: statistics.median(ts) for f, ts in times.items()}
  return {f: med[f] / med[1.0] for f in FRACTIONS} | {"full_ms": med[1.0] * 1e3}


def specjax_ar(m, ids: list[int], tokens: int, runs: int) -> dict:
  gens = [generate(m.graphdef, m.state, m.config, ids, max_new_tokens=tokens, eos_ids=())
          for _ in range(runs + 1)][1:]
  e2e = statistics.median(tokens / (g.prefill_s + g.decode_s) for g in gens)
  dec = statistics.median(g.decode_tokens_per_s for g in gens)
  return {"end_to_end_tok_s": e2e, "decode_tok_s": dec, "tokens": gens[0].tokens}


def transformers_ar(name: str, ids: list[int], tokens: int, runs: int) -> dict | None:
  try:
    import torch
    import transformers
  except ImportError:
    print("transformers/torch not installed: skipping the transformers baseline")
    return None
  with tempfile.TemporaryDirectory() as tmp:
    (Path(tmp) / "m.gguf").symlink_to(get_spec(name).locate())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, gguf_file="m.gguf", dtype=torch.float32).eval()
  x = torch.tensor([ids])
  kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

  def run(n):
    with torch.no_grad():
      t = time.perf_counter()
      out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
      return time.perf_counter() - t, out[0, len(ids):].tolist()

  run(4)  # warm-up
  e2e, prefill = [], []
  for _ in range(runs):
    total, out = run(tokens)
    first, _ = run(1)
    e2e.append(total)
    prefill.append(first)
  total, first = statistics.median(e2e), statistics.median(prefill)
  return {"end_to_end_tok_s": tokens / total, "decode_tok_s": (tokens - 1) / (total - first),
          "tokens": out}


def llama_cpp_ar(name: str, ids: list[int], tokens: int, runs: int) -> dict | None:
  try:
    import llama_cpp
  except ImportError:
    print("llama-cpp-python not installed: skipping the llama.cpp baseline")
    return None
  llm = llama_cpp.Llama(model_path=str(get_spec(name).locate()), n_ctx=1024, verbose=False)
  times = []
  for _ in range(runs):
    llm.reset()
    t = time.perf_counter()
    n = 0
    for _tok in llm.generate(ids, temp=0.0):
      n += 1
      if n == tokens:
        break
    times.append(time.perf_counter() - t)
  return {"end_to_end_tok_s": tokens / statistics.median(times), "decode_tok_s": None}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--tokens", type=int, default=128)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--no-write", action="store_true", help="do not touch docs/BENCHMARKS.md")
  args = ap.parse_args()

  m = load_model(args.model)
  L = m.config.num_layers
  print(f"[1/2] draft step, {args.model}, context {args.context}: timing {len(FRACTIONS)} "
        f"fractions x 3 plans x {args.rounds} rounds")
  ratios = draft_step_ratios(m, args.context, args.rounds, steps=5)
  for f in FRACTIONS:
    print(f"  {int(f * 100):3d} % of {2 * L} sub-layers active: {ratios[f]:.3f} x full step")
  print(f"  full step: {ratios['full_ms']:.2f} ms")

  ids = m.tokenizer.encode_prompt(PROMPT)
  print(f"[2/2] greedy AR, {len(ids)}-token prompt, {args.tokens} new tokens, "
        f"median of {args.runs}")
  ours = specjax_ar(m, ids, args.tokens, args.runs)
  hf = transformers_ar(args.model, ids, args.tokens, args.runs)
  lcpp = llama_cpp_ar(args.model, ids, args.tokens, args.runs)
  rows = [["specjax (jax fp32)", ours["end_to_end_tok_s"], ours["decode_tok_s"], 1.0]]
  if hf:
    rows.append(["transformers (torch fp32)", hf["end_to_end_tok_s"], hf["decode_tok_s"],
                 hf["end_to_end_tok_s"] / ours["end_to_end_tok_s"]])
  if lcpp:
    rows.append(["llama.cpp (Q4 GGUF)", lcpp["end_to_end_tok_s"], "-",
                 lcpp["end_to_end_tok_s"] / ours["end_to_end_tok_s"]])
  same = None if hf is None else hf["tokens"] == ours["tokens"]
  header = ["engine", "end-to-end tok/s", "decode tok/s", "speed ÷ specjax"]
  print(report.markdown_table(header, rows))
  if same is not None:
    print(f"greedy tokens identical to transformers: {same}")

  figures = {
      "model": args.model,
      "machine": report.machine(),
      "draft_step_ratio": {str(int(f * 100)): round(ratios[f], 4) for f in FRACTIONS},
      "full_step_ms": round(ratios["full_ms"], 3),
      "specjax_tok_s": round(ours["end_to_end_tok_s"], 2),
      "specjax_decode_tok_s": round(ours["decode_tok_s"], 2),
      "transformers_tok_s": round(hf["end_to_end_tok_s"], 2) if hf else None,
      "transformers_decode_tok_s": round(hf["decode_tok_s"], 2) if hf else None,
      "llama_cpp_tok_s": round(lcpp["end_to_end_tok_s"], 2) if lcpp else None,
      "specjax_over_transformers": (
          round(ours["end_to_end_tok_s"] / hf["end_to_end_tok_s"], 3) if hf else None),
      "greedy_identical_to_transformers": same,
  }
  if not args.no_write:
    body = "\n".join([
        f"## Forward pass: draft-step cost and AR speed ({args.model})",
        "",
        f"Machine: {figures['machine']}. Commit {report.git_revision()}.",
        "",
        f"Draft step (T = 1, context {args.context}), random plans with a given share of the "
        f"{2 * L} sub-layers active, median time as a ratio to the full step "
        f"({ratios['full_ms']:.1f} ms):",
        "",
        report.markdown_table(["active sub-layers", "time ÷ full step"],
                              [[f"{int(f * 100)} %", ratios[f]] for f in FRACTIONS]),
        "",
        f"Greedy AR decoding, {len(ids)}-token chat prompt, {args.tokens} new tokens, "
        f"median of {args.runs} runs:",
        "",
        report.markdown_table(header, rows),
    ])
    report.write_section(f"forward-{args.model}", body)
  report.print_json(figures)


if __name__ == "__main__":
  main()
