"""Real weights through the Hugging Face folder path: a registered model's GGUF file
turned into a safetensors checkpoint by transformers, loaded by specjax from that folder,
decodes the registered model's greedy tokens.

    .venv/bin/python -m experiments.hf_real_weights [--models smollm2-135m-instruct,...]
        [--per-category 1] [--max-new-tokens 64] [--write-docs]

transformers reads the GGUF (`from_pretrained(dir, gguf_file=...)`, which un-permutes
llama's rotary rows into HF's layout) and will not save a model it loaded from GGUF, so
its weights go into a fresh model of the same config, saved with `save_pretrained` in
float32 safetensors shards, with the tokenizer it converted from the same file. specjax
then loads that folder (`load_model(folder)`: the halves rotary layout, the folder's
tokenizer) and the registered name (its own GGUF reader, interleaved layout), and both
decode the same prompt ids greedily: Spec-Bench prompts, one per category by default,
encoded by the registered model's tokenizer. The folder's tokenizer is compared too (on
the prompts' text and their chat template). Needs torch and transformers (`.venv`).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from experiments import report

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")


def convert(name: str, out: Path) -> Path:
  """`name`'s GGUF file as a transformers safetensors checkpoint folder at `out`."""
  import torch
  import transformers

  from specjax.models.registry import get_spec

  path = get_spec(name).locate()
  kw = dict(gguf_file=path.name)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32,
                                                             **kw)
  config = loaded.config
  if hasattr(config, "quantization_config"):
    del config.quantization_config
  fresh = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  fresh.load_state_dict(loaded.state_dict())
  fresh.save_pretrained(out, max_shard_size="200MB")
  transformers.AutoTokenizer.from_pretrained(path.parent, **kw).save_pretrained(out)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default=",".join(MODELS))
  ap.add_argument("--per-category", type=int, default=1)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--data-dir", default=None)
  ap.add_argument("--write-docs", action="store_true")
  args = ap.parse_args()

  from specjax import data
  from specjax.decode.generate import generate
  from specjax.models.loader import load_model

  prompts = data.load_spec_bench(args.data_dir, per_category=args.per_category)
  figures, rows = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                   "machine": report.machine(), "commit": report.git_revision(),
                   "models": {}}, []
  for name in args.models.split(","):
    registered = load_model(name, dtype="float32", verbose=False)
    with tempfile.TemporaryDirectory() as tmp:
      folder = load_model(convert(name, Path(tmp) / name), dtype="float32", verbose=False)
      shards = len(list((Path(tmp) / name).glob("*.safetensors")))
    same = tok_same = chat_same = 0
    first_divergence = []
    for p in prompts:
      text = p.turns[0]
      ids = registered.tokenizer.encode_prompt(text)
      run = lambda m: generate(m.graphdef, m.state, m.config, ids, eos_ids=(),
                               max_new_tokens=args.max_new_tokens).tokens
      a, b = run(registered), run(folder)
      same += a == b
      if a != b:
        first_divergence.append(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y))
      tok_same += registered.tokenizer.encode(text, add_bos=False) == folder.tokenizer.encode(
          text, add_bos=False)
      if registered.tokenizer.is_chat:
        chat = [{"role": "user", "content": text}]
        chat_same += registered.tokenizer.render_chat(chat) == folder.tokenizer.render_chat(chat)
    figures["models"][name] = dict(same_tokens=same, shards=shards, tokenizer_same=tok_same,
                                   chat_text_same=chat_same,
                                   first_divergence=first_divergence)
    rows.append([name, shards, f"{same} / {len(prompts)}",
                 ", ".join(map(str, first_divergence)) or "–",
                 f"{tok_same} / {len(prompts)}", f"{chat_same} / {len(prompts)}"])
    print(f"{name}: {same} of {len(prompts)} prompts decode the same tokens", file=sys.stderr)
  table = report.markdown_table(
      ["model", "shards", "same greedy tokens", "first differing token", "same text ids",
       "same chat text"], rows)
  print(table, file=sys.stderr)
  if args.write_docs:
    report.write_section("hf-real-weights", "\n".join([
        "## Real weights through the Hugging Face folder path", "",
        f"Each model's GGUF file converted to a float32 safetensors checkpoint by "
        f"transformers, loaded by specjax from the folder, against the registered name: "
        f"{len(prompts)} Spec-Bench prompts (the same ids for both), {args.max_new_tokens} "
        f"greedy tokens. The tokenizer columns compare transformers' conversion of the "
        f"file's tokenizer with specjax's own. Machine: {report.machine()}; commit "
        f"{figures['commit']}.", "", table]))
  report.print_json(figures)


if __name__ == "__main__":
  main()
