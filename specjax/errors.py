"""The project's own errors: what a user can cause and fix (bad input, a missing or
mismatched artefact). The CLI prints their message alone; any other exception is a bug
and keeps its traceback.

Each error also derives from the builtin it refines (`ValueError`, `KeyError`,
`FileNotFoundError`, `RuntimeError`), so code that catches those keeps working.
"""

from __future__ import annotations


class SpecjaxError(Exception):
  """Bad input or a missing / mismatched artefact; the message says what to do."""


class ConfigError(SpecjaxError, ValueError):
  """A setting out of range or inconsistent with the others (a drafter's hyper-parameters,
  sampling, decoding or benchmark settings, an empty prompt)."""
