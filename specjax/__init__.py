"""specjax: self-speculative decoding of LLMs in JAX/Flax.

The names most programs need, importable from `specjax` itself:

    from specjax import load_model, generate, speculative_generate, DraftPlan
    from specjax import Int8WeightsDrafter, SelfSDDrafter   # and the other drafters

They resolve on first use (PEP 562), and no module of the package imports its root.
`generate` is the exception: it is also a submodule's name, and importing the submodule
rebinds that name on the package, so the function is bound here at import, after it
(the module itself: `importlib.import_module("specjax.generate")`).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_model": "specjax.loader",
    "speculative_generate": "specjax.engine",
    "SSDGeneration": "specjax.engine",
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
    "QuantSpecDrafter": "specjax.drafters",
    "SelfSDDrafter": "specjax.drafters",
    "StaticDrafter": "specjax.drafters",
    "SwiftDrafter": "specjax.drafters",
}

from specjax.generate import generate  # noqa: E402, F401  (see above; exported by __all__)

__all__ = sorted([*_EXPORTS, "generate"])


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # resolved once
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS))
