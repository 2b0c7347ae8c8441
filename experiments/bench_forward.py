"""Step costs (draft at a share of sub-layers, verification) in AR steps, and AR decode
speed against transformers, llama.cpp and the memory-bandwidth roofline.

    python -m experiments.bench_forward [--model smollm2-135m-instruct] [--tokens 128]

Part 1, at context `--context`: the AR step (the dense model, T = 1), verification of
γ + 1 = 5 tokens (`engine.verify_step`), and one draft step (`engine.draft_step`, γ = 1)
under random plans with 25 / 50 / 75 / 100 % of the 2L sub-layers active (with 8-bit weights at
50 and 100 %, QuantSpec's 4-bit MLP weights at 100 %, and at 50 % with a 32k-token head
shortlist), each as a ratio to the AR step beside
its weight bytes over the AR step's (its floor). All are timed round-robin and the median
taken, so machine noise hits them alike.
Part 2: greedy AR decoding of `--tokens` tokens on one prompt: specjax vs HF transformers
(torch, fp32, same GGUF) and llama.cpp when `llama-cpp-python` is installed; medians of
`--runs` runs, prefill included (end-to-end) and decode-only; and the roofline: weight
bytes read per token over a bandwidth this script measures (a jitted reduction over a
1 GiB array).
Writes the `forward-MODEL` section of docs/results/step-costs.md; the last line is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import report
from specjax.bench import llama_cpp
from specjax.cpu_kernels import kernel_status
from specjax.decode.draft_length import step_times
from specjax.decode.generate import generate
from specjax.errors import ConfigError
from specjax.models.loader import GGUF, load_model
from specjax.models.source import gguf_file, resolve
from specjax.plan import DraftPlan
from specjax.quant import (
  quantize_mlp_weights,
  quantize_weights_int8,
  quantize_weights_q4_0,
)

PROMPT = "Explain why the sky is blue to a ten-year-old, in a few short paragraphs."
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
INT8_FRACTIONS = (0.5, 1.0)  # drafts with 8-bit weights (`quantize_weights_int8`)
SHORTLIST = 32768  # a 50 % draft scoring FR-Spec's 32k-token head shortlist (the paper's size)


def random_plan(L: int, frac: float, rng: np.random.Generator) -> DraftPlan:
  """Exactly round(frac * 2L) active sub-layers, chosen at random (plan bits)."""
  on = np.zeros(2 * L, bool)
  on[rng.choice(2 * L, int(round(frac * 2 * L)), replace=False)] = True
  return DraftPlan.from_bits(on)


Q4_0_INPUTS = ("float x", "8-bit x")  # how a `4bit` draft's x meets its Q4_0 copies


def q4_0_inputs() -> tuple[str, ...]:
  """Those of Q4_0_INPUTS this machine runs: x as floats (`gguf_matmul`), and at 8 bits
  (`q4_0_int8_matmul`) where its VNNI loop runs."""
  from specjax import cpu_kernels

  if not cpu_kernels.runs_here("gguf_matmul"):
    return ()
  return Q4_0_INPUTS if cpu_kernels.q4_0_int8_fast() else Q4_0_INPUTS[:1]


def with_shortlist_head(m, plan: DraftPlan, size: int, rng: np.random.Generator
                        ) -> DraftPlan:
  """`plan` scoring `size` head rows, gathered once as the engine does for FR-Spec. The
  ids are random: which rows a shortlist holds does not bear on what it costs."""
  from flax import nnx

  cfg = m.config
  ids = rng.choice(cfg.vocab_size, min(size, cfg.vocab_size), replace=False)
  plan = plan.with_shortlist(ids, cfg.vocab_size)
  rows = nnx.merge(m.graphdef, m.state).shortlist_rows(plan.vocab, plan.weights)
  return plan.replace(head_rows=rows)


def read_bytes(m, plan: DraftPlan) -> int:
  """Weight bytes a step under `plan` reads: its active sub-layers' matrices (their 8-bit
  copies under `plan.weights`) and its LM head (the shortlist's rows when it has one).
  Norms and biases, under 0.1 % of the bytes, are left out. A decode step streams its
  weights once, so this over the dense step's bytes is what the step would cost in AR steps
  if every step streamed at one rate: the floor its measured ratio approaches."""
  cfg = m.config
  attn, mlp = np.asarray(plan.attn), np.asarray(plan.mlp)
  quantised = plan.weights.layers if plan.weights is not None else None
  total = 0
  for l in range(cfg.num_layers):
    for name in ("qkv", "o", "gate_up", "down"):
      group = "attn" if name in ("qkv", "o") else "mlp"
      if not (attn if group == "attn" else mlp)[l]:
        continue
      copy = None if quantised is None else getattr(quantised[l], name)
      own = m.state["blocks"][l][group][name]  # float, or a GGUF file's blocks
      total += _nbytes(own) if copy is None else copy.nbytes
  if plan.head_rows is not None:
    return total + jax.tree.reduce(lambda n, x: n + x.nbytes, plan.head_rows, 0)
  if plan.weights is not None and plan.weights.head is not None:
    return total + plan.weights.head.nbytes
  return total + _nbytes(m.state["embedding" if cfg.tie_embeddings else "lm_head"])


def _nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def step_ratios(m, context: int, rounds: int, steps: int, gamma: int = 4,
                shortlist: int = SHORTLIST) -> dict:
  """Median ms of the AR step, verification of γ+1 tokens and draft steps at each share of
  active sub-layers (fp32 weights; 8-bit weights; a shortlisted head), round-robin; ratios
  to the AR step, each beside its bytes over the AR step's (its floor)."""
  cfg = m.config
  rng = np.random.default_rng(0)
  plans = {f: [random_plan(cfg.num_layers, f, rng) for _ in range(3)] for f in FRACTIONS}
  # The same plans reading 8-bit copies of every matrix (Int8WeightsDrafter's drafts).
  int8 = quantize_weights_int8(m.state, cfg.num_layers)
  plans |= {(f, 8): [p.replace(weights=int8) for p in plans[f]] for f in INT8_FRACTIONS}
  # Every sub-layer reading QuantSpec's 4-bit MLP weights (the paper's draft weights).
  plans[(1.0, 4)] = [p.replace(weights=quantize_mlp_weights(m.state, cfg.num_layers))
                     for p in plans[1.0]]
  # The 50 % plans scoring a shortlist (FR-Spec's drafts, `self_sd+frspec`)
  plans[(0.5, "shortlist")] = [with_shortlist_head(m, p, shortlist, rng) for p in plans[0.5]]
  # Every sub-layer reading Q4_0 copies (`4bit`), alone and scoring a shortlist
  # (`4bit+frspec`), x as floats and at 8 bits: the two in one run.
  for inputs in q4_0_inputs():
    q4 = quantize_weights_q4_0(m.state, cfg.num_layers, int8_inputs=inputs == Q4_0_INPUTS[1])
    full = [p.replace(weights=q4) for p in plans[1.0]]
    plans[(1.0, inputs)] = full
    plans[(1.0, inputs, "shortlist")] = [with_shortlist_head(m, p, shortlist, rng)
                                         for p in full]
  t = step_times(m.graphdef, m.state, cfg, plans, gammas=(gamma,), context=context,
                 repeats=rounds * steps)
  dense = read_bytes(m, DraftPlan.full(cfg.num_layers))
  floor = {key: statistics.mean(read_bytes(m, p) for p in group) / dense
           for key, group in plans.items()}
  return {"ar_ms": t.ar * 1e3, "verify_ms": t.verify[gamma] * 1e3,
          "verify_over_ar": t.verify[gamma] / t.ar,
          "draft_over_ar": {f: t.drafts[f] / t.ar for f in FRACTIONS},
          "int8_draft_over_ar": {f: t.drafts[(f, 8)] / t.ar for f in INT8_FRACTIONS},
          "int4_mlp_draft_over_ar": t.drafts[(1.0, 4)] / t.ar,
          "shortlist_draft_over_ar": t.drafts[(0.5, "shortlist")] / t.ar,
          "q4_0_draft_over_ar": {key[1:]: t.drafts[key] / t.ar for key in plans
                                 if isinstance(key, tuple) and key[1] in Q4_0_INPUTS},
          "floor": floor, "gamma": gamma,
          "head_share": read_bytes(m, DraftPlan.from_bits(np.zeros(2 * cfg.num_layers, bool)))
                        / dense}


def measured_bandwidth(gib: float = 1.0, repeats: int = 15) -> float:
  """Bytes/s of a jitted reduction over a `gib` GiB float32 array (the best of `repeats`:
  a roofline is what the machine can reach): the read bandwidth XLA attains here."""
  x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    f(x).block_until_ready()
    ts.append(time.perf_counter() - t)
  return x.nbytes / min(ts)


def weight_bytes(m) -> int:
  """Bytes of weights one decode step reads: every parameter, but an untied embedding
  table (its lookup reads one row; a tied one is read whole, as the LM head)."""
  total = sum(x.nbytes for x in jax.tree.leaves(m.state))
  if not m.config.tie_embeddings:
    total -= sum(x.nbytes for x in jax.tree.leaves(m.state["embedding"]))
  return total


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
  src = resolve(name)
  if src.kind == "folder":  # a checkpoint transformers reads as it is
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src.path, dtype=torch.float32).eval()
  else:
    with tempfile.TemporaryDirectory() as tmp:
      (Path(tmp) / "m.gguf").symlink_to(gguf_file(name))
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
  """llama.cpp's greedy decoding of the same GGUF file (`specjax.bench.llama_cpp`: its
  own quantised weights and kernels, on every core), timed as the other engines: medians
  of `runs` runs, end-to-end and decode-only (from the first token's arrival), after a
  warm-up run."""
  try:
    baseline = llama_cpp.LlamaCppBaseline(name, context=1024)
  except (llama_cpp.MissingBaselineError, ConfigError) as err:  # no binding, or no GGUF
    print(f"{err}\nskipping the llama.cpp baseline")
    return None
  baseline.generate(ids, 4)  # warm-up
  timed = [baseline.generate(ids, tokens) for _ in range(runs)]
  first = statistics.median(t["prefill_s"] for t in timed)
  total = statistics.median(t["prefill_s"] + t["decode_s"] for t in timed)
  return {"end_to_end_tok_s": tokens / total, "decode_tok_s": (tokens - 1) / (total - first),
          "tokens": timed[0]["tokens"], "threads": baseline.threads}


