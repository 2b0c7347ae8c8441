"""Time the Pallas quantised decode-attention kernel (int4 draft / int8 target reads)
against a bf16 dense decode attention (XLA) at 4k–128k context, and the Pallas
weight-only int8 / int4 matmuls against XLA's at a model's matrix shapes, on a GPU.

For each context: one decode step of one layer (B = 1, K kv heads, N/K query heads per
kv head, head dim H), the quantised cache holding all but a 256-token full-precision
buffer. Checks the kernel against the jnp reference first (max abs error), then reports
median times over repeats and the ratio to dense bf16, plus bytes read. On a CPU it runs
only with --interpret (a smoke test of the script; the times mean nothing there). The
last output line is one JSON object with the figures.

  python -m experiments.kernels_gpu --contexts 4096,16384,65536,131072 --write-docs

Matmuls (`--matmuls`, default the Llama-3-8B layer's qkv, o, gate_up and down): x of 1
and 5 rows (a draft step, verification at γ = 4) in bf16 times each matrix as bf16 (XLA),
int8 per output channel and int4 in groups of 128 (XLA's dot over the converted codes,
and the Pallas kernel): µs, the bytes each reads, GB/s and its share of the card's
datasheet bandwidth. `--contexts ""` times the matmuls alone.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import report
from pallas_kernels import dense_partials, merge, quant_attention, reference_partials
from pallas_kernels.quant_attention import quant_partials, split_for
from specjax import quant


def device_seconds(step, q, *rest, inner: int, repeats: int) -> float:
  """Median seconds of one `step(q, *rest)` on the device. `inner` calls run chained in
  one jitted loop, each query nudged by the previous output so XLA can neither hoist nor
  drop a call: a decode attention takes microseconds, less than the host needs to
  dispatch one jitted call, so timing calls one by one would time the dispatch."""
  @jax.jit
  def loop(q, *rest):
    def body(_, acc):
      return acc + jnp.sum(step(q + 1e-30 * acc, *rest))
    return jax.lax.fori_loop(0, inner, body, jnp.zeros((), jnp.float32))

  jax.block_until_ready(loop(q, *rest))  # compile + warm
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(loop(q, *rest))
    times.append((time.perf_counter() - t) / inner)
  return float(np.median(times))


def setup(S: int, args, seed: int = 0):
  K, H = args.kv_heads, args.head_dim
  rows = args.heads // K
  key = jax.random.split(jax.random.key(seed), 4)
  k = jax.random.normal(key[0], (1, K, S, H), jnp.float32)
  v = jax.random.normal(key[1], (1, K, S, H), jnp.float32)
  q = jax.random.normal(key[2], (1, K, rows, H), jnp.float32)
  F = 2 * args.residual
  fp_k = jax.random.normal(key[3], (1, K, F, H), jnp.bfloat16)
  return q, k, v, fp_k, F


def dense_bf16(q, k, v, length, scale):
  """The baseline: one decode step of GQA attention over a bf16 cache (XLA)."""
  s = jnp.einsum("bkrh,bksh->bkrs", q.astype(jnp.bfloat16), k,
                 preferred_element_type=jnp.float32) * scale
  s = jnp.where(jnp.arange(k.shape[2]) < length, s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(jnp.bfloat16)
  return jnp.einsum("bkrs,bksh->bkrh", p, v, preferred_element_type=jnp.float32)


def run(args) -> dict:
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.interpret:
    raise SystemExit("no GPU: this script times GPU kernels. Run it on a GPU machine, or "
                     "pass --interpret for a (slow, meaningless-timing) smoke test on CPU.")
  scale = args.head_dim ** -0.5
  timing = dict(inner=args.inner if on_gpu else 1, repeats=args.repeats)
  rows, figures = [], {}
  for S in args.contexts:
    q, k, v, fp_k, F = setup(S, args)
    Q = S - F  # all but the buffer is quantised
    value_group = min(args.group, args.head_dim)
    hk, hv = quant.quantize(k, 2, args.group), quant.quantize(v, 3, value_group)
    qpos = jnp.full((1, q.shape[2]), S, jnp.int32)
    fp_pos = jnp.broadcast_to(Q + jnp.arange(F), (1, F))
    fp_valid = jnp.ones((1, F), bool)
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    t_dense = device_seconds(lambda q, k, v: dense_bf16(q, k, v, S, scale), q, kb, vb,
                             **timing)
    entry = {}
    for bits in (4, 8):
      kw = dict(bits=bits, group=args.group, value_group=value_group, scale=scale)
      ro, rm, rl = reference_partials(q, qpos, Q, hk, hv, **kw)
      want = merge([(ro[:, :, 0], rm[:, :, 0], rl[:, :, 0]),
                    dense_partials(q, qpos, fp_k, fp_k, fp_pos, fp_valid, scale=scale)])
      tried = {}
      for splits, block in itertools.product(args.splits, args.block):
        tiling = split_for(S, args.group, block, splits)  # what the kernel will run
        if tiling in tried:
          continue

        def step(q, hk, hv, fk, splits=splits, block=block):
          return quant_attention(q, qpos, Q, hk, hv, fk, fk, fp_pos, fp_valid,
                                 interpret=not on_gpu, splits=splits, block=block, **kw)

        err = float(jnp.max(jnp.abs(jax.jit(step)(q, hk, hv, fp_k) - want)))
        tried[tiling] = (device_seconds(step, q, hk, hv, fp_k, **timing), err)
      (block, splits), (t, _) = min(tried.items(), key=lambda kv: kv[1][0])
      err = max(e for _, e in tried.values())
      t_call = device_seconds(  # the Pallas call alone, without the buffer and the merge
          lambda q, hk, hv: quant_partials(q, qpos, Q, hk, hv, splits=splits, block=block,
                                           interpret=not on_gpu, **kw)[0],
          q, hk, hv, **timing)
      read = (hk.upper.nbytes + hv.upper.nbytes) * (2 if bits == 8 else 1) + sum(
          x.nbytes for x in (hk.lo, hk.scale, hv.lo, hv.scale)) + 2 * fp_k.nbytes
      entry[f"int{bits}"] = dict(seconds=t, ratio_to_dense_bf16=t / t_dense, max_abs_err=err,
                                 pallas_call_seconds=t_call, bytes_read=int(read),
                                 splits=splits, block=block, tilings_tried=len(tried))
      rows.append([S, f"int{bits} kernel", f"{t * 1e6:.1f}", f"{t_call * 1e6:.1f}",
                   f"{t / t_dense:.2f}", f"{read / 2**20:.2f}", f"{read / t / 1e9:.0f}",
                   f"{splits} × {block}", f"{err:.1e}"])
      print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)  # progress
    dense_read = kb.nbytes + vb.nbytes
    entry["dense_bf16"] = dict(seconds=t_dense, bytes_read=int(dense_read))
    rows.append([S, "dense bf16 (XLA)", f"{t_dense * 1e6:.1f}", "–", "1.00",
                 f"{dense_read / 2**20:.2f}", f"{dense_read / t_dense / 1e9:.0f}", "–", "–"])
    figures[str(S)] = entry
  table = report.markdown_table(["context", "attention", "µs / step / layer",
                                 "of which µs in the Pallas call", "vs dense bf16",
                                 "MiB read", "GB/s", "splits × block", "max abs err vs jnp ref"],
                                rows)
  print(f"\n{table}\n")
  if args.write_docs and on_gpu:
    report.write_section("kernels-gpu", "\n".join([
        "## Pallas quantised decode attention vs dense bf16 (GPU)", "",
        f"One decode step of one layer: B = 1, {args.kv_heads} kv heads, {args.heads} query "
        f"heads, head dim {args.head_dim}, key groups of {args.group} tokens, a "
        f"{2 * args.residual}-token bf16 buffer merged in (a step's time includes that "
        f"segment and the log-sum-exp merge; the next column times the Pallas call "
        f"alone). Device time per step: {args.inner} steps chained in one jitted loop, "
        f"median of {args.repeats} loops; the kernel's tiling "
        f"(splits of the sequence × block) is the fastest of those tried. "
        f"Machine: {report.machine()}.", "", table]))
  return {"backend": jax.default_backend(), "contexts": figures}


# HBM bandwidth in GB/s from NVIDIA's datasheets (as experiments.bench_gpu).
DATASHEET_GB_S = {"NVIDIA H200": 4800.0, "NVIDIA H100 80GB HBM3": 3350.0}
LLAMA_8B = "qkv:4096x6144,o:4096x4096,gate_up:4096x28672,down:14336x4096"


def matmul_run(args) -> dict:
  """The few-row quantised matmuls (module docstring), checked against the references."""
  from pallas_kernels import quant_matmul

  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.interpret:
    raise SystemExit("no GPU: this script times GPU kernels. Run it on a GPU machine, or "
                     "pass --interpret for a (slow, meaningless-timing) smoke test on CPU.")
  timing = dict(inner=args.inner if on_gpu else 1, repeats=args.repeats)
  peak = DATASHEET_GB_S.get(jax.devices()[0].device_kind) if on_gpu else None
  rng = np.random.default_rng(0)
  rows, figures = [], {}
  for spec in args.matmuls.split(","):
    name, dims = spec.split(":")
    I, O = (int(n) for n in dims.split("x"))
    w = jnp.asarray(rng.normal(size=(I, O)) / np.sqrt(I), jnp.float32)
    m8, m4 = quant.Int8Matrix.quantize(w), quant.Int4Matrix.quantize(w, args.group)
    wb = w.astype(jnp.bfloat16)
    kinds = {
        "bf16 (XLA)": (lambda x, wb: x @ wb, (wb,), wb.nbytes),
        "int8 (XLA)": (lambda x, m: m.matmul(x), (m8.replace(kernel="xla"),), m8.nbytes),
        "int8 (Pallas)": (lambda x, m: m.matmul(x), (m8.replace(kernel="pallas"),), m8.nbytes),
        "int4 (XLA)": (lambda x, m: m.matmul(x), (m4.replace(kernel="xla"),), m4.nbytes),
        "int4 (Pallas)": (lambda x, m: m.matmul(x), (m4.replace(kernel="pallas"),), m4.nbytes),
    }
    for r in (1, 5):
      x = jnp.asarray(rng.normal(size=(r, I)), jnp.bfloat16)
      xg = quant.activation_grid(x, args.group)  # x as the int4 format reads it
      err8 = float(jnp.max(jnp.abs(
          quant_matmul.int8_matmul(x, m8.codes, m8.scale, interpret=not on_gpu)
          - quant_matmul.int8_reference(x, m8.codes, m8.scale))))
      err4 = float(jnp.max(jnp.abs(
          quant_matmul.int4_matmul(xg, m4.codes, m4.lo, m4.scale, interpret=not on_gpu)
          - quant_matmul.int4_reference(xg, m4.codes, m4.lo, m4.scale))))
      entry = {"max_abs_err_int8": err8, "max_abs_err_int4": err4}
      t_bf16 = None
      for kind, (fn, operands, nbytes) in kinds.items():
        if not on_gpu and "Pallas" in kind:
          continue  # timed only where it compiles for real
        t = device_seconds(fn, x, *operands, **timing)
        t_bf16 = t if t_bf16 is None else t_bf16
        gb_s = nbytes / t / 1e9
        entry[kind] = dict(seconds=t, bytes=int(nbytes), gb_s=gb_s, over_bf16=t / t_bf16)
        rows.append([name, f"{I}×{O}", r, kind, f"{t * 1e6:.1f}", f"{nbytes / 2**20:.1f}",
                     f"{gb_s:.0f}", f"{gb_s / peak:.0%}" if peak else "–",
                     f"{t / t_bf16:.2f}"])
        print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)  # progress
      figures[f"{name}/{r}"] = entry
  table = report.markdown_table(["matrix", "I × O", "rows", "weights", "µs", "MiB read",
                                 "GB/s", "of the datasheet", "vs bf16"], rows)
  print(f"\n{table}\n")
  if args.write_docs and on_gpu:
    report.write_section("kernels-gpu-matmul", "\n".join([
        "## Pallas weight-only quantised matmuls vs XLA (GPU)", "",
        f"x in bf16 of 1 and 5 rows times each matrix; int4 in groups of {args.group}. "
        f"Device time per call: {args.inner} calls chained in one jitted loop, median of "
        f"{args.repeats} loops. Machine: {report.machine()}.", "", table]))
  return figures


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--contexts", default="4096,16384,32768,65536,131072")
  p.add_argument("--heads", type=int, default=14, help="query heads (Qwen2.5-0.5B: 14)")
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--group", type=int, default=128)
  p.add_argument("--residual", type=int, default=128)
  p.add_argument("--block", default="256", help="kernel blocks to try")
  p.add_argument("--splits", default="16,64,256", help="sequence splits to try")
  p.add_argument("--inner", type=int, default=100, help="steps per timed loop (GPU)")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--matmuls", default=LLAMA_8B,
                 help="NAME:IxO,... matrices to time the few-row matmuls on ('' none)")
  p.add_argument("--interpret", action="store_true", help="CPU smoke test")
  p.add_argument("--write-docs", action="store_true")
  args = p.parse_args(argv)
  args.contexts, args.splits, args.block = ([int(n) for n in a.split(",") if n]
                                            for a in (args.contexts, args.splits, args.block))
  figures = run(args) if args.contexts else {"backend": jax.default_backend()}
  if args.matmuls:
    figures["matmuls"] = matmul_run(args)
  report.print_json(figures)


if __name__ == "__main__":
  main()
