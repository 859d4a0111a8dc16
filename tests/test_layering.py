"""Imports point down: api -> sharding -> ffi -> kernels; formats, geometry, reference are leaves (STYLE §6.1)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "gcmoe_jax"
# Rank of each layer: a module may import only layers of lower or equal rank. Leaves may import only leaves.
LEAVES = {"formats", "geometry", "_support", "_config", "_compat", "_checks"}
RANK = {"kernels": 1, "ffi": 2, "sharding": 3, "api": 4, "nn": 5}
TOP = {"__init__", "__main__", "commands", "bench"}  # user-facing consumers: may import anything
LEAF_DEPS = {"reference": {"formats"}}  # the oracle is a leaf over formats


def _layer(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).parts
  return rel[0].removesuffix(".py")


def _imports(path: pathlib.Path) -> set[str]:
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gcmoe_jax"):
      parts = node.module.split(".")
      if len(parts) > 1:
        out.add(parts[1])
      else:
        out.update(a.name for a in node.names)
    elif isinstance(node, ast.Import):
      out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("gcmoe_jax."))
  return out


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
  layer = _layer(path)
  deps = _imports(path) - {layer}
  if layer in TOP:
    return
  if layer in LEAVES:
    assert deps <= LEAVES, f"{path.name}: leaf module imports {sorted(deps - LEAVES)}"
  elif layer in LEAF_DEPS:
    assert deps <= LEAVES | LEAF_DEPS[layer], f"{path.name}: imports {sorted(deps)}"
  else:
    rank = RANK[layer]
    upward = {d for d in deps if RANK.get(d, 0) > rank}
    assert not upward, f"{path.relative_to(ROOT)} ({layer}) imports upward: {sorted(upward)}"
