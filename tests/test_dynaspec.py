"""DynaSpec: balanced spherical k-means invariants, a router whose optax training lowers
validation loss, a bit-exact checkpoint, lossless drafting (alone and on a layer
drafter), and clear errors for k > M and a router of another model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.config import tiny_config
from specjax.drafters import DynaSpecDrafter, EarlyExitDrafter
from specjax.engine import speculative_generate
from specjax.generate import generate
from specjax.model import init_model
from specjax.router import (RouterBundle, RouterMismatchError, collect_pairs, k_schedule,
                            load_bundle, recall_at, save_bundle, train_router)
from specjax.sampling import SamplingParams
from specjax.vocab_clusters import balanced_assignment, spherical_kmeans

V = 97
PROMPT = list(range(3, 40))


@functools.cache
def tiny(arch: str = "llama"):
  config = tiny_config(arch, num_layers=4, vocab_size=V)
  graphdef, state = nnx.split(init_model(config, seed=4))

  class M:
    name = f"tiny-{arch}"

  m = M()
  m.config, m.graphdef, m.state = config, graphdef, state
  return m


@functools.cache
def bundle(arch: str = "llama", k_max: int = 3) -> tuple[RouterBundle, object]:
  m = tiny(arch)
  rows = np.asarray(nnx.merge(m.graphdef, m.state).embedding[...])
  clusters = spherical_kmeans(rows, 8, iterations=10)
  rng = np.random.default_rng(0)
  seqs = []
  for i in range(24):  # random prompts and the model's own continuations of them
    prompt = rng.integers(1, V, 12).tolist()
    g = generate(m.graphdef, m.state, m.config, prompt, max_new_tokens=20, eos_ids=())
    seqs.append(prompt + g.tokens)
  pairs = collect_pairs(m, seqs, verbose=False)
  result = train_router(pairs, clusters, k_max=k_max, hidden=64, epochs=6, batch=32,
                        verbose=False)
  return RouterBundle(m.name, result.router, clusters, k_max, 64), (result, pairs)


def test_kmeans_invariants_on_clustered_vectors():
  rng = np.random.default_rng(1)
  centres = rng.normal(size=(6, 16))
  labels = rng.integers(0, 6, 600)
  x = centres[labels] + 0.05 * rng.normal(size=(600, 16))
  c = spherical_kmeans(x, 6, iterations=8, seed=2)
  assert np.allclose(np.linalg.norm(c.centroids, axis=1), 1.0, atol=1e-5)
  ids = c.table[c.table >= 0]
  assert np.array_equal(np.sort(ids), np.arange(600))  # every token exactly once
  assert c.sizes().max() <= c.capacity
  for k in range(6):  # table rows agree with the assignment
    assert set(c.table[k][c.table[k] >= 0]) == set(np.flatnonzero(c.assignment == k))
  assert all(b >= a - 1e-6 for a, b in zip(c.objective, c.objective[1:]))  # Lloyd: monotone
  # Well-separated clusters are recovered (up to renaming).
  for k in range(6):
    assert len(set(c.assignment[labels == k])) == 1


def test_balanced_assignment_respects_capacity():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(200, 8)), jnp.float32)
  cents = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
  cents = cents / jnp.linalg.norm(cents, axis=1, keepdims=True)
  a = balanced_assignment(x, cents, capacity=41)
  assert np.bincount(a, minlength=5).max() <= 41 and (a >= 0).all()
  with pytest.raises(ValueError, match="cannot hold"):
    balanced_assignment(x, cents, capacity=39)


def test_router_training_lowers_validation_loss():
  _, (result, pairs) = bundle()
  assert result.val_loss[-1] < result.val_loss[0] - 0.05
  assert result.val_recall[-1] >= result.val_recall[0]


def test_k_schedule():
  assert k_schedule(8, 6) == (8, 8, 1, 1, 1, 1)
  assert k_schedule(32, 5) == (32, 32, 5, 4, 3)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dynaspec_is_lossless(arch):
  m = tiny(arch)
  b, _ = bundle(arch)
  ar = generate(m.graphdef, m.state, m.config, PROMPT, max_new_tokens=40, eos_ids=()).tokens
  for drafter in (DynaSpecDrafter(b), DynaSpecDrafter(b, EarlyExitDrafter(k=2))):
    out = speculative_generate(m.graphdef, m.state, m.config, PROMPT, drafter,
                               max_new_tokens=40, gamma=4, eos_ids=())
    assert out.tokens == ar
    assert out.accepted > 0


def test_dynaspec_sampling_runs():
  m = tiny()
  b, _ = bundle()
  out = speculative_generate(m.graphdef, m.state, m.config, PROMPT, DynaSpecDrafter(b),
                             max_new_tokens=24, gamma=3, eos_ids=(),
                             sampling=SamplingParams(1.0, 1.0))
  assert len(out.tokens) == 24 and out.drafted > 0


def test_bundle_round_trips_bit_exactly_and_is_checked(tmp_path):
  b, (_, pairs) = bundle()
  save_bundle(tmp_path / "r", b)
  back = load_bundle(tmp_path / "r", model=b.model)
  for x, y in zip(jax.tree.leaves(nnx.state(b.router)), jax.tree.leaves(nnx.state(back.router))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_array_equal(back.clusters.table, b.clusters.table)
  assert recall_at(back.router, pairs, back.clusters, 3) == recall_at(b.router, pairs,
                                                                     b.clusters, 3)
  with pytest.raises(RouterMismatchError, match="trained for tiny-llama, not other"):
    load_bundle(tmp_path / "r", model="other")


def test_bad_router_settings_are_clear_errors():
  b, _ = bundle()
  with pytest.raises(ValueError, match="k_max = 9 clusters, but there are only 8"):
    DynaSpecDrafter(RouterBundle(b.model, b.router, b.clusters, 9, 64))
  with pytest.raises(ValueError, match="needs a trained router"):
    DynaSpecDrafter()
  other = tiny_config("llama", num_layers=4, vocab_size=120)
  g, s = nnx.split(init_model(other, seed=0))
  with pytest.raises(RouterMismatchError, match="covers 97 tokens"):
    speculative_generate(g, s, other, PROMPT, DynaSpecDrafter(b), max_new_tokens=8)
