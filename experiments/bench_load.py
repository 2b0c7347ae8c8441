"""Loading a Hugging Face checkpoint: specjax's streamed loader beside transformers'
`from_pretrained`, on the same folder, each in a fresh process.

    .venv/bin/python -m experiments.bench_load [--shape qwen2-1.5b] [--repeats 3] [--write-docs]

The checkpoint is written here first (kept in --dir for the next run): random bfloat16
weights of a real model's shape (Qwen2.5-1.5B: 1.54 B parameters, 3.1 GB, in two
safetensors shards with their index) and Qwen2.5's tokenizer from its GGUF package.
Each loader runs in its own process, alternating, `--repeats` times: the seconds from the
call to the weights resident (jax: on the device; torch: in memory, every parameter read
once, since transformers maps the shards and reads a weight when it is first used), and
the process's
peak resident memory above what it held just before the call (the kernel's high-water
mark, reset at that point). On a CPU the device is host memory, so the loaded model
itself counts: the "beyond the model" column subtracts its bytes, which leaves what the
loading cost on the way (on an accelerator, the whole of the host's share). Both load
bfloat16 (`--dtype`). transformers needs torch: run it with the venv that has torch
(`.venv`, `make setup-test`). Medians; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments import report

# Real models' shapes (their config.json, hub ids in the comment), weights random.
SHAPES = {
    "qwen2-1.5b": dict(  # Qwen/Qwen2.5-1.5B
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, hidden_act="silu", eos_token_id=151643,
        bos_token_id=151643),
    "llama-8b": dict(  # meta-llama/Meta-Llama-3-8B
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=5e5, rms_norm_eps=1e-5,
        tie_word_embeddings=False, hidden_act="silu", eos_token_id=128001,
        bos_token_id=128000),
    "tiny-qwen2": dict(  # Qwen2.5's vocabulary on a toy body: the script's own smoke test
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, hidden_act="silu", eos_token_id=151643,
        bos_token_id=151643),
}
SHARD_BYTES = 2 << 30  # transformers' default largest shard for a 1.5B (save_pretrained)


def _write_checkpoint(folder: Path, cfg: dict) -> int:
  """Random bf16 weights of config `cfg` in shards of at most SHARD_BYTES, their index,
  config.json and Qwen2.5's tokenizer; returns the weights' bytes."""
  import ml_dtypes
  import numpy as np

  from specjax.models import safetensors_file
  from specjax.models.hf_checkpoint import hf_names
  from specjax.models.hf_config import config_from_hf

  config = config_from_hf(cfg)
  names = {n: shape for n, (shape, _, _) in hf_names(config).items()}
  bf16 = np.dtype(ml_dtypes.bfloat16)
  shards, current, size = [], {}, 0
  for n, shape in names.items():
    nbytes = int(np.prod(shape)) * 2
    if current and size + nbytes > SHARD_BYTES:
      shards.append(current)
      current, size = {}, 0
    current[n] = (shape, bf16)
    size += nbytes
  shards.append(current)
  rng = np.random.default_rng(0)

  def tensor(name: str):
    shape = names[name]
    if name.endswith("norm.weight"):
      return np.ones(shape, bf16)
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(bf16)

  folder.mkdir(parents=True, exist_ok=True)
  weight_map = {}
  for i, layout in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    print(f"writing {file} ({len(layout)} tensors)", file=sys.stderr)
    safetensors_file.write(folder / file, layout, tensor)
    weight_map |= dict.fromkeys(layout, file)
  total = sum(int(np.prod(s)) * 2 for s in names.values())
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}))
  arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[cfg["model_type"]]
  (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16",
                                                  "architectures": [arch]}))
  _tokenizer(folder)
  return total


def _tokenizer(folder: Path) -> None:
  """Qwen2.5-Coder-0.5B's tokenizer (from its GGUF package) as a checkpoint's files."""
  from specjax.models.gguf import open_gguf
  from specjax.models.registry import get_spec
  from specjax.models.tokenizer import tokenizer_from_gguf

  tok = tokenizer_from_gguf(open_gguf(get_spec("qwen2.5-coder-0.5b-instruct").locate()))
  tok.save(folder)
  (folder / "tokenizer_meta.json").unlink()
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {**tok.special, "chat_template": tok.chat_template}))


def _status() -> dict[str, int]:
  """This process's VmRSS and VmHWM (peak) in bytes."""
  out = {}
  for line in Path("/proc/self/status").read_text().splitlines():
    key, _, value = line.partition(":")
    if key in ("VmRSS", "VmHWM"):
      out[key] = int(value.split()[0]) * 1024
  return out