def engine_label(dtype: str) -> str:
  return "jax, the GGUF's blocks" if dtype == GGUF else "jax fp32" if dtype in (
      "auto", "float32") else f"jax {dtype}"


def matmul_sentence(dtype: str) -> str:
  """What the steps' matmuls run on, for the section's prose."""
  if dtype == GGUF:
    return (f"Weights are the GGUF file's own blocks (`--dtype gguf`): every matmul of the "
            f"target's steps (AR, verification) and of a layer-skipping draft reads them "
            f"through `cpu_kernels.gguf_matmul` ({kernel_status('gguf_matmul')}); the 8-bit "
            f"and 4-bit drafts' copies are quantised from them.")
  return (f"The float32 matmuls of every step (AR, draft, verification) take the few-row "
          f"kernel (`cpu_kernels.f32_matmul`: {kernel_status('f32_matmul')}); "
          f"`SPECJAX_CPU_KERNELS=int8_matmul` measures XLA's dots instead.")


def ours_vs_llama_cpp(dtype: str) -> str:
  if dtype == GGUF:
    return ("specjax reads the same blocks here and computes with the float32 weights they "
            "stand for, activations unrounded.")
  return ("specjax's float32 weights are the dequantised GGUF; its 8-bit drafts (`8bit`) "
          "are the counterpart of llama.cpp's low-bit reads.")


