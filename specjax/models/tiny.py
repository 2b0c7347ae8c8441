"""Tiny models that behave like language models, for tests, demos and notebooks.

A random-init decoder is a poor target for testing a speculative decoder: its greedy
output collapses onto one or two tokens (a hub token of the embedding, or the current
token echoed back), so a cache, position or rollback bug yields the same tokens as a
correct engine, and a draft either always or never agrees with it. The tiny models here
are trained instead, for a few hundred optax steps on a synthetic *word language*:

* words are fixed strings of 2-5 symbols; inside a word the next symbol depends on the
  word's prefix (context, not just the last token), so attention matters;
* after a word comes a separator, then usually (p = 0.6) that word's favourite successor,
  else any word: the start of a word is uncertain, so drafts get partially accepted;
* the favourites form one cycle through every word, so greedy output walks through many
  words and tokens instead of repeating one.

Training is deterministic (fixed seeds) and cached on disk under `cache_root()/tiny`, per
jax version (written atomically), so a test session trains each (family, layers, vocab) once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from filelock import FileLock
from flax import nnx

from specjax.config import Arch, ModelConfig, tiny_config
from specjax.errors import ConfigError
from specjax.kv_cache import KVCache
from specjax.model import apply, init_model
from specjax.models import checkpoint
from specjax.models.params import abstract_model
from specjax.plan import DraftPlan
from specjax.storage import cache_root

TRAINER_VERSION = 4  # bump when the language, the recipe or a layout changes (2: always optimised; 3: gate_up [O, I]; 4: qkv [O, I])

# The byte-level tiny models (registry `tiny-*`, ByteTokenizer: id = byte + 3) speak a
# language of English words, so `specjax generate --model tiny-llama` prints words.
_ENGLISH = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "old", "red",
            "barn", "where", "cows", "eat", "hay", "in", "warm", "sun", "while", "birds",
            "sing", "of", "rain")
_BYTE_OFFSET = 3  # ByteTokenizer.OFFSET


@dataclasses.dataclass(frozen=True)
class WordLanguage:
  """Words over a vocabulary, a separator, and each word's favourite successor."""

  words: tuple[tuple[int, ...], ...]
  separator: int
  favourite: tuple[int, ...]  # favourite[w]: the word that usually follows word w
  p_favourite: float = 0.6

  @classmethod
  def for_vocab(cls, vocab_size: int, seed: int = 0) -> WordLanguage:
    """Random words over ids 4..V-1 (0-2 stay special, 3 separates), or English words in
    bytes for the byte vocabulary (259)."""
    rng = np.random.default_rng(seed)
    if vocab_size >= 256 + _BYTE_OFFSET:
      words = tuple(tuple(b + _BYTE_OFFSET for b in w.encode()) for w in _ENGLISH)
      sep = ord(" ") + _BYTE_OFFSET
    else:
      if vocab_size < 8:
        raise ConfigError(f"a word language needs vocab_size >= 8, got {vocab_size}")
      symbols = np.arange(4, vocab_size)
      count = int(np.clip(len(symbols) // 2, 4, 24))
      found: set[tuple[int, ...]] = set()
      while len(found) < count:
        size = int(rng.integers(2, 6))
        found.add(tuple(int(s) for s in rng.choice(symbols, size, replace=False)))
      words, sep = tuple(sorted(found)), 3
    order = rng.permutation(len(words))  # one cycle through every word
    favourite = np.empty(len(words), np.int64)
    favourite[order] = np.roll(order, -1)
    return cls(words, sep, tuple(int(f) for f in favourite))

  def sample(self, num_seqs: int, length: int, seed: int) -> np.ndarray:
    """int32[num_seqs, length] token streams (each starts mid-stream at a word)."""
    rng = np.random.default_rng(seed)
    out = np.empty((num_seqs, length), np.int32)
    for row in range(num_seqs):
      toks: list[int] = []
      w = int(rng.integers(len(self.words)))
      while len(toks) < length:
        toks += [*self.words[w], self.separator]
        fav = rng.random() < self.p_favourite
        w = self.favourite[w] if fav else int(rng.integers(len(self.words)))
      out[row] = toks[:length]
    return out


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a tiny model is trained (every field changes the weights: part of the cache key)."""

  steps: int = 300
  batch: int = 16
  length: int = 48
  learning_rate: float = 3e-3
  seed: int = 0


def _loss(state, tokens, *, graphdef, config: ModelConfig):
  B, T = tokens.shape
  cache = KVCache.create(config, B, T)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  out, _ = apply(state, cache, tokens, pos, DraftPlan.full(config.num_layers),
                 graphdef=graphdef, logits="all")
  logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@contextlib.contextmanager
def optimised():
  """XLA's optimisations on for what is compiled inside, whatever the process default. The
  test suite turns most of them off (its programs are small and run once), but training
  runs one program for hundreds of steps, where a step's time outweighs the longer
  compile."""
  off = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", off)


def train(config: ModelConfig, recipe: Recipe = Recipe(), verbose: bool = False) -> nnx.State:
  """Train a random-init `config` model on its word language; returns the params."""
  with optimised():
    return _train(config, recipe, verbose)


def _train(config: ModelConfig, recipe: Recipe, verbose: bool) -> nnx.State:
  graphdef, state = nnx.split(init_model(config, seed=recipe.seed))
  lang = WordLanguage.for_vocab(config.vocab_size, recipe.seed)
  data = lang.sample(recipe.steps * recipe.batch, recipe.length, recipe.seed + 1)
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, recipe.learning_rate, recipe.steps // 10, recipe.steps), weight_decay=0.0)
  loss = functools.partial(_loss, graphdef=graphdef, config=config)

  @jax.jit
  def step(state, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(state, batch)
    updates, opt_state = opt.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, value

  opt_state = opt.init(state)
  batches = data.reshape(recipe.steps, recipe.batch, recipe.length)
  for i, batch in enumerate(batches):
    state, opt_state, value = step(state, opt_state, jnp.asarray(batch))
    if verbose and (i + 1) % 100 == 0:
      print(f"  step {i + 1}: loss {float(value):.3f}")
  return state


def _key(config: ModelConfig, recipe: Recipe) -> str:
  """The cache key of a trained model. The jax version is part of it: XLA's arithmetic
  differs between releases (two trained the same llama 3e-6 apart), and a test's drafts may
  agree or not on such a difference, so each jax trains and tests its own."""
  blob = json.dumps([TRAINER_VERSION, jax.__version__, dataclasses.asdict(config),
                     dataclasses.asdict(recipe)], sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


@functools.cache
def tiny_model(arch: Arch, *, num_layers: int = 4, vocab_size: int = 97,
               recipe: Recipe = Recipe(), **overrides
               ) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """(config, graphdef, state) of a trained tiny `arch` model, from the disk cache when
  there (`overrides` replace config fields, e.g. max_context)."""
  config = dataclasses.replace(
      tiny_config(arch, num_layers=num_layers, vocab_size=vocab_size), **overrides)
  graphdef, like = abstract_model(config)  # shapes alone: a random init compiles its draws
  folder = Path(cache_root()) / "tiny" / f"{arch}-{_key(config, recipe)}"
  folder.parent.mkdir(parents=True, exist_ok=True)
  with FileLock(str(folder) + ".lock"):  # parallel test workers train each model once
    try:
      nnx.replace_by_pure_dict(like, checkpoint.restore_tree(folder, nnx.to_pure_dict(like)))
      return config, graphdef, like
    except checkpoint.CheckpointError:
      state = train(config, recipe)
      checkpoint.save_tree(folder, nnx.to_pure_dict(state),
                           {"config": dataclasses.asdict(config)})
  return config, graphdef, state
