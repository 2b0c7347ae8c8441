"""How fast `gguf_matmul` streams each block type of a model's GGUF file, against the same
weights as Q4_0.

A target in its own blocks (`--dtype gguf`) decodes as fast as this kernel turns blocks
into products, and a Q4_K_M file mixes types that unpack at different rates. For every
block type the model holds, one jitted call multiplies T rows of x by every part of that
type in the model (all its layers: the weights stream from memory, as in a decode step)
and the table reports G weights/s and GB/s at each T; the `q4_0` rows read the same
matrices quantised to Q4_0 by gguf-py (`4bit`'s copies). Medians of `--runs`, round-robin.

  python -m experiments.bench_gguf_kernel --model qwen2.5-coder-1.5b-instruct --rows 1,5,9
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import report
from specjax import cpu_kernels
from specjax.gguf_matrix import KINDS, GGUFMatrix
from specjax.models.loader import load_model

NAMES = {v: k for k, v in KINDS.items()}
COPY = "→q4_0"  # the suffix of a type's Q4_0 copies


def parts_by_type(state: nnx.State) -> dict[str, list[tuple[jax.Array, int]]]:
  """Every (blocks uint8[O, bytes], inputs) part of the state's GGUF matrices, by type."""
  out: dict[str, list[tuple[jax.Array, int]]] = {}
  for _, var in nnx.to_flat_state(state):
    m = var.get_value()
    if isinstance(m, GGUFMatrix):
      for blocks, kind in zip(m.parts, m.kinds):
        out.setdefault(NAMES[kind], []).append((blocks, m.inputs))
  return out


def as_q4_0(parts: list[tuple[jax.Array, int]], kind: int) -> list[tuple[jax.Array, int]]:
  """The same matrices quantised to Q4_0 by gguf-py (as `quantize_weights_q4_0` does)."""
  q4 = KINDS["Q4_0"]
  return [(GGUFMatrix.quantize(np.asarray(cpu_kernels.gguf_dequantize(b, kind)), q4).parts[0],
           inputs) for b, inputs in parts]


def streamer(parts: list[tuple[jax.Array, int]], kind: int, rows: int):
  """A call multiplying `rows` rows of x by every part, waited for."""
  blocks = [b for b, _ in parts]
  xs = {n: jnp.ones((rows, n), jnp.float32) for _, n in parts}

  @jax.jit
  def run(blocks):
    return sum(jnp.sum(cpu_kernels.gguf_matmul(xs[n], b, kind))
               for b, (_, n) in zip(blocks, parts))

  return lambda: jax.block_until_ready(run(blocks))


def measure(parts_of: dict[str, list[tuple[jax.Array, int]]], rows: tuple[int, ...],
            runs: int) -> list[dict]:
  """One record per (type, T): weights, bytes and the median ms of one streaming call."""
  calls, sizes = {}, {}
  for name, parts in parts_of.items():
    kind = KINDS["Q4_0" if name.endswith(COPY) else name]
    sizes[name] = (sum(b.shape[0] * n for b, n in parts), sum(b.nbytes for b, _ in parts))
    for t in rows:
      calls[(name, t)] = streamer(parts, kind, t)
  times = report.round_robin(calls, runs)
  return [dict(type=name, rows=t, weights=sizes[name][0], bytes=sizes[name][1],
               ms=statistics.median(times[(name, t)]),
               gw_s=sizes[name][0] / statistics.median(times[(name, t)]) / 1e6,
               gb_s=sizes[name][1] / statistics.median(times[(name, t)]) / 1e6)
          for (name, t) in calls]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", default="1,5,9", help="rows of x per call (T): AR and verifications")
  ap.add_argument("--runs", type=int, default=7)
  ap.add_argument("--no-q4-0", action="store_true", help="skip the Q4_0 copies")
  report.common_args(ap, default_model="qwen2.5-coder-1.5b-instruct", results=False)
  args = ap.parse_args()
  if args.dtype not in ("auto", "gguf"):
    ap.error("this benchmark reads the model's GGUF blocks: --dtype gguf (the default here)")
  rows = tuple(int(t) for t in args.rows.split(","))
  m = load_model(args.model, dtype="gguf")
  parts_of = parts_by_type(m.state)
  if not args.no_q4_0:
    for name in list(parts_of):
      if name != "Q4_0":
        parts_of[name + COPY] = as_q4_0(parts_of[name], KINDS[name])
  records = measure(parts_of, rows, args.runs)
  cores = os.cpu_count()
  header = ["block type", "weights (M)", "MB", *[f"T={t}: G weights/s" for t in rows],
            *[f"T={t}: GB/s" for t in rows]]
  table_rows = []
  for name in parts_of:
    rec = {r["rows"]: r for r in records if r["type"] == name}
    first = rec[rows[0]]
    table_rows.append([name, round(first["weights"] / 1e6, 1), round(first["bytes"] / 1e6, 1),
                       *[round(rec[t]["gw_s"], 1) for t in rows],
                       *[round(rec[t]["gb_s"], 1) for t in rows]])
  print(report.markdown_table(header, table_rows))
  figures = {"model": args.model, "machine": report.machine(), "cores": cores,
             "records": records}
  if args.write_docs:
    report.write_section(f"gguf-kernel-{args.model}", "\n".join([
        f"## The gguf_matmul kernel per block type ({args.model})", "",
        f"Machine: {figures['machine']}. Commit {report.git_revision()}.", "",
        f"Every part of one block type in the model (all layers, so the weights stream from "
        f"memory) multiplied by T rows of x in one jitted call, median of {args.runs} "
        f"round-robin runs; `→q4_0`: the same matrices as Q4_0 blocks (what `4bit` reads). "
        f"Rates are for the whole machine ({cores} cores):", "",
        report.markdown_table(header, table_rows)]))
  report.print_json(figures)


if __name__ == "__main__":
  main()
