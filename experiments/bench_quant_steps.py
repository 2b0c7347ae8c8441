"""A decode step on QuantSpec's quantised KV cache against one on the float32 cache, and
what the kernel reading the codes takes of it.

    python -m experiments.bench_quant_steps [--model smollm2-135m-instruct] [--gamma 4]
        [--contexts 256,2048] [--repeats 15]

Per context, one random prompt is prefilled into a float32 cache and into the quantised
one (`QuantKV()`: 8-bit codes, a float32 buffer of the newest tokens). Then, in one process
and round-robin, so that the machine's drift hits every row alike:

- the AR step and the verification of γ + 1 tokens on each cache (the engine's own,
  greedy, float32 weights);
- QuantSpec's draft step on the quantised cache (the upper 4 bits of its codes), with the
  8-bit draft weights (`quantspec.default_weight_bits`) and the paper's 4-bit MLP weights;
- the kernels alone, every layer chained in one jitted call as a step makes them: the
  codes' softmax partial (`cpu_kernels.quant_partials`, at 8 and at 4 bits, for an AR
  step's and a verification's rows) and `cpu_kernels.f32_attention` over as many float32
  slots (what the codes' kernel stands against).

Step rows are medians over the float32 cache's AR step of the same pass. The last line
is JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments import report
from specjax import cpu_kernels, ops
from specjax.decode.generate import decode_step, prefill_prompt
from specjax.decode.round import Draft, draft_step, verify_step
from specjax.jit_cache import compiled
from specjax.models.loader import load_model
from specjax.plan import DraftPlan
from specjax.quant import quantize_mlp_weights, quantize_weights_int8
from specjax.quant_kv_cache import QuantKV
from specjax.sampling import SamplingParams


def step_calls(m, caches: dict, gamma: int) -> dict:
  """{row name: call} for the steps; each call runs one step at its cache's length (a
  step donates its cache: the returned one is carried, its length reset)."""
  cfg, gd = m.config, m.graphdef
  full, greedy, key = DraftPlan.full(cfg.num_layers), SamplingParams(), jax.random.key(0)
  tok, last, one = jnp.ones((1,), jnp.int32), jnp.int32(1), jnp.int32(1)
  draft = Draft(n=jnp.int32(gamma), tokens=jnp.ones((gamma,), jnp.int32),
                confidence=jnp.ones((gamma,), jnp.float32), q_rows=None)
  w8 = quantize_weights_int8(m.state, cfg.num_layers)
  w4 = quantize_mlp_weights(m.state, cfg.num_layers)
  calls = {}
  for name, cache in caches.items():
    holder, length = {"cache": cache}, int(cache.length)

    def carried(fn, holder=holder, length=length):
      def run():
        out, c = fn(holder["cache"])
        holder["cache"] = c.with_length(length)
        jax.block_until_ready(out)
      return run

    ar = compiled(decode_step, m.state, cache, tok, full, key, graphdef=gd, sampling=greedy)
    verify = compiled(verify_step, m.state, cache, last, draft, full, key, graphdef=gd,
                      sampling=greedy)
    calls[f"AR, {name}"] = carried(lambda c, ar=ar: ar(m.state, c, tok, full, key))
    calls[f"verify T={gamma + 1}, {name}"] = carried(
        lambda c, verify=verify: verify(m.state, c, last, draft, full, key))
    if name != "8-bit cache":
      continue
    for label, weights in (("8-bit weights", w8), ("4-bit MLP weights", w4)):
      plan = full.replace(kv_bits=4, weights=weights)
      exe = compiled(draft_step, m.state, cache, last, plan, key, one, graphdef=gd,
                     vocab=cfg.vocab_size, gamma=1, threshold=0.0, sampling=greedy)

      def run(exe=exe, plan=plan, holder=holder):
        jax.block_until_ready(exe(m.state, holder["cache"], last, plan, key, one).n)
      calls[f"QuantSpec draft, 4-bit KV, {label}"] = run
  return calls


def kernel_calls(m, fp_cache, q_cache, gamma: int) -> dict:
  """{row name: call}: each kernel over every layer in one jitted call, for an AR step's
  rows and a verification's, its outputs summed so that none is dropped."""
  cfg = m.config
  K, H, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
  G = cfg.num_heads // K
  Q = int(q_cache.quantized)
  rng = np.random.default_rng(0)
  calls = {}
  for T in (1, gamma + 1):
    rows = jnp.asarray(rng.normal(size=(1, K, G * T, H)), jnp.float32)
    row_pos = jnp.full((1, G * T), Q + 64, jnp.int32)
    for bits in (8, 4):
      @jax.jit
      def codes(rows, k_codes, v_codes, bits=bits, row_pos=row_pos):
        total = jnp.float32(0)
        for l in range(L):
          o, mx, s = cpu_kernels.quant_partials(rows + total, row_pos, Q, k_codes[l],
                                                v_codes[l], bits=bits, scale=cfg.scale,
                                                window=None)
          total = total + o.sum() * 1e-30 + mx.sum() * 1e-30 + s.sum() * 1e-30
        return total

      calls[f"codes kernel, {bits}-bit, T={T}"] = (
          lambda codes=codes, rows=rows: codes(rows, q_cache.k_codes, q_cache.v_codes)
          .block_until_ready())
    q = rows.reshape(1, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(1, T, K * G, H)
    q_pos = jnp.full((1, T), Q + 64, jnp.int32)

    @jax.jit
    def dense(q, ks, vs, positions, valid, q_pos=q_pos):
      total = jnp.float32(0)
      for l in range(L):
        mx, s, acc = cpu_kernels.f32_attention(q + total, q_pos, ks[l], vs[l], positions,
                                               valid, jnp.int32(Q), scale=cfg.scale,
                                               window=None, xla=None)
        total = total + acc.sum() * 1e-30 + mx.sum() * 1e-30 + s.sum() * 1e-30
      return total

    positions = jnp.arange(fp_cache.k[0].shape[2], dtype=jnp.int32)[None]
    calls[f"f32_attention over {Q} float32 slots, T={T}"] = (
        lambda dense=dense, q=q: dense(q, fp_cache.k, fp_cache.v, positions, positions < Q)
        .block_until_ready())
  return calls


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--contexts", default="256,2048")
  ap.add_argument("--repeats", type=int, default=15)
  report.common_args(ap, results=False)
  args = ap.parse_args()
  if args.dtype not in ("auto", "float32"):
    sys.exit(f"bench_quant_steps times float32 steps, not --dtype {args.dtype}")
  if not ops.quant_codes_on_cpu():
    sys.exit("bench_quant_steps times the C++ kernels that read the codes: "
             f"{cpu_kernels.kernel_status('quant_attention')} on a {jax.default_backend()} "
             "backend")

  m = load_model(args.model, dtype="float32")
  sections, figures = [], {}
  for context in (int(c) for c in args.contexts.split(",")):
    prompt = list(np.random.default_rng(context).integers(3, m.config.vocab_size, size=context))
    prefill = lambda kv: prefill_prompt(m.graphdef, m.state, m.config, prompt,
                                        max_new_tokens=64, kv_cache=kv).cache
    fp_cache, q_cache = prefill(None), prefill(QuantKV())
    Q, buffered = int(q_cache.quantized), int(q_cache.buffered)
    # The kernels first: the steps donate the caches they are given.
    kernels = {name: statistics.median(v) for name, v in report.round_robin(
        kernel_calls(m, fp_cache, q_cache, args.gamma), args.repeats).items()}
    caches = {"float32 cache": fp_cache, "8-bit cache": q_cache}
    steps = report.round_robin(step_calls(m, caches, args.gamma), args.repeats)
    base = steps["AR, float32 cache"]
    step_rows = [[name, statistics.median(v), statistics.median(
        [x / b for x, b in zip(v, base)])] for name, v in steps.items()]
    head = (f"Context {context}: {Q} tokens quantised, {buffered} in the float32 buffer; "
            f"medians of {args.repeats} passes.")
    steps_table = report.markdown_table(["step", "ms", "÷ AR on the float32 cache"], step_rows)
    kernel_table = report.markdown_table(
        [f"kernel, all {m.config.num_layers} layers in one call", "ms"],
        [[k, v] for k, v in kernels.items()])
    print(head, steps_table, kernel_table, sep="\n\n")
    sections.append("\n\n".join([head, steps_table, kernel_table]))
    figures[str(context)] = {
        "quantized": Q, "steps_ms": {r[0]: round(r[1], 3) for r in step_rows},
        "over_fp_ar": {r[0]: round(r[2], 4) for r in step_rows},
        "kernels_ms": {k: round(v, 3) for k, v in kernels.items()}}
  if args.write_docs:
    report.write_section(f"quant-steps-{args.model}", "\n\n".join([
        f"## Steps on the quantised KV cache, and its kernel ({args.model})",
        f"Machine: {report.machine()}. Commit {report.git_revision()}.",
        "Each step (the engine's, float32 weights, greedy) on the float32 cache and on "
        "QuantSpec's 8-bit cache, QuantSpec's draft reading the upper 4 bits, and the "
        "C++ kernels alone over every layer:", *sections]))
  report.print_json({"model": args.model, "machine": report.machine(), "gamma": args.gamma,
                     "repeats": args.repeats, "contexts": figures})


if __name__ == "__main__":
  main()
