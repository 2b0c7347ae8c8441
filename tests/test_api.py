"""The curated top-level API: what the README imports from `specjax` alone."""

from __future__ import annotations

import importlib

import pytest

import specjax


def test_every_exported_name_resolves_and_generate_is_the_function():
  import specjax.engine  # noqa: F401  (imports the `generate` submodule on the way)

  for name in specjax.__all__:
    assert getattr(specjax, name) is not None
  from specjax import DraftPlan, generate, load_model, speculative_generate

  module = importlib.import_module("specjax.generate")
  assert generate is module.generate and callable(load_model)
  assert speculative_generate is specjax.engine.speculative_generate
  assert DraftPlan is importlib.import_module("specjax.plan").DraftPlan
  assert {"Int8WeightsDrafter", "SelfSDDrafter", "QuantSpecDrafter"} <= set(specjax.__all__)


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    specjax.nope  # noqa: B018
