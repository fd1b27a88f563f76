"""The import graph: packages by floor, no circle, no import that runs back up.

Every import in the project's code counts, those inside functions and under
`TYPE_CHECKING` too: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pallas_kernels", "longspec_jax", "train", "infer", "lab")
# Lowest first: a module imports only from its own floor or the floors below. Within the
# library: ops < models < weights < decoding < methods < engine (and the continuous batching
# over it) < cli < the public API.
FLOORS = (
  ("pallas_kernels",),
  ("longspec_jax.errors", "longspec_jax.files", "longspec_jax.backend"),
  ("longspec_jax.ops",),
  ("longspec_jax.models",),
  ("longspec_jax.weights",),
  ("longspec_jax.decoding",),
  ("longspec_jax.methods",),
  ("longspec_jax.engine", "longspec_jax.batching"),
  ("longspec_jax.cli",),
  ("longspec_jax",),  # the public API (`__init__.py`)
  ("train", "infer"),  # the apps: never each other
  ("lab",),
)


def module_name(path: Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def graph() -> dict[str, set[str]]:
  """Each project module -> the project modules it imports."""
  files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
  modules = {module_name(p): p for p in files}
  edges = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
        # `from pkg import mod` imports the module pkg.mod where there is one
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
      else:
        continue
      for target in targets:
        while target and target not in modules:
          target = target.rpartition(".")[0]
        if target and target != name:
          found.add(target)
    edges[name] = found
  return edges


def floor(module: str) -> int:
  """The floor of a module: that of the longest prefix named in FLOORS."""
  best = max(
    (
      (len(prefix), level)
      for level, prefixes in enumerate(FLOORS)
      for prefix in prefixes
      if module == prefix or module.startswith(prefix + ".")
    ),
    default=None,
  )
  if best is None:
    raise AssertionError(f"{module} is on no floor: name its package in FLOORS")
  return best[1]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_on_a_floor(package):
  for module in graph():
    if module.split(".")[0] == package:
      floor(module)


def test_no_import_runs_back_up():
  upward = [
    f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})"
    for module, targets in graph().items()
    for target in sorted(targets)
    if floor(target) > floor(module)
  ]
  assert not upward, "\n".join(upward)


def test_the_apps_never_import_each_other_and_the_kernels_import_nothing():
  crossing = [
    f"{module} imports {target}"
    for module, targets in graph().items()
    for target in targets
    if {module.split(".")[0], target.split(".")[0]} == {"train", "infer"}
    or (module.startswith("pallas_kernels") and not target.startswith("pallas_kernels"))
  ]
  assert not crossing, "\n".join(crossing)


def test_there_is_no_import_circle():
  edges, seen, on_path, circles = graph(), set(), [], []

  def visit(module):
    if module in on_path:
      circles.append(" -> ".join(on_path[on_path.index(module) :] + [module]))
      return
    if module in seen:
      return
    seen.add(module)
    on_path.append(module)
    for target in sorted(edges[module]):
      visit(target)
    on_path.pop()

  for module in sorted(edges):
    visit(module)
  assert not circles, "\n".join(circles)


def test_the_graph_sees_imports_inside_functions():
  assert "pallas_kernels.flash_decode" in graph()["longspec_jax.ops.attention"]  # (imported where it is called)
