"""specjax: self-speculative decoding of LLMs in JAX/Flax.

The names most programs need, importable from `specjax` itself:

    from specjax import load_model, generate, speculative_generate, DraftPlan
    from specjax import Int8WeightsDrafter, SelfSDDrafter   # and the other drafters

They resolve on first use (PEP 562), and no module of the package imports its root.

The package, by what each part is for:

    specjax/            the core: config, plan, model, cache_view, kv_cache,
                        quant_kv_cache, quant, sampling, jit_cache, compile_cache, errors, cli;
                        ops, the one place that picks a kernel or XLA for each op
    specjax/cpu_kernels/ C++ kernels XLA:CPU lacks, through jax.ffi (`build`: compiling them)
    specjax/models/     where models come from: registry, GGUF, tokenizer, params, tiny models
    specjax/decode/     prefill and AR (generate), the SSD engine, the on-device round loop
    specjax/drafters/   runtime drafting strategies, one per method, and overlays
    specjax/selection/  layer probes, the sub-layer DP, latency profiles, cost, BO
    specjax/offline/    artefacts built before decoding: Self-SD search, FR-Spec counts,
                        DynaSpec clusters and router, the KNN-SSD library
    specjax/bench/      data, drafter factory, harness, results store, metrics, claims, bench,
                        sweep, the llama.cpp baseline
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_model": "specjax.models.loader",
    "generate": "specjax.decode.generate",
    "speculative_generate": "specjax.decode.engine",
    "SSDGeneration": "specjax.decode.session",
    "DraftPlan": "specjax.plan",
    "PlanError": "specjax.plan",
    "SamplingParams": "specjax.sampling",
    "KVCache": "specjax.kv_cache",
    "QuantKV": "specjax.quant_kv_cache",
    "apply": "specjax.model",
    "Drafter": "specjax.drafters",
    "DRAFTERS": "specjax.drafters",
    "ClaspDrafter": "specjax.drafters",
    "DynaSpecDrafter": "specjax.drafters",
    "EarlyExitDrafter": "specjax.drafters",
    "FRSpecDrafter": "specjax.drafters",
    "Int8WeightsDrafter": "specjax.drafters",
    "KNNDrafter": "specjax.drafters",
    "KnapSpecDrafter": "specjax.drafters",
    "Q4WeightsDrafter": "specjax.drafters",
    "QuantSpecDrafter": "specjax.drafters",
    "SelfSDDrafter": "specjax.drafters",
    "StaticDrafter": "specjax.drafters",
    "SwiftDrafter": "specjax.drafters",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # resolved once
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))
