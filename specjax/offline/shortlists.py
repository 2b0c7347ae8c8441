"""Build what the vocabulary drafters read, for one model, from training prompts only:
FR-Spec's token counts and DynaSpec's clusters + router (`specjax router train`).

Training prompts are GSM8K train questions and Spec-Bench prompts past the first
`RESERVED` of each category — the benchmarks evaluate on those first ones, never seen
here. FR-Spec counts tokens in `prompts` of them, each extended by the model's own greedy
continuation (what the draft will have to predict). The router learns from the target's
distributions, which any text gives, so it also reads `router_prompts` prompts without a
continuation: more pairs at one forward each (its recall grows with them, see
`offline.router`). Everything is written under one folder as it is made
(sequences.json, counts.npz, the router's training pairs in chunks, router/, curves.png),
so a crash resumes where it stopped, and a router of an older design is trained again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from specjax import data, gguf_matrix, plots
from specjax.models.source import artefact_key
from specjax.offline.router import (
  DEFAULT_INPUTS,
  Pairs,
  RouterBundle,
  collect_pairs,
  is_current,
  load_bundle,
  save_bundle,
  train_router,
)
from specjax.offline.token_counts import count_tokens, load_counts, save_counts
from specjax.offline.vocab_clusters import spherical_kmeans

RESERVED = 5  # Spec-Bench prompts per category kept for evaluation
CLUSTERS = 1024  # the router's default M


def folder(model, clusters: int = CLUSTERS, inputs: str = DEFAULT_INPUTS) -> Path:
  """Where specjax keeps the counts and router of `model` (a model, or its `artefact_key`):
  one folder per model, and one inside it per other cluster count or router input."""
  from specjax.storage import cache_root

  root = cache_root() / "shortlists" / (model if isinstance(model, str) else artefact_key(model))
  other = ([f"c{clusters}"] if clusters != CLUSTERS else []) + (
      [f"input-{inputs}"] if inputs != DEFAULT_INPUTS else [])
  return root / "-".join(other) if other else root


def share_continuations(src: Path, dst: Path) -> None:
  """Copy `src`'s training continuations (sequences.json) into `dst` when it has none:
  a model's folders train on the same text, and each continuation costs a generation."""
  have, want = Path(src) / "sequences.json", Path(dst) / "sequences.json"
  if have.exists() and not want.exists():
    want.parent.mkdir(parents=True, exist_ok=True)
    want.write_text(have.read_text())


