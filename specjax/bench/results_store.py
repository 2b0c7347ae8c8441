"""One results file for every benchmark, experiment and sweep: resumable, crash-safe,
and never mixing numbers measured under different settings.

`results.jsonl` holds one line per finished unit of work (a prompt with all its methods,
a grid point, a context length): `{"unit": key, "settings": fingerprint, "records": [...]}`.
A line is written with one `write` and flushed to disk before the next unit starts, so a
kill loses at most the unit under way; a line cut by a crash is dropped on reopening and
its unit is redone. The fingerprint hashes every setting that changes a number (model,
drafters and their options, γ, lengths, dtype …); `settings.json` keeps each fingerprint's
settings, so a resume with changed settings says which ones changed. Drafter states that
a run hands from unit to unit (`save_carried`) sit beside them, so a resumed run goes on
learning where the killed one stopped instead of starting cold.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from specjax.errors import SpecjaxError

RESULTS = "results.jsonl"
SETTINGS = "settings.json"
CARRIED = "carried-{}.pkl"  # one per settings fingerprint


class ResumeError(SpecjaxError, ValueError):
  """A run would overwrite results, or continue results made with other settings."""


def fingerprint(settings: Mapping[str, Any]) -> str:
  """A short hash of `settings` (JSON, keys sorted): equal settings, equal fingerprint."""
  text = json.dumps(settings, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _diff(old: Mapping, new: Mapping) -> str:
  keys = sorted(set(old) | set(new))
  changed = [f"{k}: {old.get(k, '(absent)')!r} -> {new.get(k, '(absent)')!r}" for k in keys
             if old.get(k, "(absent)") != new.get(k, "(absent)")]
  return "; ".join(changed[:8]) + (" …" if len(changed) > 8 else "")


class ResultsStore:
  """The results folder of one run (or of a sweep: one fingerprint per grid point).

  resume=False refuses a folder that already holds results. resume=True continues it:
  units already recorded under these settings are skipped (`done`). A unit recorded under
  other settings is refused (`mismatch="refuse"`, for one-settings runs such as `specjax
  bench`) or kept apart (`mismatch="separate"`, for sweeps: each grid point is its own
  settings and sees only its own units).
  """

  def __init__(self, folder: str | Path, settings: Mapping[str, Any], *, resume: bool,
               mismatch: Literal["refuse", "separate"] = "refuse"):
    self.folder = Path(folder)
    self.folder.mkdir(parents=True, exist_ok=True)
    self.path = self.folder / RESULTS
    self.mismatch = mismatch
    if self.path.exists() and self.path.stat().st_size and not resume:
      raise ResumeError(f"{self.path} holds results: pass --resume to continue them, or "
                        f"choose another --out")
    self._lines = self._read()
    self._done = {(ln["settings"], ln["unit"]) for ln in self._lines}
    self._known = self._read_settings()
    self.settings = dict(settings)
    self.key = self.register(settings)

  def register(self, settings: Mapping[str, Any]) -> str:
    """Record `settings` and return their fingerprint; under mismatch="refuse", settings
    other than those already in the folder raise ResumeError."""
    fp = fingerprint(settings)
    if fp not in self._known:
      if self.mismatch == "refuse" and self._known:
        old = next(iter(self._known.values()))
        raise ResumeError(f"--resume: {self.folder} holds results made with other settings "
                          f"({_diff(old, settings)}); choose another --out")
      self._known[fp] = json.loads(json.dumps(dict(settings), default=str))
      tmp = self.folder / (SETTINGS + ".tmp")
      tmp.write_text(json.dumps(self._known, indent=1, sort_keys=True))
      tmp.replace(self.folder / SETTINGS)
    return fp

  def _read_settings(self) -> dict[str, dict]:
    path = self.folder / SETTINGS
    if not path.exists():
      if self._lines:
        raise ResumeError(f"{self.path} has results but no {SETTINGS}: it was not written "
                          f"by this version of specjax; choose another --out")
      return {}
    return json.loads(path.read_text())

  def _read(self) -> list[dict]:
    """Every complete line; a line cut by a crash is removed from the file."""
    if not self.path.exists():
      return []
    raw = self.path.read_bytes()
    lines, pos = [], 0
    while pos < len(raw):
      end = raw.find(b"\n", pos)
      if end < 0:
        break  # no newline: the line a crash cut (a unit is one write ending in one)
      chunk = raw[pos:end]
      if chunk.strip():
        try:
          line = json.loads(chunk)
        except ValueError:  # not ours to repair: skipped, its unit is redone
          pos = end + 1
          continue
        if not isinstance(line, dict) or "unit" not in line or "settings" not in line:
          raise ResumeError(f"{self.path} was not written by specjax's results store "
                            f"(a line without unit/settings): choose another --out")
        lines.append(line)
      pos = end + 1
    if pos < len(raw):
      with self.path.open("r+b") as f:
        f.truncate(pos)
    return lines

  def done(self, unit: str, settings_key: str | None = None) -> bool:
    return (settings_key or self.key, unit) in self._done

  def add(self, unit: str, records: Iterable[dict], settings_key: str | None = None) -> None:
    """Append one finished unit (all its records) in one write, flushed to disk."""
    line = {"unit": unit, "settings": settings_key or self.key, "records": list(records)}
    data = (json.dumps(line) + "\n").encode()
    with self.path.open("ab") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    self._lines.append(line)
    self._done.add((line["settings"], unit))

  def records(self, settings_key: str | None = None) -> list[dict]:
    """The records of every unit made under these settings (or `settings_key`'s)."""
    key = settings_key or self.key
    return [r for ln in self._lines if ln["settings"] == key for r in ln["records"]]

  def units(self, settings_key: str | None = None) -> list[str]:
    key = settings_key or self.key
    return [ln["unit"] for ln in self._lines if ln["settings"] == key]

  def save_carried(self, states: Mapping[str, Any], settings_key: str | None = None) -> None:
    """The drafter states carried from unit to unit (a budgeted KnapSpec's selection,
    SWIFT's search), written whole after each unit. An overlay keeps only its base's state:
    that is the prior an overlay hands down, and its own plan may hold a quantised copy of
    the model."""
    from specjax.drafters.overlay import OverlayState

    def portable(state):
      while isinstance(state, OverlayState):
        state = state.base
      return state

    kept = {name: portable(s) for name, s in states.items()}
    path = self.folder / CARRIED.format(settings_key or self.key)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps({n: s for n, s in kept.items() if s is not None}))
    tmp.replace(path)

  def load_carried(self, settings_key: str | None = None) -> dict[str, Any]:
    """What `save_carried` last wrote under these settings ({} if nothing). An unreadable
    file costs only the learning it held: the run warns and starts those drafters cold."""
    path = self.folder / CARRIED.format(settings_key or self.key)
    if not path.exists():
      return {}
    try:
      states = pickle.loads(path.read_bytes())
    except Exception as err:  # noqa: BLE001 (a torn or foreign file: any unpickling error)
      warnings.warn(f"{path} is unreadable ({type(err).__name__}): drafters that learn "
                    f"across prompts start cold", stacklevel=2)
      return {}
    return states if isinstance(states, dict) else {}
