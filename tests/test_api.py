"""The curated top-level API: what the README imports from `specjax` alone, and the layout
docs/ARCHITECTURE.md describes."""

from __future__ import annotations

import importlib

import pytest

import specjax


def test_every_exported_name_resolves_and_generate_is_the_function():
  import specjax.decode.engine  # noqa: F401  (imports the `generate` module on the way)

  for name in specjax.__all__:
    assert getattr(specjax, name) is not None
  from specjax import DraftPlan, generate, load_model, speculative_generate

  module = importlib.import_module("specjax.decode.generate")
  assert generate is module.generate and callable(load_model)
  assert speculative_generate is specjax.decode.engine.speculative_generate
  assert DraftPlan is importlib.import_module("specjax.plan").DraftPlan
  assert {"Int8WeightsDrafter", "SelfSDDrafter", "QuantSpecDrafter"} <= set(specjax.__all__)


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    specjax.nope  # noqa: B018


def test_the_layout_the_package_docstring_and_readme_describe_is_the_tree():
  """Every folder the package docstring names exists, and every module of the package
  is in docs/ARCHITECTURE.md's layout table (and every path there exists)."""
  import re
  from pathlib import Path

  root = Path(specjax.__file__).parent
  folders = re.findall(r"^    (specjax/[\w/]*)", specjax.__doc__, flags=re.M)
  assert {f.rstrip("/") for f in folders} == {"specjax"} | {
      f"specjax/{p.name}" for p in root.iterdir() if (p / "__init__.py").exists()}
  page = (root.parent / "docs" / "ARCHITECTURE.md").read_text()
  table = page.split("## Layout", 1)[1]
  named = set(re.findall(r"`((?:specjax|pallas_kernels)/[\w/]+\.py)`", table))
  modules = {str(p.relative_to(root.parent)) for p in root.rglob("*.py")
             if p.name != "__init__.py"}
  assert modules <= named, sorted(modules - named)
  assert all((root.parent / n).exists() for n in named), sorted(
      n for n in named if not (root.parent / n).exists())


def test_the_readme_quick_start_runs_as_written_on_a_tiny_model():
  """The README's Python quick start, its model swapped for a tiny one: it imports from
  `specjax` alone, and its lossless assertion holds."""
  import contextlib
  import io
  import re
  from pathlib import Path

  readme = (Path(specjax.__file__).parent.parent / "README.md").read_text()
  quick = readme.split("## Quick start", 1)[1]
  code = re.search(r"```python\n(.*?)```", quick, flags=re.S).group(1)
  assert re.findall(r"^from (\S+) import", code, flags=re.M) == ["specjax"]
  code = code.replace('load_model("smollm2-135m-instruct")', 'load_model("tiny-llama")')
  assert 'load_model("tiny-llama")' in code
  with contextlib.redirect_stdout(io.StringIO()) as out:
    exec(compile(code, "README.md", "exec"), {})
  assert out.getvalue().strip()
