"""The package's layers: data flows downward, nothing imports from a layer above it.

Each module of ``src/hybridkv`` gets a rank (docs/architecture.md lists the
layers); a module may import only modules of a lower or equal rank. The runtime
core (pools, arena, tables, prefix cache, kernels, batch, manager) never imports a
model recipe, the planner, the codecs or anything above it, and no module imports
another module's private (underscore) names.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hybridkv"

# Lowest first. A module's rank is that of the longest prefix listed here.
LAYERS = [
    ("hybridkv._checks", "hybridkv.units", "hybridkv.spec", "hybridkv.memory.geometry", "hybridkv"),
    ("hybridkv.models", "hybridkv.codecs", "hybridkv.plan"),
    ("hybridkv.memory.pool", "hybridkv.memory.lru", "hybridkv.tables.store", "hybridkv.runtime.kernels"),
    ("hybridkv.memory.arena", "hybridkv.prefix.eviction", "hybridkv.prefix.checkpoints", "hybridkv.prefix.cache"),
    ("hybridkv.sizing", "hybridkv.compare_vllm"),
    ("hybridkv.runtime.batch",),
    ("hybridkv.runtime.manager",),
    ("hybridkv.tables.mirror", "hybridkv.manager", "hybridkv.batch", "hybridkv.mirror"),
    ("hybridkv.tiers", "hybridkv.transfer", "hybridkv.inflight", "hybridkv.inflight_state", "hybridkv.tierlink"),
    ("hybridkv.reference", "hybridkv.sim", "hybridkv.integrations"),
    ("hybridkv.cli", "hybridkv.__main__"),
]
CORE = ("hybridkv.memory", "hybridkv.tables", "hybridkv.prefix", "hybridkv.runtime", "hybridkv.manager", "hybridkv.batch",
        "hybridkv.mirror")
NOT_FOR_CORE = ("hybridkv.models", "hybridkv.plan", "hybridkv.codecs", "hybridkv.reference", "hybridkv.sim",
                "hybridkv.cli")


def rank(module: str) -> int:
    best, found = -1, None
    for r, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), r
    assert found is not None, f"{module} has no layer in tests/test_layering.py"
    return found


def modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, ast.parse(path.read_text(), str(path))


def imports(tree):
    """(module, names) of every hybridkv import, names empty for ``import x``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hybridkv"):
                    yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridkv"):
            yield node.module, [a.name for a in node.names]


MODULES = dict(modules())


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_layer_above_it(name):
    for target, _ in imports(MODULES[name]):
        assert rank(target) <= rank(name), f"{name} (layer {rank(name)}) imports {target} (layer {rank(target)})"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(CORE)))
def test_the_runtime_core_imports_no_recipe_planner_or_codec(name):
    for target, _ in imports(MODULES[name]):
        assert not target.startswith(NOT_FOR_CORE), f"{name} imports {target}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_crosses_modules(name):
    for target, names in imports(MODULES[name]):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{name} imports private {private} from {target}"


def test_the_check_itself_catches_an_upward_import():
    tree = ast.parse("from hybridkv.runtime.manager import CacheManager\nfrom hybridkv.memory.arena import _Hidden\n")
    (up, _), (_, names) = imports(tree)
    assert rank(up) > rank("hybridkv.memory.pool")
    assert names == ["_Hidden"]