def _child(loader: str, folder: str, dtype: str) -> None:
  """Load `folder` with `loader` in this process; print one JSON line of figures."""
  if loader == "specjax":
    import jax

    from specjax.models.loader import load_model
    load = lambda: load_model(folder, dtype=dtype, verbose=False)
    resident = lambda m: jax.block_until_ready(m.state)
    nbytes = lambda m: sum(x.nbytes for x in jax.tree.leaves(m.state))
  else:
    import torch
    import transformers

    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype))
    # transformers maps the shards and reads a weight's pages when it is first used: sum
    # every parameter once, so that its load holds the weights as specjax's does
    resident = lambda m: [float(p.detach().float().sum()) for p in m.parameters()]
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())
  Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
  before = _status()["VmRSS"]
  t = time.perf_counter()
  model = load()
  resident(model)
  seconds = time.perf_counter() - t
  peak = _status()["VmHWM"]
  print(json.dumps({"loader": loader, "seconds": seconds, "peak_above": peak - before,
                    "model_bytes": nbytes(model)}))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shape", default="qwen2-1.5b", choices=sorted(SHAPES))
  ap.add_argument("--dir", help="where the checkpoint is written (default /tmp/specjax-load-"
                  "SHAPE); kept for later runs")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--loaders", default="specjax,transformers")
  ap.add_argument("--write-docs", action="store_true")
  ap.add_argument("--child", help=argparse.SUPPRESS)
  args = ap.parse_args()
  folder = Path(args.dir or f"/tmp/specjax-load-{args.shape}")
  if args.child:
    return _child(args.child, str(folder), args.dtype)
  if not (folder / "model.safetensors.index.json").exists():
    _write_checkpoint(folder, SHAPES[args.shape])
  ckpt = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
  loaders = args.loaders.split(",")
  runs: dict[str, list[dict]] = {name: [] for name in loaders}
  for i in range(args.repeats):
    for name in loaders:
      out = subprocess.run(report.child("bench_load", "--child", name, "--dir", str(folder),
                                        "--dtype", args.dtype),
                           env=report.child_env(), capture_output=True, text=True)
      if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
      runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
      r = runs[name][-1]
      print(f"run {i + 1}: {name} {r['seconds']:.1f} s, peak +{r['peak_above'] / 2**30:.2f} "
            f"GiB", file=sys.stderr)
  gib = lambda b: b / 2**30
  rows, figures = [], {"shape": args.shape, "dtype": args.dtype, "checkpoint_bytes": ckpt,
                       "repeats": args.repeats, "machine": report.machine(),
                       "commit": report.git_revision(), "loaders": {}}
  for name, rs in runs.items():
    med = {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_above")}
    model = rs[0]["model_bytes"]
    figures["loaders"][name] = {**med, "model_bytes": model,
                                "seconds_all": [round(r["seconds"], 2) for r in rs]}
    rows.append([name, f"{med['seconds']:.1f}", f"{gib(med['peak_above']):.2f}",
                 f"{gib(model):.2f}", f"{gib(med['peak_above'] - model):.2f}",
                 f"{med['peak_above'] / ckpt:.2f}"])
  table = report.markdown_table(
      ["loader", "load s", "peak host memory above baseline, GiB", "the model, GiB",
       "beyond the model, GiB", "peak ÷ checkpoint"], rows)
  print(table, file=sys.stderr)
  if args.write_docs:
    report.write_section(f"load-{args.shape}-{args.dtype}", "\n".join([
        f"## Loading a Hugging Face checkpoint ({args.shape}, {args.dtype})", "",
        f"A checkpoint of {args.shape}'s shape with random weights, {gib(ckpt):.2f} GiB of "
        f"{args.dtype} safetensors in shards, loaded by each library in a fresh process, "
        f"alternating, median of {args.repeats}. Machine: {report.machine()}; commit "
        f"{figures['commit']}.", "", table, "",
        "On a CPU the loaded model lives in host memory, so it counts in the peak; "
        "'beyond the model' is what loading held on the way."]))
  report.print_json(figures)


if __name__ == "__main__":
  main()
