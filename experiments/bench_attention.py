"""A decode step's attention on a CPU: the `f32_attention` kernel against XLA's dots, in
the whole AR step and the whole verification of γ + 1 tokens.

    python -m experiments.bench_attention [--model smollm2-135m-instruct] [--gamma 4]
        [--contexts 256,1024] [--repeats 40]

Each step is compiled twice in one process, once as the model takes it (the kernel, where
`ops.f32_attention_takes`) and once with the kernel disabled (XLA's two dots and softmax
per layer, over a filled prefix of the cache where `_prefix` applies), and the four
executables of a context run round-robin, so the machine's drift hits both paths alike.
A step is the engine's own function (`generate.decode_step`'s, greedy, and
`engine.verify_step`'s), jitted afresh for each path: the kernel's choice is read when a
step is traced, so the engine's jitted steps would serve one path's trace to both.
Float32 only: the kernel takes no other dtype.
The cache holds `context` tokens in `context + 64` slots. Medians; the last line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import jax
import jax.numpy as jnp

from experiments import report
from specjax import cpu_kernels
from specjax.decode.generate import _step
from specjax.decode.round import Draft, verify_fn
from specjax.kv_cache import KVCache
from specjax.models.loader import load_model
from specjax.plan import DraftPlan
from specjax.sampling import SamplingParams

# Every kernel but f32_attention: the path the model took before it.
WITHOUT = ",".join(k for k in cpu_kernels.build.KERNELS if k != "f32_attention")


@contextlib.contextmanager
def kernels(chosen: str):
  """Trace with `SPECJAX_CPU_KERNELS=chosen` (the choice is read when a step is traced)."""
  before = os.environ.get("SPECJAX_CPU_KERNELS")
  os.environ["SPECJAX_CPU_KERNELS"] = chosen
  cpu_kernels.kernel_status.cache_clear()
  try:
    yield
  finally:
    if before is None:
      os.environ.pop("SPECJAX_CPU_KERNELS")
    else:
      os.environ["SPECJAX_CPU_KERNELS"] = before
    cpu_kernels.kernel_status.cache_clear()


def steps(m, cache: KVCache, gamma: int) -> dict:
  """{(step, path): call}: the AR step and the verification, each compiled with and
  without the kernel; each call runs one step at the cache's length."""
  full, greedy = DraftPlan.full(m.config.num_layers), SamplingParams()
  key, tok, last = jax.random.key(0), jnp.ones((1,), jnp.int32), jnp.int32(1)
  draft = Draft(n=jnp.int32(gamma), tokens=jnp.ones((gamma,), jnp.int32),
                confidence=jnp.ones((gamma,), jnp.float32), q_rows=None)
  length = int(cache.length)
  holder = {"cache": cache}  # each step donates the cache: carry the returned one
  calls = {}
  for path, chosen in (("kernel", "1"), ("xla", WITHOUT)):
    with kernels(chosen):
      ar = jax.jit(lambda s, c: _step(s, c, tok, full, key, graphdef=m.graphdef,
                                      sampling=greedy), donate_argnums=1)
      verify = jax.jit(lambda s, c: verify_fn(s, c, last, draft, full, key,
                                              graphdef=m.graphdef, sampling=greedy),
                       donate_argnums=1)
      exes = {"ar": ar.lower(m.state, cache).compile(),
              "verify": verify.lower(m.state, cache).compile()}
    for name, exe in exes.items():
      assert ("specjax_f32_attention" in exe.as_text()) == (path == "kernel"), (name, path)

      def run(exe=exe):
        out, c = exe(m.state, holder["cache"])
        holder["cache"] = c.with_length(length)
        jax.block_until_ready(out)
      calls[(name, path)] = run
  return calls


def timed(calls: dict, repeats: int) -> dict:
  """Median ms of each call, round-robin, after one untimed pass."""
  return {name: statistics.median(v) for name, v in report.round_robin(calls, repeats).items()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--contexts", default="256,1024")
  ap.add_argument("--repeats", type=int, default=40)
  report.common_args(ap, results=False)
  args = ap.parse_args()
  if args.dtype not in ("auto", "float32"):
    sys.exit(f"bench_attention compares float32 steps (the kernel's only dtype), not "
             f"--dtype {args.dtype}")
  if cpu_kernels.kernel_status("f32_attention") != "ready" or jax.default_backend() != "cpu":
    sys.exit(f"bench_attention needs the CPU kernel: {cpu_kernels.kernel_status('f32_attention')}"
             f" on a {jax.default_backend()} backend")

  m = load_model(args.model, dtype="float32")
  rows, figures = [], {}
  for context in (int(c) for c in args.contexts.split(",")):
    cache = KVCache.create(m.config, 1, context + 64).with_length(context)
    ms = timed(steps(m, cache, args.gamma), args.repeats)
    ar_k, ar_x = ms[("ar", "kernel")], ms[("ar", "xla")]
    ver_k, ver_x = ms[("verify", "kernel")], ms[("verify", "xla")]
    rows.append([context, ar_x, ar_k, ar_k / ar_x, ver_x, ver_k, ver_k / ver_x,
                 ver_x / ar_x, ver_k / ar_k])
    figures[str(context)] = {"ar_ms": {"xla": round(ar_x, 3), "kernel": round(ar_k, 3)},
                             "verify_ms": {"xla": round(ver_x, 3), "kernel": round(ver_k, 3)},
                             "verify_over_ar": {"xla": round(ver_x / ar_x, 4),
                                                "kernel": round(ver_k / ar_k, 4)}}
  T = args.gamma + 1
  table = report.markdown_table(
      ["context", "AR ms, XLA", "AR ms, kernel", "kernel ÷ XLA", f"verify T={T} ms, XLA",
       "verify ms, kernel", "kernel ÷ XLA", "verify ÷ AR, XLA", "verify ÷ AR, kernel"], rows)
  head = (f"The AR step and verification of {T} tokens (the engine's, float32, greedy) "
          f"compiled with the `f32_attention` kernel and with XLA's dots, the cache holding "
          f"`context` tokens in `context + 64` slots; medians of {args.repeats} steps, the "
          f"four executables of a context round-robin in one process:")
  print(head)
  print(table)
  if args.write_docs:
    report.write_section(f"attention-{args.model}", "\n\n".join([
        f"## A step's attention: the CPU kernel against XLA's dots ({args.model})",
        f"Machine: {report.machine()}. Commit {report.git_revision()}.", head, table]))
  report.print_json({"model": args.model, "machine": report.machine(), "gamma": args.gamma,
                     "repeats": args.repeats, "contexts": figures})


if __name__ == "__main__":
  main()
