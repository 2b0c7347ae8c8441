"""The f32 kernel's [I, O] tile alone on one core, against what the core's FMA units can do.

    python -m experiments.bench_f32_tile [--shape 576,3072] [--rows 1,2,4,5,8,9]
        [--copies 30] [--pad 16]

`bench_cpu_kernels.py` times real steps, where DRAM, threads and XLA blur the picture; this
times the inner loop of `specjax/cpu_kernels/f32_matmul.cc` (`RowsIO`, one thread, the
matrix warm in the caches unless `--copies`) built with the package's compiler flags, so a
change to the tile can be judged in seconds, and its assembly read beside it (`--asm`).
The default shape is one SmolLM2 gate_up matrix (7 MB: in L3 on the CPUs we use). Reports
µs per matmul, GB/s of weights and the share of the core's FMA rate (a register-only FMA
loop), beside the rate of the tile's instruction mix alone (its weight loads and x
broadcasts feeding its FMAs, every operand from L1, no sums stored: what the loads that
feed the FMAs leave of that rate); the last line is JSON. This found GCC's reassociated
trees in the five-row tile (then at a third of that rate; docs/BENCHMARKS.md).

`--copies N` takes N such matrices in turn, so that their weights come from DRAM as in a
step (30 of SmolLM2's gate_up matrices are 212 MB); `--pad P` stores each weight row P
floats longer than its O columns. A row stride that is a multiple of 4 KiB (SmolLM2's
gate_up: 12 KiB) puts the eight rows the tile reads side by side in one set of the L1
cache; padding shows what that costs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

from experiments import report
from specjax import cpu_kernels

HARNESS = Path(__file__).with_name("f32_tile_harness.cc")
KERNELS = Path(cpu_kernels.__file__).parent


def max_rows() -> int:
  """Rows of x one pass of the kernel takes (`kMaxRows` in f32_matmul.cc)."""
  source = (KERNELS / "f32_matmul.cc").read_text()
  return int(re.search(r"constexpr int kMaxRows = (\d+);", source).group(1))


def build(out: Path, asm: Path | None = None) -> None:
  """The harness, compiled with the flags the package builds `f32_matmul.cc` with."""
  import jax

  compiler = os.environ.get("CXX", "g++")
  flags = [*cpu_kernels.compile_flags("f32_matmul.cc"), "-w", f"-I{KERNELS}",
           f"-I{jax.ffi.include_dir()}", str(HARNESS)]
  subprocess.run([compiler, *flags, "-o", str(out)], check=True)
  if asm is not None:
    subprocess.run([compiler, *flags, "-S", "-o", str(asm)], check=True)


def parse(lines: list[str]) -> tuple[int, float, dict[int, float], dict[int, float]]:
  """(floats per vector, peak G vector FMAs/s, {rows: µs per matmul}, {rows: G vector
  FMAs/s of the tile's mix from L1}) from the harness."""
  lanes, peak, times, mix = 0, 0.0, {}, {}
  for line in lines:
    word, *rest = line.split()
    if word == "lanes":
      lanes = int(rest[0])
    elif word == "peak":
      peak = float(rest[0])
    elif word == "rows":
      times[int(rest[0])] = float(rest[1])
    elif word == "mix":
      mix[int(rest[0])] = float(rest[1])
  return lanes, peak, times, mix


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shape", default="576,3072", help="I,O of the [I, O] matrix")
  ap.add_argument("--rows", default="1,2,3,4,5,8,9",
                  help="rows of x (1 to the kernel's rows per pass, 9)")
  ap.add_argument("--reps", type=int, default=200, help="calls per timed batch (7 batches)")
  ap.add_argument("--copies", type=int, default=1,
                  help="matrices taken in turn (enough of them: from DRAM)")
  ap.add_argument("--pad", type=int, default=0, help="floats stored past each weight row")
  ap.add_argument("--asm", type=Path, help="also write the harness's assembly here")
  args = ap.parse_args()
  I, O = (int(v) for v in args.shape.split(","))
  rows = [int(r) for r in args.rows.split(",")]
  most = max_rows()
  if not all(1 <= r <= most for r in rows):
    raise SystemExit(f"--rows: each between 1 and {most} (one pass of the kernel)")
  if args.copies < 1 or args.pad < 0:
    raise SystemExit("--copies: at least 1; --pad: at least 0")

  with tempfile.TemporaryDirectory() as tmp:
    exe = Path(tmp) / "harness"
    build(exe, args.asm)
    cmd = [exe, I, O, args.reps, args.copies, args.pad, *rows]
    out = subprocess.run(list(map(str, cmd)), check=True, capture_output=True, text=True).stdout
  lanes, peak, times, mix = parse(out.splitlines())
  table_rows, figures = [], {"machine": report.machine(), "shape": [I, O],
                             "copies": args.copies, "pad": args.pad,
                             "peak_gvfma": round(peak, 3), "rows": {}}
  for r, us in times.items():
    gbs = I * O * 4 / us / 1e3
    gvfma = I * O / lanes * r / us / 1e3
    figures["rows"][r] = {"us": us, "gb_s": round(gbs, 2), "share_of_peak": round(gvfma / peak, 3),
                          "mix_gvfma": mix[r], "mix_share_of_peak": round(mix[r] / peak, 3)}
    table_rows.append([r, f"{us:.1f}", f"{gbs:.1f}", f"{gvfma:.2f}", f"{gvfma / peak:.0%}",
                       f"{mix[r]:.2f}", f"{mix[r] / peak:.0%}"])
  stored = f", rows stored {O + args.pad} floats apart" if args.pad else ""
  print(f"{figures['machine']}; [I, O] = [{I}, {O}]{stored}, {args.copies} in turn, one "
        f"thread, {lanes} floats per vector; register-only FMA loop: {peak:.2f} G vector "
        f"FMAs/s")
  print(report.markdown_table(["rows", "µs", "GB/s", "G vector FMAs/s", "of peak",
                               "tile's mix from L1", "of peak"], table_rows))
  report.print_json(figures)


if __name__ == "__main__":
  main()
