"""Shared fixtures: tiny random models of each family, and real models when installed."""

from __future__ import annotations

import atexit
import gc
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

# Two workers share two cores: each runs its programs' Eigen ops on one thread instead of
# both workers' pools of two contending for them (two compile-heavy slices side by side:
# 144 -> 127 s; a SmolLM2 SSD test alone was no slower, 106 -> 96 s). Inherited by
# subprocesses, which also run beside the other worker.
_EIGEN_FLAG = "--xla_cpu_multi_thread_eigen=false"
if _EIGEN_FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_EIGEN_FLAG}".strip()

# Tracing allocates many short-lived objects: with Python's default thresholds the collector
# ran 2485 times in test_prefill + test_generate (3.7 s, 3.0 of them full collections over
# the heap of live executables and arrays); with these, 23 times (1.0 s).
gc.set_threshold(50_000, 20, 50)

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


_ELEMENTAL = [True]  # this test may use the elemental emitters (`pytest_runtest_setup`)


def _xla_knows_option(name: str, value) -> bool:
  """Whether this jax's XLA takes the compile option `name` (XLA drops options between
  releases, and a compile that names an unknown one fails)."""
  try:
    jax.jit(lambda x: x, compiler_options={name: value}).lower(0.0).compile()
  except jax.errors.JaxRuntimeError:
    return False
  return True


def _elemental_codegen_when_unoptimised() -> None:
  """Unoptimised programs skip XLA:CPU's MLIR fusion emitters for its elemental ones.

  Half the backend compile of a tiny model's program is the MLIR pipeline each fusion goes
  through (perf on a device-loop compile). The elemental emitters compile test_prefill
  and test_generate 20-24 % faster (138 -> 105-110 s) and emit slower code, which tiny programs do
  not notice but real ones do (a SmolLM2 SSD test ran 106 -> 212 s): so `real` tests,
  compiled optimised, keep the fusion emitters. XLA's flag is per process; jax takes
  per-compile overrides only as `jit(compiler_options=...)`, hence the wrapper. Tests marked
  `fusion_emitters` keep them: where to contract a·b + c into an FMA differs between the
  two, so a bit-for-bit comparison of two programs holds under one and not the other."""
  from jax._src import compiler

  if not _xla_knows_option("xla_cpu_use_fusion_emitters", False):
    return  # jax >= 0.11: XLA:CPU has only the fusion emitters
  original = compiler.get_compile_options

  def get_compile_options(*args, env_options_overrides=None, **kwargs):
    if jax.config.read("jax_disable_most_optimizations") and _ELEMENTAL[0]:
      env_options_overrides = {"xla_cpu_use_fusion_emitters": False,
                               **(env_options_overrides or {})}
    return original(*args, env_options_overrides=env_options_overrides, **kwargs)

  compiler.get_compile_options = get_compile_options


def pytest_configure(config):
  jax.config.update("jax_default_matmul_precision", "highest")
  _elemental_codegen_when_unoptimised()


# The slowest modules, slowest first (worker-seconds on the 2-core AMD EPYC, each beside the
# other worker's modules, from an empty `.cache` and compilation cache: a cold run of the
# suite as configured here, 2026-11-29, 1197 s wall). `make test` hands whole modules to two
# workers in collection order (`--dist loadfile --no-loadscope-reorder`): started first, the
# long ones overlap; left to xdist's order (most tests first), a long module started last
# and ran alone for minutes.
# test_tensor_parallel is left out on purpose: its child processes compute on 8 fake
# devices, and started last, alone, it took 274 s; listed first, beside the other worker's
# modules, 378 s. Both orders ran the suite in the same wall time (2026-12-07: 1528 and
# 1532 s; the compatibility run 314 and 315 s).
SLOW_MODULES = (
    # the compatibility run's longest (113 s; torch is only there): started last, it ran
    # alone while the other worker sat idle. The main run skips it at once.
    "test_hf_transformers",
    "test_round_loop",  # 313 s (some of them training the tiny targets it asks for first)
    "test_real_ssd",  # 292
    "test_notebooks",  # 221
    "test_quantspec",  # 199
    "test_dynaspec",  # 126
    "test_drafter_factory",  # 121
    "test_golden",  # 112
    "test_engine",  # 98
    "test_bench_gpu_script",  # 85
    "test_int8_weights",  # 71
    "test_model",  # 70
    "test_knapspec",  # 66
    "test_prefill",  # 60
    "test_draft_length",  # 51
)


def pytest_collection_modifyitems(items):
  """Slowest modules first (a stable sort: the order within a module is kept)."""
  rank = {name: i for i, name in enumerate(SLOW_MODULES)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def pytest_runtest_setup(item):
  """Compile a `real` test's programs (fixtures included) with XLA's optimisations on, and
  a `fusion_emitters` test's with XLA:CPU's default emitters."""
  optimise = _OPTIMISE_DEFAULT or item.get_closest_marker("real") is not None
  jax.config.update("jax_disable_most_optimizations", not optimise)
  _ELEMENTAL[0] = item.get_closest_marker("fusion_emitters") is None


@pytest.fixture(autouse=True, scope="module")
def _fresh_executables():
  """Each test module starts with no cached executables: kept for the whole suite they
  exhaust the kernel's map count (see `specjax.jit_cache`)."""
  yield
  from specjax import jit_cache

  jit_cache.clear()
