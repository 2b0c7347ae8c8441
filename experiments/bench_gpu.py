"""GPU step costs and AR decode speed in bf16, for real and random-init models.

    python -m experiments.bench_gpu --models smollm2-135m-instruct,shape:qwen2-1.5b,shape:llama-8b \
        --out gpu.jsonl                       # on the GPU machine: one JSON line per model
    python -m experiments.bench_gpu --report gpu.jsonl --write-docs     # anywhere: the section

Per model, at context `--context`, as ratios to the AR step (the dense model, T = 1):
verification of γ + 1 = 5 tokens; a draft step under random plans with 25 / 50 / 75 % of
the 2L sub-layers on, frozen into the executable (the device loop's GPU default, no
conditional) and, at 50 %, traced (one `lax.cond` per sub-layer, the host loop's plans),
dispatched (the same plan as data on the host, a program per sub-layer it runs:
`plan_path="dispatch"`, timed as host calls only) and frozen in a draft loop of unknown length (as a drafter with an early stop loops: on a
GPU its predicate is a host round trip per step, which a fixed-length draft, the other
rows, no longer pays); and a draft step with every sub-layer on reading 8-bit weights
(every matmul and the LM head, `quantize_weights_int8`) or QuantSpec's 4-bit MLP weights
(`quantize_mlp_weights`), each multiplied by XLA's dot or by the Pallas few-row kernel
(`pallas_kernels/quant_matmul.py`): which of them a GPU draft should default to. Timed two ways: each step a call from
the host (`--chain` calls dispatched back to back, one wait: what the host loop pays,
dispatch included), and `--loop-steps` steps chained inside one jitted loop (what the
device loop pays: device time alone). Then greedy AR decoding of `--tokens` tokens
(`generate`, the on-device loop), decode tokens/s against the HBM roofline: weight bytes
per token over the bandwidth a jitted reduction reaches here. `shape:NAME` models are
random-init at a real model's shapes (`SHAPES`): timing does not depend on the weights'
values, and no 8B checkpoint fits this project. `--drafts` times some of the draft rows
(compiling dominates a GPU run: each model's compiles are counted and timed apart). Every
model's figures are appended to `--out` as they finish; the last line of the output is JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections.abc import Collection
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from experiments import report
from experiments.bench_forward import PROMPT, measured_bandwidth, random_plan, weight_bytes
from specjax.config import ModelConfig, tiny_config
from specjax.decode.draft_length import step_times
from specjax.decode.generate import generate, precision_name
from specjax.model import init_model
from specjax.models.loader import DTYPE_CHOICES, load_model, resolve_dtype, with_precision
from specjax.plan import DraftPlan
from specjax.quant import quantize_mlp_weights, quantize_weights_int8, with_kernel

# Published shapes: SmolLM2-135M, Qwen2.5-1.5B (config.json of Qwen/Qwen2.5-1.5B) and Llama-3-8B
# (Meta's params.json: 32 layers, D 4096, F 14336, 32 / 8 heads, vocab 128256).
SHAPES = {
    # SmolLM2-135M-Instruct (read from its GGUF), for checks that must not wait for weights.
    "smollm2-135m": ModelConfig(arch="llama", num_layers=30, embed_dim=576, hidden_dim=1536,
                                num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152,
                                rope_base=1e5, rope_interleaved=True, tie_embeddings=True,
                                max_context=8192),
    "qwen2-1.5b": ModelConfig(arch="qwen2", num_layers=28, embed_dim=1536, hidden_dim=8960,
                              num_heads=12, num_kv_heads=2, head_dim=128, vocab_size=151936,
                              rope_base=1e6, qkv_bias=True, tie_embeddings=True,
                              max_context=32768),
    "llama-8b": ModelConfig(arch="llama", num_layers=32, embed_dim=4096, hidden_dim=14336,
                            num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256,
                            rope_base=5e5, tie_embeddings=False, max_context=8192),
    "tiny": tiny_config("llama"),  # a CPU smoke run (tests/test_bench_gpu_script.py)
}
FRACTIONS = (0.25, 0.5, 0.75)
EARLY_STOP = "0.5 early stop"
DISPATCHED = "dispatched 0.5"  # the traced row's plan, `plan_path="dispatch"`: host calls only
DRAFT_LABELS = [("0.25", "draft, 25 % of sub-layers, frozen"),
                ("0.5", "draft, 50 %, frozen"), ("0.75", "draft, 75 %, frozen"),
                ("traced 0.5", "draft, 50 %, traced (`lax.cond` per sub-layer)"),
                ("dispatched 0.5", "draft, 50 %, a program per sub-layer from the host"),
                ("0.5 early stop", "draft, 50 %, frozen, in a loop of unknown length"),
                ("8-bit", "draft, all sub-layers, 8-bit weights"),
                ("4-bit MLP", "draft, all sub-layers, 4-bit MLP weights"),
                ("8-bit pallas", "draft, all sub-layers, 8-bit weights, Pallas matmul"),
                ("4-bit MLP pallas", "draft, all sub-layers, 4-bit MLP weights, Pallas matmul")]
DRAFT_KEYS = tuple(key for key, _ in DRAFT_LABELS)
# HBM bandwidth in GB/s from NVIDIA's datasheets (H200: 4.8 TB/s; H100 SXM: 3.35 TB/s).
DATASHEET_GB_S = {"NVIDIA H200": 4800.0, "NVIDIA H100 80GB HBM3": 3350.0}
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax's, since 0.4


class Model:
  """What the measurements need of a model: config, graphdef, state, prompt ids."""

  def __init__(self, name: str, dtype: str):
    self.name = name
    if name.startswith("shape:"):
      self.config = with_precision(SHAPES[name.removeprefix("shape:")], dtype)
      model = init_model(self.config, seed=0, dtype=resolve_dtype(dtype))
      self.graphdef, self.state = nnx.split(model)
      self.ids = list(range(1, 33))  # random weights: any 32 ids will do
    else:
      m = load_model(name, dtype=dtype)
      self.config, self.graphdef, self.state = m.config, m.graphdef, m.state
      self.ids = m.tokenizer.encode_prompt(PROMPT)


def draft_plans(m: Model, keys: Collection[str] = DRAFT_KEYS) -> tuple[dict, float]:
  """{name: [plan]} of the measured drafts named in `keys` (see the module docstring), and
  the seconds quantising the weights took. The random plans are the same whichever are
  asked for."""
  L = m.config.num_layers
  rng = np.random.default_rng(0)
  full = DraftPlan.full(L)
  plans = {str(f): [random_plan(L, f, rng).freeze()] for f in FRACTIONS}
  plans["traced 0.5"] = [random_plan(L, 0.5, rng)]
  plans[DISPATCHED] = plans["traced 0.5"]
  plans[EARLY_STOP] = plans["0.5"]  # the same draft, as an early-stopping drafter loops
  t0 = time.perf_counter()
  for key, quantize in (("8-bit", quantize_weights_int8), ("4-bit MLP", quantize_mlp_weights)):
    if key in keys or f"{key} pallas" in keys:
      weights = quantize(m.state, L)
      plans[key] = [full.replace(weights=weights).freeze()]
      plans[f"{key} pallas"] = [full.replace(weights=with_kernel(weights, "pallas")).freeze()]
  return {k: v for k, v in plans.items() if k in keys}, time.perf_counter() - t0


class CompileTimer:
  """The XLA compiles made while it is entered, counted and timed (jax.monitoring), so a
  model's figures give compile time apart from timing: on the H200 a model's steps took
  43-81 s to compile and time per mode, which decides what fits in a lease."""

  def __enter__(self) -> "CompileTimer":
    self.seconds, self.count = 0.0, 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    return self

  def _on_event(self, event: str, seconds: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
      self.seconds += seconds
      self.count += 1

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_event)


def step_costs(m: Model, plans: dict, context: int, repeats: int, chain: int,
               gamma: int = 4) -> dict:
  """Step times in ms and as ratios to the AR step, each step a call from the host (as
  the host loop runs them): see the module docstring."""
  t0 = time.perf_counter()
  with CompileTimer() as compiles:
    t = step_times(m.graphdef, m.state, m.config, plans, gammas=(gamma,), context=context,
                   repeats=repeats, chain=chain, early_stop=(EARLY_STOP,),
                   dispatched=(DISPATCHED,))
  return {"ar_ms": t.ar * 1e3, "verify_ms": t.verify[gamma] * 1e3,
          "verify_over_ar": t.verify[gamma] / t.ar,
          "draft_over_ar": {k: v / t.ar for k, v in t.drafts.items()},
          "draft_ms": {k: v * 1e3 for k, v in t.drafts.items()},
          "gamma": gamma, "compile_and_time_s": time.perf_counter() - t0,
          "compile_s": compiles.seconds, "compiles": compiles.count}


def loop_costs(m: Model, plans: dict, context: int, repeats: int, steps: int,
               gamma: int = 4) -> dict:
  """The same steps, `steps` of each chained inside one jitted loop (`step_times(loop=)`):
  device time per step, no host dispatch. Medians of `repeats` loops."""
  t0 = time.perf_counter()
  plans = {k: v for k, v in plans.items() if k != DISPATCHED}  # host calls, not a loop
  with CompileTimer() as compiles:
    t = step_times(m.graphdef, m.state, m.config, plans, gammas=(gamma,), context=context,
                   repeats=repeats, loop=steps, early_stop=(EARLY_STOP,))
  return {"loop_ar_ms": t.ar * 1e3, "loop_verify_over_ar": t.verify[gamma] / t.ar,
          "loop_draft_over_ar": {k: v / t.ar for k, v in t.drafts.items()},
          "loop_steps": steps, "loop_compile_and_time_s": time.perf_counter() - t0,
          "loop_compile_s": compiles.seconds, "loop_compiles": compiles.count}


def ar_decode(m: Model, tokens: int, runs: int) -> dict:
  """Median decode tokens/s of greedy AR (`generate`), and its share of the roofline."""
  gens = [generate(m.graphdef, m.state, m.config, m.ids, max_new_tokens=tokens, eos_ids=())
          for _ in range(runs + 1)][1:]  # the first compiles
  decode = float(np.median([g.decode_tokens_per_s for g in gens]))
  bandwidth = measured_bandwidth()
  roofline = bandwidth / weight_bytes(m)
  return {"decode_tok_s": decode, "bandwidth_gb_s": bandwidth / 1e9,
          "weight_mb": weight_bytes(m) / 1e6, "roofline_tok_s": roofline,
          "share_of_roofline": decode / roofline}


def measure(name: str, args) -> dict:
  t0 = time.perf_counter()
  m = Model(name, args.dtype)
  jax.block_until_ready(m.state)
  figures = {"model": name, "dtype": precision_name(m.config, m.state), "context": args.context,
             "machine": report.machine(),
             "commit": report.git_revision() or "unknown",
             "command": "python -m experiments.bench_gpu " + shlex.join(sys.argv[1:]),
             "load_s": time.perf_counter() - t0}
  print(f"{name}: loaded in {figures['load_s']:.1f} s; step costs", flush=True)
  plans, figures["quantize_s"] = draft_plans(m, args.drafts)
  figures |= step_costs(m, plans, args.context, args.repeats, args.chain)
  if args.loop_steps:
    figures |= loop_costs(m, plans, args.context, args.repeats, args.loop_steps)
    print(f"{name}: in the loop, AR {figures['loop_ar_ms']:.3f} ms, verify ÷ AR "
          f"{figures['loop_verify_over_ar']:.3f}, drafts ÷ AR "
          f"{ {k: round(v, 3) for k, v in figures['loop_draft_over_ar'].items()} } "
          f"({figures['loop_compiles']} compiles, {figures['loop_compile_s']:.1f} s)", flush=True)
  print(f"{name}: AR {figures['ar_ms']:.3f} ms, verify ÷ AR {figures['verify_over_ar']:.3f}, "
        f"drafts ÷ AR { {k: round(v, 3) for k, v in figures['draft_over_ar'].items()} } "
        f"({figures['compiles']} compiles, {figures['compile_s']:.1f} s)", flush=True)
  figures |= ar_decode(m, args.tokens, args.runs)
  print(f"{name}: decode {figures['decode_tok_s']:.1f} tok/s, "
        f"{figures['share_of_roofline']:.0%} of the roofline", flush=True)
  return figures


def section(rows: list[dict], bench: list[dict] | None = None, bench_command: str = "") -> str:
  """The `gpu-forward` section of docs/results/gpu.md from the JSON lines, and the records
  of a `specjax bench` run on the same machine (`bench`) when given."""
  first = rows[0]
  steps = [["AR step (ms)"] + [f"{r['ar_ms']:.3f}" for r in rows],
           ["verify γ + 1 = 5 ÷ AR"] + [f"{r['verify_over_ar']:.3f}" for r in rows]]
  for key, label in DRAFT_LABELS:
    steps.append([label + " ÷ AR"] + [_ratio(r["draft_over_ar"], key) for r in rows])
  looped = [r for r in rows if "loop_ar_ms" in r]
  in_loop = [["AR step (ms)"] + [f"{r['loop_ar_ms']:.3f}" for r in looped],
             ["verify γ + 1 = 5 ÷ AR"] + [f"{r['loop_verify_over_ar']:.3f}" for r in looped]]
  in_loop += [[label + " ÷ AR"] + [_ratio(r["loop_draft_over_ar"], key) for r in looped]
              for key, label in DRAFT_LABELS]
  decode = [["decode tok/s"] + [f"{r['decode_tok_s']:.1f}" for r in rows],
            ["ms per token in the loop"] + [f"{1e3 / r['decode_tok_s']:.3f}" for r in rows],
            ["weights per token (MB)"] + [f"{r['weight_mb']:.0f}" for r in rows],
            ["weight bytes read (GB/s)"] + [f"{r['decode_tok_s'] * r['weight_mb'] / 1e3:.0f}"
                                           for r in rows],
            ["reduction bandwidth (GB/s)"] + [f"{r['bandwidth_gb_s']:.0f}" for r in rows],
            ["roofline tok/s"] + [f"{r['roofline_tok_s']:.1f}" for r in rows],
            ["share of the roofline"] + [f"{r['share_of_roofline']:.0%}" for r in rows],
            ["share of the card's datasheet bandwidth"] + [_datasheet_share(r) for r in rows]]
  header = ["", *[r["model"] for r in rows]]
  parts = [
      f"## GPU: step costs and AR decode speed ({_card(first['machine'])}, commit "
      f"{first['commit']})",
      "",
      "Measured by " + ", ".join(sorted({f"`{r['command']}`" for r in rows})) + ".",
      "",
      f"Machine: {first['machine']}. Commit {first['commit']}. Precision "
      f"{first['dtype']} (`--dtype`: the weights, activations and KV cache; mixed: bfloat16 "
      f"weights computed in float32); `shape:` models are random-init at the named model's "
      f"shapes. Steps at context {first['context']}, medians; each step a call from the "
      f"host, a chain of calls dispatched back to back with one wait, so a step's time "
      f"includes its host dispatch where that exceeds the device time (the small models: "
      f"compare the AR step with the ms per token of the on-device loop below). Draft plans "
      f"are random with the given share of sub-layers on. AR decoding: greedy, the on-device "
      f"loop; the roofline reads the weights once per token at the bandwidth a jitted "
      f"reduction over 1 GiB reaches in the same run:",
      "",
      report.markdown_table(header, steps),
      "",
  ]
  if looped:
    parts += [f"The same steps, {looped[0]['loop_steps']} of each chained inside one jitted "
              f"loop (each step's output feeds the next, as in the device loop; no host "
              f"dispatch between them):", "",
              report.markdown_table(["", *[r["model"] for r in looped]], in_loop), ""]
  parts += [report.markdown_table(header, decode)]
  if bench:
    from specjax.bench import metrics
    from specjax.bench.runner import _overall_table

    prompts = len({r["prompt_id"] for r in bench})
    parts += ["", f"`specjax bench` on the same machine, {prompts} Spec-Bench prompts, greedy, "
              f"{_bench_precision(bench_command)} (mismatches: prompts whose tokens differ "
              f"from AR's), by `{bench_command}`:",
              "",
              _overall_table(metrics.summarize(bench))]
  return "\n".join(parts)


def _ratio(ratios: dict, key: str) -> str:
  """A table cell: "–" where a run predates the row."""
  return f"{ratios[key]:.3f}" if key in ratios else "–"


def _datasheet_share(row: dict) -> str:
  """A table cell: the weight bytes AR reads per second over the card's published HBM
  bandwidth ("–" for a card not in DATASHEET_GB_S). The reduction a run measures reached
  2.4-3.1 TB/s on H200s, less than AR's own reads, so only this share is comparable
  across leases."""
  peak = DATASHEET_GB_S.get(_card(row["machine"]))
  return f"{row['decode_tok_s'] * row['weight_mb'] / 1e3 / peak:.0%}" if peak else "–"


def _card(machine: str) -> str:
  """The accelerator's name in a `report.machine()` line ("GPU (NVIDIA H200), ...")."""
  found = re.match(r"\w+ \(([^)]*)\)", machine)
  return found.group(1) if found else machine


