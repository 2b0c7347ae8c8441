"""Record HF transformers' outputs on the real GGUF models as golden files (`tests/golden/`).

    python tests/make_goldens.py [--models smollm2-135m-instruct,...]

`test_golden.py` checks specjax against these files on every run; loading a GGUF through
transformers (de-quantising every tensor in Python) took 50-120 s a model, most of the
suite's reference time, while transformers' answer on a given file never changes. Each
golden names the GGUF's SHA-256, so a test against another file fails and says to rerun
this script. The live comparisons stay in `test_parity_hf.py` and `test_weights.py`
(`SPECJAX_LIVE_HF=1`). Needs torch and transformers (`pip install -e ".[bench]"`).

Per model, `<name>.npz` holds, for the prompt `PROMPT` (T tokens):
  - the full-vocabulary argmax, log-sum-exp and max |logit| of every position;
  - the logits of every position's 32 highest entries, and of 512 vocabulary ids drawn
    once (seed 0) for all positions: the file stays small (the full [T, V] is 10 MB on a
    151k vocabulary) and still samples the whole vocabulary;
  - 32 greedy tokens after the prompt (`generate`, no EOS);
and `<name>.json` the tokenizer's ids of `TEXTS`, the chat template rendered,
and where the figures come from.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
PROMPT = "Speculative decoding drafts tokens cheaply and verifies them with the full model, so"
MODELS = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct",
          "qwen2.5-coder-1.5b-instruct")
TOP, SAMPLED, NEW_TOKENS = 32, 512, 32
CHAT = [{"role": "user", "content": "hi"}]
# Tokenizer inputs: whitespace runs, code, non-Latin scripts, emoji, every family's chat
# markers, contractions.
TEXTS = [
    "The capital of France is",
    "Hello world!\n\n  indented\tcode",
    "def f(x):\n    return x**2  # square",
    "Ünïcödé façade — “quotes” 你好世界 🤖",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<start_of_turn>user\nhi<end_of_turn>",
    " leading space, don't won't I'll",
]


def sha256(path: Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 24), b""):
      h.update(block)
  return h.hexdigest()


def logit_summary(logits: np.ndarray) -> dict[str, np.ndarray]:
  """What a golden keeps of [T, V] logits (see the module docstring)."""
  V = logits.shape[-1]
  top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]
  sampled = np.sort(np.random.default_rng(0).choice(V, SAMPLED, replace=False))
  m = logits.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
  return {"argmax": logits.argmax(-1), "lse": lse, "scale": np.abs(logits).max(-1),
          "top_ids": top, "top_logits": np.take_along_axis(logits, top, -1),
          "sampled_ids": sampled, "sampled_logits": logits[:, sampled]}


def load_hf(gguf: Path, model: bool = True):
  """(float32 causal LM or None, tokenizer) that transformers builds from a GGUF file."""
  import torch
  import transformers

  with tempfile.TemporaryDirectory() as tmp:
    (Path(tmp) / "m.gguf").symlink_to(gguf)
    tok = transformers.AutoTokenizer.from_pretrained(tmp, gguf_file="m.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, gguf_file="m.gguf", dtype=torch.float32).eval() if model else None
  return hf, tok


def record(name: str) -> None:
  import torch
  import transformers

  from specjax.models.loader import load_model
  from specjax.models.registry import get_spec

  gguf = get_spec(name).locate()
  ids = load_model(name, verbose=False).tokenizer.encode(PROMPT)
  hf, tok = load_hf(gguf)
  with torch.no_grad():
    logits = hf(torch.tensor([ids])).logits[0].float().numpy()
    greedy = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
  GOLDEN.mkdir(exist_ok=True)
  np.savez_compressed(GOLDEN / f"{name}.npz", prompt_ids=np.asarray(ids), greedy=greedy,
                      **logit_summary(logits))
  meta = {
      "model": name, "gguf": gguf.name, "gguf_sha256": sha256(gguf),
      "install": get_spec(name).install, "prompt": PROMPT,
      "recorded_with": {"transformers": transformers.__version__, "torch": torch.__version__},
      "date": datetime.date.today().isoformat(), "command": "python tests/make_goldens.py",
      "tokenizer": {"texts": TEXTS,
                    "ids": [tok(t, add_special_tokens=False).input_ids for t in TEXTS],
                    "chat": CHAT,
                    "chat_rendered": tok.apply_chat_template(
                        CHAT, tokenize=False, add_generation_prompt=True)
                                     if tok.chat_template else None},
  }
  (GOLDEN / f"{name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default=",".join(MODELS),
                  help="comma-separated; models whose weights are not installed are skipped")
  args = ap.parse_args()
  sys.path.insert(0, str(HERE))
  from specjax.models.registry import get_spec, is_installed

  for name in args.models.split(","):
    if not is_installed(get_spec(name)):
      print(f"{name}: weights not installed ({get_spec(name).install}), skipped")
      continue
    record(name)
    print(f"{name}: wrote {GOLDEN / name}.npz and .json", flush=True)


if __name__ == "__main__":
  main()
