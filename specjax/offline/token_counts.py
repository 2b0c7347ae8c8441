"""FR-Spec's token counts (Zhao et al. 2025): how often each token appears in training
prompts and in the model's own greedy continuations of them, saved with the model name,
and the shortlist of the most frequent tokens they give (`drafters.frspec` reads it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specjax.errors import ConfigError, SpecjaxError


class CountsMismatchError(SpecjaxError, ValueError):
  pass


def count_tokens(model, prompts: Sequence[Sequence[int]], new_tokens: int = 48,
                 verbose: bool = True) -> np.ndarray:
  """Token counts int64[V] over the prompts and the model's greedy continuations."""
  from tqdm.auto import tqdm

  from specjax.decode.generate import generate

  counts = np.zeros(model.config.vocab_size, np.int64)
  for ids in tqdm(prompts, desc="token counts", unit="prompt", disable=not verbose):
    np.add.at(counts, np.asarray(ids), 1)
    if new_tokens:
      g = generate(model.graphdef, model.state, model.config, list(ids),
                   max_new_tokens=new_tokens)
      np.add.at(counts, np.asarray(g.tokens), 1)
  return counts


def save_counts(path: str | Path, counts: np.ndarray, *, model: str, **meta) -> None:
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp.npz")
  np.savez(tmp, counts=counts, meta=json.dumps({"model": model, **meta}))
  tmp.replace(path)


def load_counts(path: str | Path, *, model: str) -> np.ndarray:
  with np.load(Path(path)) as f:
    meta = json.loads(str(f["meta"]))
    if meta["model"] != model:
      raise CountsMismatchError(f"{path} holds token counts of {meta['model']}, not {model}")
    return f["counts"]


def frequent_shortlist(counts: np.ndarray, size: int, eos_ids: Sequence[int] = ()
                       ) -> np.ndarray:
  """The `size` most frequent ids (ties by id), EOS ids always in."""
  if not 0 < size <= counts.size:
    raise ConfigError(f"shortlist size must be in 1..{counts.size}, got {size}")
  eos = [int(e) for e in eos_ids]
  order = np.lexsort((np.arange(counts.size), -counts))
  rest = order[~np.isin(order, eos)][: max(size - len(eos), 0)]
  return np.concatenate([np.asarray(eos, np.int64), rest])[:size]
