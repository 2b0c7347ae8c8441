"""The package's import graph: no cycle, and no module importing from a layer above its own.

The layers are docs/ARCHITECTURE.md's layout table, bottom first. Every import counts,
the ones inside functions too: an import deferred to dodge a cycle is still the cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specjax"

# Bottom first. A module may import from its own layer and the layers before it.
LAYERS = (
    ("leaves", {"specjax.errors", "specjax.storage", "specjax.cpu_kernels"}),
    ("core", None),  # every other module at the package's top, but the CLI
    ("models", {"specjax.models"}),
    ("decode", {"specjax.decode"}),
    ("selection", {"specjax.selection"}),
    ("offline", {"specjax.offline"}),
    ("drafters", {"specjax.drafters"}),
    ("bench", {"specjax.bench"}),
    ("cli", {"specjax.cli"}),
)


def modules() -> dict[str, Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
  """The package's modules that `name` imports, anywhere in its source."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]

  def owner(dotted: str) -> str | None:  # the module a dotted name lives in
    while dotted and dotted not in known:
      dotted = dotted.rpartition(".")[0]
    return dotted or None

  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {owner(a.name) for a in node.names if a.name.startswith("specjax")}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      if base.startswith("specjax"):
        # `from specjax.x import y`: y is a module of its own, or a name in x
        found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else owner(base)
                  for a in node.names}
  return found - {None, name}


def layer(name: str) -> int:
  for i, (_, prefixes) in enumerate(LAYERS):
    if prefixes and any(name == p or name.startswith(p + ".") for p in prefixes):
      return i
  if name == "specjax":  # the root resolves its exports lazily, by string
    return len(LAYERS)
  assert name.count(".") == 1, f"{name}: a folder the layers do not name"
  return 1


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
  mods = modules()
  return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The graph's strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while (w := stack.pop()) != v:
        on_stack.discard(w)
        component.append(w)
      on_stack.discard(v)
      if component:
        out.append(sorted([v, *component]))

  for v in graph:
    if v not in index:
      visit(v)
  return out


def test_the_package_has_no_import_cycle(graph):
  assert cycles(graph) == []


def test_no_module_imports_from_a_layer_above_its_own(graph):
  climbing = sorted(f"{a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]})"
                    for a, targets in graph.items() for b in targets if layer(b) > layer(a))
  assert climbing == []


def test_the_checks_see_a_cycle_and_a_climb(tmp_path):
  """The checks themselves: a two-module cycle is found, and so is an import deferred into
  a function, from a kernel module up into the models."""
  assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
  probe = tmp_path / "__init__.py"
  probe.write_text("import jax\n\ndef build():\n  from specjax.models.registry import get_spec\n")
  found = imports("specjax.cpu_kernels", probe, set(modules()))
  assert found == {"specjax.models.registry"}
  assert layer("specjax.models.registry") > layer("specjax.cpu_kernels")


def test_one_module_chooses_the_kernels(graph):
  """`specjax.ops` alone calls the kernels: in the package no other module imports the C++
  kernels or the Pallas ones, so the choice between a kernel and XLA (backend, dtype, rows,
  a sharded operand) is made in one place."""
  callers = sorted(a for a, targets in graph.items()
                   if any(t == "specjax.cpu_kernels" or t.startswith("specjax.cpu_kernels.")
                          for t in targets) and not a.startswith("specjax.cpu_kernels"))
  assert callers == ["specjax.ops"]
  pallas = sorted(name for name, path in modules().items()
                  if re.search(r"^\s*(from|import) pallas_kernels", path.read_text(), re.M))
  assert pallas == ["specjax.ops"]


def test_the_kernels_import_nothing_above_the_leaves():
  """The kernel modules compute and build; they know neither the models nor the weight
  formats (a caller that owns a format passes its XLA reference)."""
  mods = modules()
  for name in (n for n in mods if n.startswith("specjax.cpu_kernels")):
    assert all(layer(t) == 0 for t in imports(name, mods[name], set(mods))), name
  for path in (ROOT / "pallas_kernels").glob("*.py"):
    assert not re.search(r"^\s*(from|import) specjax", path.read_text(), re.M), path.name