def section_name(model: str, dtype: str) -> str:
  """`forward-MODEL`, with the dtype appended when it is not the CPU default."""
  return f"forward-{model}" if dtype in ("auto", "float32") else f"forward-{model}-{dtype}"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tokens", type=int, default=128)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=5)
  report.common_args(ap, results=False)
  args = ap.parse_args()

  m = load_model(args.model, dtype=args.dtype)
  L = m.config.num_layers
  print(f"[1/2] step costs, {args.model}, context {args.context}: AR step, verify, draft at "
        f"{len(FRACTIONS)} fractions x 3 plans, {args.rounds} rounds")
  r = step_ratios(m, args.context, args.rounds, steps=5)
  floor = r["floor"]
  step_rows = [[f"verify γ+1 = {r['gamma'] + 1} tokens", r["verify_over_ar"], 1.0]]
  step_rows += [[f"draft step, {int(f * 100)} % of {2 * L} sub-layers", r["draft_over_ar"][f],
                 floor[f]] for f in FRACTIONS]
  step_rows += [[f"draft step, {int(f * 100)} % of {2 * L} sub-layers, 8-bit weights",
                 r["int8_draft_over_ar"][f], floor[(f, 8)]] for f in INT8_FRACTIONS]
  step_rows.append([f"draft step, 100 % of {2 * L} sub-layers, 4-bit MLP weights (QuantSpec's)",
                    r["int4_mlp_draft_over_ar"], floor[(1.0, 4)]])
  shortlist = min(SHORTLIST, m.config.vocab_size)
  step_rows.append([f"draft step, 50 % of {2 * L} sub-layers, head over {shortlist} tokens",
                    r["shortlist_draft_over_ar"], floor[(0.5, "shortlist")]])
  for key, ratio in r["q4_0_draft_over_ar"].items():
    head = f", head over {shortlist} tokens" if len(key) > 1 else ""
    step_rows.append([f"draft step, 100 % of {2 * L} sub-layers, Q4_0 weights ({key[0]}){head}",
                      ratio, floor[(1.0, *key)]])
  step_header = ["step", "time ÷ AR step", "weight bytes ÷ AR step's"]
  print(report.markdown_table(step_header, step_rows))
  print(f"  AR step: {r['ar_ms']:.2f} ms, verify: {r['verify_ms']:.2f} ms")

  ids = m.tokenizer.encode_prompt(PROMPT)
  print(f"[2/2] greedy AR, {len(ids)}-token prompt, {args.tokens} new tokens, "
        f"median of {args.runs}")
  ours = specjax_ar(m, ids, args.tokens, args.runs)
  bandwidth = measured_bandwidth()
  roofline = bandwidth / weight_bytes(m)
  hf = transformers_ar(args.model, ids, args.tokens, args.runs)
  lcpp = llama_cpp_ar(args.model, ids, args.tokens, args.runs)
  rows = [["roofline (weights ÷ measured bandwidth)", "-", roofline,
           roofline / ours["decode_tok_s"]],
          [f"specjax ({engine_label(args.dtype)})", ours["end_to_end_tok_s"],
           ours["decode_tok_s"], 1.0]]
  if hf:
    rows.append(["transformers (torch fp32)", hf["end_to_end_tok_s"], hf["decode_tok_s"],
                 hf["end_to_end_tok_s"] / ours["end_to_end_tok_s"]])
  if lcpp:
    rows.append([f"llama.cpp (the GGUF's quantised weights, {lcpp['threads']} threads)",
                 lcpp["end_to_end_tok_s"], lcpp["decode_tok_s"],
                 lcpp["end_to_end_tok_s"] / ours["end_to_end_tok_s"]])
  same = None if hf is None else hf["tokens"] == ours["tokens"]
  header = ["engine", "end-to-end tok/s", "decode tok/s", "speed ÷ specjax"]
  print(report.markdown_table(header, rows))
  if same is not None:
    print(f"greedy tokens identical to transformers: {same}")
  lcpp_agree = gguf_mb = None
  if lcpp is not None:
    lcpp_agree = llama_cpp.shared_prefix(lcpp["tokens"], ours["tokens"])
    gguf_mb = gguf_file(args.model).stat().st_size / 1e6
    print(f"llama.cpp's greedy tokens agree with specjax's for the first {lcpp_agree} of "
          f"{args.tokens} (it computes with its quantised weights and activations)")
  print(f"specjax decodes at {ours['decode_tok_s'] / roofline:.0%} of the roofline "
        f"({weight_bytes(m) / 1e6:.0f} MB of weights per token at {bandwidth / 1e9:.1f} GB/s)")

  figures = {
      "model": args.model,
      "dtype": args.dtype,
      "machine": report.machine(),
      "draft_step_over_ar": {str(int(f * 100)): round(r["draft_over_ar"][f], 4)
                             for f in FRACTIONS},
      "int8_draft_step_over_ar": {str(int(f * 100)): round(r["int8_draft_over_ar"][f], 4)
                                  for f in INT8_FRACTIONS},
      "int4_mlp_draft_step_over_ar": {"100": round(r["int4_mlp_draft_over_ar"], 4)},
      "shortlist_draft_step_over_ar": {"50": round(r["shortlist_draft_over_ar"], 4),
                                       "shortlist": shortlist},
      "q4_0_draft_step_over_ar": {" ".join(("100", *key)): round(v, 4)
                                  for key, v in r["q4_0_draft_over_ar"].items()},
      "draft_step_bytes_over_ar": {str(int(f * 100)): round(floor[f], 4) for f in FRACTIONS},
      "head_share_of_bytes": round(r["head_share"], 4),
      "int8_kernel": kernel_status(),
      "f32_few_row_kernel": kernel_status("f32_matmul"),
      "verify_over_ar": round(r["verify_over_ar"], 4),
      "ar_step_ms": round(r["ar_ms"], 3),
      "verify_ms": round(r["verify_ms"], 3),
      "bandwidth_gb_s": round(bandwidth / 1e9, 2),
      "weight_mb": round(weight_bytes(m) / 1e6, 1),
      "roofline_tok_s": round(roofline, 2),
      "specjax_share_of_roofline": round(ours["decode_tok_s"] / roofline, 4),
      "specjax_tok_s": round(ours["end_to_end_tok_s"], 2),
      "specjax_decode_tok_s": round(ours["decode_tok_s"], 2),
      "transformers_tok_s": round(hf["end_to_end_tok_s"], 2) if hf else None,
      "transformers_decode_tok_s": round(hf["decode_tok_s"], 2) if hf else None,
      "llama_cpp_tok_s": round(lcpp["end_to_end_tok_s"], 2) if lcpp else None,
      "llama_cpp_decode_tok_s": round(lcpp["decode_tok_s"], 2) if lcpp else None,
      "llama_cpp_agreeing_tokens": lcpp_agree,
      "specjax_over_llama_cpp": (
          round(ours["end_to_end_tok_s"] / lcpp["end_to_end_tok_s"], 3) if lcpp else None),
      "specjax_over_transformers": (
          round(ours["end_to_end_tok_s"] / hf["end_to_end_tok_s"], 3) if hf else None),
      "greedy_identical_to_transformers": same,
  }
  if args.write_docs:
    body = "\n".join([
        f"## Forward pass: draft-step cost and AR speed ({args.model}"
        f"{'' if args.dtype in ('auto', 'float32') else ', --dtype ' + args.dtype})",
        "",
        f"Machine: {figures['machine']}. Commit {report.git_revision()}.",
        "",
        f"Steps at context {args.context} as a ratio to the AR step ({r['ar_ms']:.1f} ms, "
        f"the dense model at T = 1): verification of γ + 1 tokens, and a draft step under "
        f"random plans with a given share of the {2 * L} sub-layers active (medians, "
        f"round-robin). {matmul_sentence(args.dtype)} Beside each, the "
        f"weight bytes it reads over the AR step's, what it would cost if every step "
        f"streamed its weights at one rate: the LM head "
        f"is {r['head_share']:.0%} of the bytes, and every draft over the full vocabulary reads "
        f"it whole. The 4-bit row is QuantSpec's draft weights (its MLP matrices only, read "
        f"by `cpu_kernels.int4_matmul`: {kernel_status('int4_matmul')}) over this "
        f"full-precision cache. The last row scores a {shortlist}-token shortlist (FR-Spec's size; "
        f"random ids, which do not bear on the cost):",
        "",
        report.markdown_table(step_header, step_rows),
        "",
        f"Greedy AR decoding, {len(ids)}-token chat prompt, {args.tokens} new tokens, "
        f"median of {args.runs} runs; the roofline reads {weight_bytes(m) / 1e6:.0f} MB of "
        f"weights per token at the {bandwidth / 1e9:.1f} GB/s a jitted reduction reaches here "
        f"(specjax decodes at {ours['decode_tok_s'] / roofline:.0%} of it):",
        "",
        report.markdown_table(header, rows),
    ] + ([] if lcpp is None else [
        "",
        f"llama.cpp reads the GGUF's own quantised weights ({gguf_mb:.0f} MB) and quantises "
        f"activations for its dots, so it streams a fraction of float32's bytes and computes "
        f"other numbers: its greedy tokens agree with specjax's for the first {lcpp_agree} of "
        f"{args.tokens}. {ours_vs_llama_cpp(args.dtype)} llama.cpp's build: "
        f"{llama_cpp.build_features()}.",
    ]))
    report.write_section(section_name(args.model, args.dtype), body)
  report.print_json(figures)


if __name__ == "__main__":
  main()