def training_prompts(tokenizer, count: int, data_dir=None) -> list[list[int]]:
  """`count` chat-formatted training prompts: half GSM8K train, half held-out Spec-Bench."""
  spec = data.load_spec_bench(data_dir)
  by_cat: dict[str, list] = {}
  for p in spec:
    by_cat.setdefault(p.category, []).append(p)
  held = [p for ps in by_cat.values() for p in ps[RESERVED:]]
  rng = np.random.default_rng(0)
  held = [held[i] for i in rng.permutation(len(held))[: count - count // 2]]
  gsm = data.load_gsm8k(data_dir, limit=count // 2)
  encode = lambda text: tokenizer.encode_chat([{"role": "user", "content": text}]) \
      if getattr(tokenizer, "is_chat", False) else tokenizer.encode(text)
  return [encode(p.turns[0])[:768] for p in held + gsm]


def sequences(model, out: Path, prompts: list[list[int]], new_tokens: int,
              verbose: bool = True) -> list[list[int]]:
  """`prompts` + the model's greedy continuations, cached in sequences.json."""
  from tqdm.auto import tqdm

  from specjax.decode.generate import generate

  path = out / "sequences.json"
  done = json.loads(path.read_text()) if path.exists() else []
  for ids in tqdm(prompts[len(done):], desc="own continuations", unit="prompt",
                  disable=not verbose, initial=len(done), total=len(prompts)):
    g = generate(model.graphdef, model.state, model.config, ids, max_new_tokens=new_tokens)
    done.append(list(ids) + g.tokens)
    path.write_text(json.dumps(done))  # as it goes: a crash loses one prompt at most
  return done


def build_counts(model, out: Path, *, prompts: int = 48, new_tokens: int = 48,
                 data_dir=None, verbose: bool = True) -> np.ndarray:
  """FR-Spec's token counts for `model` (out/counts.npz, reused when there), over `prompts`
  training prompts and the model's continuations of `new_tokens`: all that FR-Spec reads,
  so `frspec` never waits for a router to train. Present counts read no training data."""
  out.mkdir(parents=True, exist_ok=True)
  path = out / "counts.npz"
  if path.exists():
    return load_counts(path, model=artefact_key(model))
  seqs = sequences(model, out, training_prompts(model.tokenizer, prompts, data_dir),
                   new_tokens, verbose)
  counts = count_tokens(model, seqs, new_tokens=0, verbose=verbose)
  save_counts(path, counts, model=artefact_key(model), sequences=len(seqs))
  return counts


def build(model, out: Path, *, prompts: int = 48, new_tokens: int = 48,
          router_prompts: int = 320, clusters: int = CLUSTERS, k_max: int = 16,
          hidden: int = 1024, inputs: str = DEFAULT_INPUTS, epochs: int = 10,
          decay: bool = False,
          continuation_weight: float = 1.0, keep_pairs: bool = False, data_dir=None,
          verbose: bool = True) -> tuple[np.ndarray, RouterBundle, dict]:
  """Counts (`build_counts`) and router bundle for `model` (reused from `out` when already
  there, of this design and reading `inputs`). `continuation_weight` weighs the router's loss at the
  positions inside the model's own continuations, the text a draft predicts, against
  prompt text's 1. `keep_pairs` keeps the router's training pairs under out/pairs (about
  8 KB a token on the 1.5B) for ablations that train other routers on them
  (`experiments/router_ablation.py`) without the target's forwards again; by default they
  go once the router is trained. With both artefacts there no training data is read (a
  machine may have neither it nor the packages that read it)."""
  counts = build_counts(model, out, prompts=prompts, new_tokens=new_tokens, data_dir=data_dir,
                        verbose=verbose)
  router_dir, curves_path = out / "router", out / "curves.json"
  if is_current(router_dir, inputs):
    bundle = load_bundle(router_dir, model=artefact_key(model))
    curves = json.loads(curves_path.read_text()) if curves_path.exists() else {}
    _warn_if_other_settings(router_dir, clusters=clusters, k_max=k_max, hidden=hidden,
                            continuation_weight=continuation_weight)
    return counts, bundle, curves
  continued = training_prompts(model.tokenizer, prompts, data_dir)
  seqs = sequences(model, out, continued, new_tokens, verbose)  # as build_counts left them
  from flax import nnx

  rows = np.asarray(_head_rows(nnx.merge(model.graphdef, model.state)))
  vc = spherical_kmeans(rows, clusters, iterations=15, verbose=verbose)
  texts = router_texts(model.tokenizer, seqs, continued, router_prompts, data_dir)
  pairs = collect_pairs(model, texts, vc, verbose=verbose, save_dir=out / "pairs")
  weight = continuation_weights(pairs, [len(p) for p in continued], continuation_weight)
  result = train_router(pairs, vc, k_max=k_max, hidden=hidden, inputs=inputs, epochs=epochs,
                        weight=weight, verbose=verbose)
  bundle = RouterBundle(artefact_key(model), result.router, vc, k_max, hidden, decay)
  curves = dict(inputs=inputs, train_loss=result.train_loss, val_loss=result.val_loss,
                best_epoch=result.best_epoch, val_recall=result.val_recall,
                pairs=int(pairs.target.size), continuation_weight=continuation_weight)
  save_bundle(router_dir, bundle, pairs=curves["pairs"], sequences=len(texts),
              continuation_weight=continuation_weight)
  curves_path.write_text(json.dumps(curves))
  plot_curves(curves, out / "curves.png", model.name, k_max)
  if not keep_pairs:  # otherwise kept only to resume a crashed build
    shutil.rmtree(out / "pairs", ignore_errors=True)
  return counts, bundle, curves


def _warn_if_other_settings(router_dir: Path, **asked) -> None:
  """The router in the cache is reused as it is: say so when it was trained otherwise."""
  import warnings

  from specjax.models import checkpoint

  meta = checkpoint.load_meta(router_dir)
  meta.setdefault("continuation_weight", 1.0)
  other = {k: (meta.get(k), v) for k, v in asked.items() if meta.get(k) != v}
  if other:
    said = ", ".join(f"{k} {was} (asked {v})" for k, (was, v) in other.items())
    warnings.warn(f"reusing the router at {router_dir}, trained with {said}: delete that "
                  f"folder to train one with these settings", stacklevel=3)


def router_texts(tokenizer, continued_sequences: list[list[int]],
                 continued_prompts: list[list[int]], router_prompts: int, data_dir=None
                 ) -> list[list[int]]:
  """The router's training sequences, in the order their pairs are stored: the continued
  ones (prompt + the model's continuation), then the first `router_prompts` training
  prompts that are not among them."""
  seen = {tuple(p) for p in continued_prompts}
  more = [p for p in training_prompts(tokenizer, router_prompts, data_dir)
          if tuple(p) not in seen]
  return list(continued_sequences) + more


def in_continuation(pairs: Pairs, prompt_lengths: list[int]) -> np.ndarray:
  """bool[N]: the pair lies inside a continuation — sequence g < len(prompt_lengths), from
  position prompt_lengths[g] − 1 on (it predicts the model's own tokens). Pairs come
  sequence by sequence, in order, each sequence whole."""
  group = pairs.group
  start = np.full(int(group.max()) + 1, np.iinfo(np.int64).max)
  start[: len(prompt_lengths)] = prompt_lengths
  pos = np.arange(group.size) - np.searchsorted(group, group)
  return pos >= start[group] - 1


def continuation_weights(pairs: Pairs, prompt_lengths: list[int], weight: float
                         ) -> np.ndarray | None:
  """`weight` at the pairs inside a continuation (`in_continuation`) and 1 elsewhere;
  None when `weight` is 1."""
  if weight == 1.0:
    return None
  return np.where(in_continuation(pairs, prompt_lengths), weight, 1.0).astype(np.float32)


def _head_rows(module):
  """The LM head as float rows [V, D] (dequantised from a GGUF target's blocks)."""
  own = (module.embedding if module.config.tie_embeddings else module.lm_head).get_value()
  if isinstance(own, gguf_matrix.GGUFMatrix):
    return own.dequantize()
  return own if module.config.tie_embeddings else own.T


def plot_curves(curves: dict, path: Path, name: str, k_max: int) -> None:
  plt = plots.pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
  ep = np.arange(len(curves["val_loss"]))
  a.plot(ep[1:], curves["train_loss"][1:], label="train")
  a.plot(ep, curves["val_loss"], label="validation")
  a.set_xlabel("epoch")
  a.set_ylabel("cross-entropy over clusters")
  a.legend()
  b.plot(ep, curves["val_recall"])
  b.set_xlabel("epoch")
  b.set_ylabel(f"validation recall@{k_max} clusters\n(the target's top token)")
  fig.suptitle(f"DynaSpec router, {name}")
  plots.save(fig, path)