def _bench_precision(command: str) -> str:
  """The precision a `specjax bench` command ran at, read from its `--dtype`."""
  words = command.split()
  dtype = words[words.index("--dtype") + 1] if "--dtype" in words[:-1] else "auto"
  return {"auto": "bf16 (auto on a GPU)", "bfloat16": "bf16",
          "mixed": "mixed precision (bf16 weights computed in float32)"}.get(dtype, dtype)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="smollm2-135m-instruct,shape:qwen2-1.5b,shape:llama-8b")
  ap.add_argument("--context", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=9)
  ap.add_argument("--chain", type=int, default=20)
  ap.add_argument("--loop-steps", type=int, default=32,
                  help="steps chained in one jitted loop per sample (0: skip that timing)")
  ap.add_argument("--drafts", default=",".join(DRAFT_KEYS),
                  help="the draft rows to time, comma-separated (fewer compile sooner): "
                       + ", ".join(DRAFT_KEYS))
  ap.add_argument("--tokens", type=int, default=128)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
  ap.add_argument("--out", type=Path, help="append each model's JSON line here")
  ap.add_argument("--report", type=Path, help="read JSON lines instead of measuring")
  ap.add_argument("--bench-results", type=Path,
                  help="with --report: a `specjax bench` results.jsonl from the same machine")
  ap.add_argument("--bench-command", default="specjax bench", help="the command that made it")
  ap.add_argument("--write-docs", action="store_true")
  ap.add_argument("--docs-section", default="gpu-forward",
                  help="with --write-docs: the section to write (one per card: gpu-forward-h200)")
  args = ap.parse_args()
  args.drafts = [key.strip() for key in args.drafts.split(",") if key.strip()]
  if unknown := [key for key in args.drafts if key not in DRAFT_KEYS]:
    ap.error(f"unknown draft row {unknown[0]!r}; known: {', '.join(DRAFT_KEYS)}")

  if args.report:
    rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
  else:
    from specjax import compile_cache

    compile_cache.enable()  # a rerun after a cut-off call loads its programs
    rows = []
    for name in args.models.split(","):
      rows.append(measure(name, args))
      if args.out:
        with args.out.open("a") as f:
          f.write(json.dumps(rows[-1]) + "\n")
  bench = None
  if args.bench_results:
    bench = [r for line in args.bench_results.read_text().splitlines() if line.strip()
             for r in json.loads(line)["records"]]
  text = section(rows, bench, args.bench_command)
  print(text)
  if args.write_docs:
    report.write_section(args.docs_section, text)
  report.print_json({"models": rows})


if __name__ == "__main__":
  main()
