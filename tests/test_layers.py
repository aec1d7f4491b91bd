"""The import rules between kvfsm's layers (docs/architecture.md): each package imports only the layers below it.

Every ``import`` and ``from ... import`` in a module counts, at any depth (a lazy import inside a function is still
a dependency), except those under ``if TYPE_CHECKING:``. The rules are the table ``ALLOWED`` below; a new package
must be added to it, so the layering is a decision, not an accident.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvfsm

PACKAGE = Path(kvfsm.__file__).resolve().parent

#: The layers, bottom first. A module may import kvfsm modules from its own layer and from the ones listed.
BASE = {"kvfsm.errors", "kvfsm.validation"}
ALLOWED: dict[str, set[str]] = {
    "kvfsm.errors": set(),
    # The spec tables, shipped as package data (spec/ in a checkout): TOML and prose, no code to import.
    "kvfsm.spec": set(),
    "kvfsm.validation": {"kvfsm.errors"},
    "kvfsm.machines": BASE,
    "kvfsm.control": BASE | {"kvfsm.machines"},
    "kvfsm.tiers": BASE | {"kvfsm.machines", "kvfsm.control"},
    "kvfsm.data": BASE | {"kvfsm.machines", "kvfsm.control"},
    "kvfsm.engine": BASE | {"kvfsm.machines", "kvfsm.control", "kvfsm.data"},
    "kvfsm.observe": BASE | {"kvfsm.machines", "kvfsm.control"},
    "kvfsm.check": BASE | {"kvfsm.machines", "kvfsm.control", "kvfsm.tiers", "kvfsm.observe"},
    "kvfsm.testing": BASE
    | {"kvfsm.machines", "kvfsm.control", "kvfsm.tiers", "kvfsm.data", "kvfsm.engine", "kvfsm.check", "kvfsm.observe"},
    "kvfsm.bench": BASE
    | {
        "kvfsm.machines",
        "kvfsm.control",
        "kvfsm.tiers",
        "kvfsm.data",
        "kvfsm.engine",
        "kvfsm.check",
        "kvfsm.observe",
        "kvfsm.testing",
        "kvfsm.vllm",
    },
    # The optional vLLM integration: kvfsm's managers, tiers, copy backends and trace behind vLLM's interfaces.
    "kvfsm.vllm": BASE
    | {"kvfsm.machines", "kvfsm.control", "kvfsm.tiers", "kvfsm.data", "kvfsm.check", "kvfsm.observe"},
}
#: Entry points may import anything: the package itself, the command line (``kvfsm check`` has its own module
#: beside the checker) and the demo.
ENTRY_POINTS = {"kvfsm", "kvfsm.__main__", "kvfsm.cli", "kvfsm.check.cli", "kvfsm.demo"}
#: Layers that must run without torch (the sans-IO core and everything that verifies it).
TORCH_FREE = {
    "kvfsm.errors",
    "kvfsm.validation",
    "kvfsm.machines",
    "kvfsm.control",
    "kvfsm.tiers",
    "kvfsm.check",
    "kvfsm.observe",
}
#: Names the torch-free layers may not import at all (the data plane's libraries).
TORCH_LIBS = {"torch", "numpy"}
#: The one layer that may import vLLM (the optional ``kvfsm[vllm]`` extra).
VLLM_LAYER = "kvfsm.vllm"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    if module in ENTRY_POINTS:
        return module
    parts = module.split(".")
    return ".".join(parts[:2])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[str]:
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            if node.module == "kvfsm":
                found.extend(f"kvfsm.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _modules() -> list[tuple[str, list[str]]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        out.append((_module_name(path), _imports(ast.parse(path.read_text(), str(path)))))
    return out


def test_every_package_has_a_rule() -> None:
    layers = {_layer(m) for m, _ in _modules()} - ENTRY_POINTS
    assert layers <= set(ALLOWED), f"packages without an import rule: {sorted(layers - set(ALLOWED))}"


@pytest.mark.parametrize("module,imports", _modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_follow_the_layers(module: str, imports: list[str]) -> None:
    layer = _layer(module)
    if layer in ENTRY_POINTS:
        return
    allowed = ALLOWED[layer] | {layer}
    bad = [
        name for name in imports if name.startswith("kvfsm.") and _layer(name) not in allowed and name not in allowed
    ]
    assert not bad, f"{module} ({layer}) imports {bad}; {layer} may import only {sorted(allowed)}"
    if layer in TORCH_FREE:
        heavy = [name for name in imports if name.split(".")[0] in TORCH_LIBS]
        assert not heavy, f"{module} imports {heavy}; {layer} must run without torch"
    if layer != VLLM_LAYER:
        engine = [name for name in imports if name.split(".")[0] == "vllm"]
        assert not engine, f"{module} imports {engine}; only {VLLM_LAYER} may import vLLM"


def test_kvfsm_imports_without_vllm() -> None:
    """``import kvfsm`` (and the lazy ``kvfsm.vllm`` package itself) works where vLLM cannot be imported."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # makes every `import vllm...` fail
        "import kvfsm, kvfsm.vllm, kvfsm.vllm.config, kvfsm.control.cpu\n"
        "try:\n    kvfsm.vllm.KvfsmOffloadingSpec\nexcept ImportError:\n    print('lazy')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lazy"


def test_the_top_level_holds_only_entry_points_and_the_error_hierarchy() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 6, top
    assert set(top) <= {"__init__.py", "__main__.py", "cli.py", "demo.py", "errors.py", "validation.py"}, top


#: Optional extras and the only modules that may import them, so ``import kvfsm`` never needs them
#: (``redis``: the ``kvfsm[redis]`` extra; its tier, and the benchmark that compares against raw redis-py).
OPTIONAL_LIBS: dict[str, set[str]] = {"redis": {"kvfsm.tiers.redis", "kvfsm.bench.redis"}}


@pytest.mark.parametrize("module,imports", _modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_optional_extras_are_imported_only_by_their_own_modules(module: str, imports: list[str]) -> None:
    for lib, owners in OPTIONAL_LIBS.items():
        if any(name.split(".")[0] == lib for name in imports):
            assert module in owners, f"{module} imports {lib}; only {sorted(owners)} may (an optional extra)"
