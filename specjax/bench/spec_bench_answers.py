"""Spec-Bench's model-answer files, written from `specjax bench`'s records.

Spec-Bench (Xia et al., 2024; github.com/hemingkx/Spec-Bench) keeps one JSON-lines file
per method and run, a line per question, and reads them with `evaluation/speed.py`
(tokens per second and speedup over a baseline file, mean accepted tokens) and
`evaluation/equal.py` (whether two methods' answer texts are identical). Writing the same
files lets specjax's runs be read by those scripts, unchanged, beside the other methods
Spec-Bench reports.

Per line: `question_id`, `category`, `answer_id`, `model_id`, `tstamp` and one choice
holding per turn the answer text (`turns`), the tokens generated (`new_tokens`), the
seconds spent (`wall_time`) and the verification rounds (`decoding_steps`), plus
`accept_lengths`: the tokens each verification round committed (the bonus token included;
M is their mean), one per generated token for AR. `wall_time` is the turn's prefill and
decode seconds; compiles are not in it (`specjax bench` warms every program up first),
and methods reading the same kind of KV cache share one timed prefill of the prompt, so
their wall times carry the same prefill seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from specjax.bench import llama_cpp
from specjax.errors import ConfigError

# A record's fields this format needs (`harness.run_prompt` writes them).
FIELDS = ("turn_prefill_s", "turn_decode_s", "round_committed", "tokens")


def file_name(model_id: str, method: str, dtype: str, temperature: float) -> str:
  """Spec-Bench's file name: `{model}-{method}-{dtype}-temperature-{T}.jsonl`."""
  safe = model_id.replace("/", "--")
  return f"{safe}-{method}-{dtype}-temperature-{float(temperature)}.jsonl"


def question_id(prompt_id: str) -> int | str:
  """`spec_bench/81` -> 81 (Spec-Bench's own id); other sources keep their id's tail."""
  tail = str(prompt_id).rsplit("/", 1)[-1]
  return int(tail) if tail.isdigit() else tail


def answer(record: dict, decode, model_id: str) -> dict:
  """One question's line from one method's record; `decode(ids) -> text`."""
  missing = [f for f in FIELDS if f not in record]
  if missing:
    raise ConfigError(
        f"the record of {record.get('method')} on {record.get('prompt_id')} lacks "
        f"{', '.join(missing)}: it was made by an older specjax; run the bench again "
        f"without --resume (or into a new --out) to write Spec-Bench answers")
  turns = record["tokens"]
  new_tokens = [len(t) for t in turns]
  wall = [p + d for p, d in zip(record["turn_prefill_s"], record["turn_decode_s"])]
  if record.get("is_reference"):  # AR: a token a step
    steps, accepts = new_tokens, [1] * sum(new_tokens)
  else:
    steps = [len(r) for r in record["round_committed"]]
    accepts = [n for r in record["round_committed"] for n in r]
  return {
      "question_id": question_id(record["prompt_id"]),
      "category": record["category"],
      "answer_id": f"{record['method']}-{record['prompt_id']}",
      "model_id": model_id,
      "choices": [{"index": 0, "turns": [decode(t) for t in turns],
                   "decoding_steps": steps, "new_tokens": new_tokens,
                   "wall_time": [round(s, 6) for s in wall], "accept_lengths": accepts}],
      "tstamp": time.time(),
  }


def write(records: Iterable[dict], decode, out_dir: Path, *, model_id: str, dtype: str,
          temperature: float, methods: Sequence[str] | None = None) -> dict[str, Path]:
  """One answer file per method in `out_dir` (replaced), questions in the records' order;
  returns {method: path}. `methods` limits which (default every method but llama.cpp's
  row, which times its decoding alone and has no rounds)."""
  by_method: dict[str, list[dict]] = {}
  for rec in records:
    if rec["method"] == llama_cpp.METHOD:
      continue
    by_method.setdefault(rec["method"], []).append(rec)
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = {}
  for method, recs in by_method.items():
    if methods is not None and method not in methods:
      continue
    path = out_dir / file_name(model_id, method, dtype, temperature)
    lines = [json.dumps(answer(r, decode, model_id), ensure_ascii=False) for r in recs]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(path)
    paths[method] = path
  return paths
