"""Shared fixtures: tiny random models of each family, and real models when installed."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Every module starts with no executables (`_fresh_executables`), so the tiny models'
# programs, the same in many modules and in both workers, used to be compiled again each
# time. A persistent compilation cache shared by this run's workers and subprocesses (the
# CLI, experiment scripts, notebook kernels) turns those repeats into loads from disk. It is
# made empty for each run and removed after, so no run reads another's executables
# (`JAX_COMPILATION_CACHE_DIR=` turns it off). Set before jax is imported: jax reads it
# from the environment then.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _XLA_CACHE = tempfile.mkdtemp(prefix="specjax-test-xla-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
  atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)  # the creator (controller)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.config import tiny_config
from specjax.kv_cache import KVCache
from specjax.model import apply, init_model
from specjax.plan import DraftPlan

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# Real-model tests write converted params here, not into the user's cache.
os.environ.setdefault("SPECJAX_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache"))

# Tiny models spend their test time in XLA's backend compiler, not in the programs it
# emits: most of the suite compiles with XLA's optimisations off (measured on two of the
# compile-heavy modules: 521 -> 347 CPU-seconds). Set in the environment, so subprocesses
# (the CLI, experiment scripts, notebook kernels) inherit it; tests marked `real` run their
# real-sized programs optimised (unoptimised they ran 1.8x slower).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
_OPTIMISE_DEFAULT = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] in ("0", "false", "False")


@pytest.fixture(scope="session", params=ARCHS)
def tiny(request):
  """(config, graphdef, state) of a random-init tiny model, one per family."""
  config = tiny_config(request.param)
  graphdef, state = nnx.split(init_model(config, seed=3))
  return config, graphdef, state


def real_model(name: str):
  """Load a real model or skip the test when its weights package is absent."""
  from specjax.models.loader import load_model
  from specjax.models.registry import get_spec, is_installed

  if not is_installed(get_spec(name)):
    pytest.skip(f"{name} weights package not installed ({get_spec(name).install})")
  return load_model(name, verbose=False)


def prompt_logits(config, graphdef, state, ids: np.ndarray) -> np.ndarray:
  """specjax's logits[B, T, V] of prompts ids[B, T], all tokens in one forward."""
  T = ids.shape[1]
  cache = KVCache.create(config, ids.shape[0], T)
  out, _ = apply(state, cache, jnp.asarray(ids), jnp.broadcast_to(jnp.arange(T), ids.shape),
                 DraftPlan.full(config.num_layers), graphdef=graphdef)
  return np.asarray(out.logits)


# Loading a GGUF through transformers takes 50-120 s a model, and its answer on a file never
# changes: the suite checks recorded outputs (`test_golden.py`, `make_goldens.py`) and runs
# the live comparisons on request.
LIVE = pytest.mark.skipif(os.environ.get("SPECJAX_LIVE_HF") != "1",
                          reason="loads the GGUF through transformers: set SPECJAX_LIVE_HF=1 "
                                 "(test_golden.py checks the recorded outputs)")


def pytest_configure(config):
  jax.config.update("jax_default_matmul_precision", "highest")


# The slowest modules, slowest first (seconds on the 2-core AMD EPYC, XLA optimisations as
# above, each beside the other worker's modules, with the compilation cache; `--junitxml`,
# 2026-11-26). `make test` hands whole modules to two workers in collection order
# (`--dist loadfile --no-loadscope-reorder`): started first, the long ones overlap; left to
# xdist's order (most tests first), the two-test real-model module started last and ran
# alone for minutes.
SLOW_MODULES = (
    "test_real_ssd",  # 362 s
    "test_round_loop",  # 314
    "test_quantspec",  # 246
    "test_engine",  # 222
    "test_drafter_factory",  # 189
    "test_dynaspec",  # 174
    "test_notebooks",  # 167
    "test_int8_weights",  # 140
    "test_knapspec",  # 108
    "test_model",  # 103
    "test_golden",  # 92
    "test_prefill",  # 89
)


def pytest_collection_modifyitems(items):
  """Slowest modules first (a stable sort: the order within a module is kept)."""
  rank = {name: i for i, name in enumerate(SLOW_MODULES)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def pytest_runtest_setup(item):
  """Compile a `real` test's programs (fixtures included) with XLA's optimisations on."""
  optimise = _OPTIMISE_DEFAULT or item.get_closest_marker("real") is not None
  jax.config.update("jax_disable_most_optimizations", not optimise)


@pytest.fixture(autouse=True, scope="module")
def _fresh_executables():
  """Each test module starts with no cached executables: kept for the whole suite they
  exhaust the kernel's map count (see `specjax.jit_cache`)."""
  yield
  from specjax import jit_cache

  jit_cache.clear()
