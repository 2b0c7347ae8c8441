"""The CPU kernels matrix by matrix: each class of a model's matmuls (q/k/v, o, gate/up,
down, LM head), every layer's real weights in turn, through XLA's dot and through our
kernels, at one row (an AR or draft step) and at γ + 1 rows (a verification); the 8-bit
and 4-bit kernels (QuantSpec's MLP weights) at one row, beside XLA's dot over the 4-bit
codes (what a 4-bit draft cost without its kernel).

    python -m experiments.bench_cpu_kernels [--model smollm2-135m-instruct] [--rows 5]

Each timed call runs one class over all layers in a chain (each output feeds the next
input, so nothing overlaps), after reading 1 GiB of other data so that the weights come
from DRAM: a decode step's access pattern, not a cache-warm micro-benchmark. Medians
of `--runs`, the variants round-robin.
Reported as ms per step and as GB/s of weights read; the last line is JSON. This is the
script behind the kernels' design notes (`specjax/cpu_kernels/*.cc`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import report
from specjax import cpu_kernels
from specjax.models.loader import load_model
from specjax.quant import Int4Matrix, model_matrices, quantize_weights_int8

CLASSES = ("qkv", "o", "gate_up", "down", "head")
KERNELS = ("f32_matmul", "int8_matmul", "int4_matmul")


def matrices(m) -> dict:
  """{class: (float32 matrices as the model stores them, int8 copies, int4 copies,
  output_major)}: [I, O], or [O, I] for qkv, gate_up and a tied head (`output_major`)."""
  L = m.config.num_layers
  f32 = {c: [] for c in CLASSES}
  for _, name, w in model_matrices(m.state, L):
    f32[name].append(w)
  f32["gate_up"] = [m.state["blocks"][l]["mlp"]["gate_up"][...] for l in range(L)]
  f32["qkv"] = [m.state["blocks"][l]["attn"]["qkv"][...] for l in range(L)]
  tied = "lm_head" not in m.state
  f32["head"] = [m.state["embedding"][...] if tied else m.state["lm_head"][...]]
  major = {c: c in ("qkv", "gate_up") or (tied and c == "head") for c in CLASSES}
  q = quantize_weights_int8(m.state, L)
  int8 = {c: [getattr(layer, c) for layer in q.layers] for c in CLASSES[:-1]} | {
      "head": [q.head]}
  int4 = {c: [Int4Matrix.quantize(w.T if major[c] else w) for w in f32[c]] for c in CLASSES}
  return {c: (f32[c], int8[c], int4[c], major[c]) for c in CLASSES}


def chain(matmul):
  """A jitted pass over `ws` that feeds each output back into the next input."""
  def run(x, ws):
    total = jnp.zeros((), jnp.float32)
    for w in ws:
      y = matmul(x, w)
      total = total + y[..., 0].sum()
      x = x + total * 1e-12  # a data dependency: the next matmul waits for this one
    return total
  return jax.jit(run)


def variants(f32: list, int8: list, int4: list, major: bool, rows: int, inner: int) -> dict:
  """{name: (callable, operands)} for one matrix class (stored [O, I] when `major`)."""
  xla = (lambda x, w: jnp.einsum("ti,oi->to", x, w)) if major else (lambda x, w: x @ w)
  kernel = lambda x, w: cpu_kernels.f32_matmul(x, w, major)
  x1 = jnp.asarray(np.random.default_rng(0).normal(size=(1, inner)), jnp.float32)
  xr = jnp.asarray(np.random.default_rng(1).normal(size=(rows, inner)), jnp.float32)
  out = {"xla T=1": (chain(xla), (x1, f32)), f"xla T={rows}": (chain(xla), (xr, f32))}
  if cpu_kernels.kernel_status("f32_matmul") == "ready":
    out[f"f32 kernel T={rows}"] = (chain(kernel), (xr, f32))
    out["f32 kernel T=1"] = (chain(kernel), (x1, f32))
  if cpu_kernels.kernel_status("int8_matmul") == "ready":
    out["int8 kernel T=1"] = (chain(lambda x, q: q.matmul(x)), (x1, int8))
  if cpu_kernels.kernel_status("int4_matmul") == "ready":
    out["int4 kernel T=1"] = (chain(lambda x, q: q.matmul(x)), (x1, int4))
  out["xla int4 T=1"] = (chain(lambda x, q: x @ q.dequantize()), (x1, int4))
  return out


def flusher(mib: int = 1024):
  """A call that reads `mib` MiB, more than any last-level cache, so that the next timed
  call finds its weights in DRAM (a class of matrices alone may fit a large L3)."""
  junk = jnp.ones((mib * 2**20 // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  return lambda: total(junk).block_until_ready()


def time_class(vs: dict, runs: int, flush) -> dict:
  """Median seconds of each variant, round-robin after one warm-up (compiles) call, each
  timed call after a cache flush."""
  for fn, args in vs.values():
    fn(*args).block_until_ready()
  times = {name: [] for name in vs}
  for _ in range(runs):
    for name, (fn, args) in vs.items():
      flush()
      t = time.perf_counter()
      fn(*args).block_until_ready()
      times[name].append(time.perf_counter() - t)
  return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=5, help="a verification's γ + 1 rows")
  ap.add_argument("--runs", type=int, default=9)
  report.common_args(ap, results=False)
  args = ap.parse_args()

  m = load_model(args.model, dtype="float32")
  mats = matrices(m)
  flush = flusher()
  names: list[str] = []
  figures = {"model": args.model, "machine": report.machine(), "rows": args.rows,
             "kernels": {k: cpu_kernels.kernel_status(k) for k in KERNELS},
             "ms": {}, "f32_mb": {}}
  for c in CLASSES:
    f32, int8, int4, major = mats[c]
    inner = f32[0].shape[1] if major else f32[0].shape[0]
    t = time_class(variants(f32, int8, int4, major, args.rows, inner), args.runs, flush)
    names = list(t)
    figures["ms"][c] = {k: round(v * 1e3, 3) for k, v in t.items()}
    figures["f32_mb"][c] = round(sum(w.nbytes for w in f32) / 1e6, 1)
    print(f"{c}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items()), flush=True)
  totals = {k: sum(figures["ms"][c][k] for c in CLASSES) for k in names}
  figures["total_ms"] = {k: round(v, 3) for k, v in totals.items()}

  def cell(c: str, k: str) -> str:
    ms = figures["ms"][c][k]
    mb = figures["f32_mb"][c] / (8 if "int4" in k else 4 if "int8" in k else 1)
    return f"{ms:.2f} ({mb / ms:.0f})"

  rows = [[c, f"{figures['f32_mb'][c]:.0f}"] + [cell(c, k) for k in names] for c in CLASSES]
  rows.append(["all", f"{sum(figures['f32_mb'].values()):.0f}"]
              + [f"{totals[k]:.2f}" for k in names])
  table = report.markdown_table(["matrices", "f32 MB"] + names, rows)
  print(table)
  if args.write_docs:
    report.write_section(f"cpu-kernels-{args.model}", "\n".join([
        f"## CPU kernels matrix by matrix ({args.model})",
        "",
        f"Machine: {figures['machine']}. Commit {report.git_revision()}. Kernels: "
        + ", ".join(f"{k} {v}" for k, v in figures["kernels"].items()) + ".",
        "",
        f"Each class of matmuls over all {m.config.num_layers} layers' real weights in a "
        f"chain, after a 1 GiB read that evicts them from the caches; ms per step and, in "
        f"brackets, GB/s of weights read "
        f"(int8: a quarter of the f32 bytes, int4: an eighth, without the 4-bit groups' "
        f"statistics); medians of {args.runs} round-robin runs. T = 1 is an AR or draft "
        f"step, T = {args.rows} a verification of γ + 1 tokens. `xla int4` is XLA's dot "
        f"over the 4-bit codes dequantised in the step, the path without the int4 kernel:",
        "",
        table,
    ]))
  report.print_json(figures)


if __name__ == "__main__":
  main()
