"""Layers point forward: leaf -> numerics -> capture -> passes -> lowering -> runtime -> public API.

Imports inside functions count too: a lazy import that breaks the order is a
backward edge hidden from the reader, not a cure for one. A folder sits in one
layer, except where LAYERS names one of its modules on its own (the longest
name wins): ir/'s vocabulary (dtypes, decisions, the op registry) is a leaf
every layer uses, while ir/graph.py prints the op families and so sits with
them; ops/newton_schulz_math.py is the maths the precision planner shares with
the op. targets (what the machine is good at) is numerics: the timing of NS
candidates (precision/measure_ns.py) reads it. distributed/ (owner plans, the
graph rewrites around collectives, TP Newton–Schulz, DTensor layouts the
capture reads) sits with capture, below the passes that use it. settings
sits with the passes: passes/pipeline.py decides from them which passes run. A new
top-level module must be given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import hocompile
from hocompile import targets
from hocompile.lowering.triton.tiles import MATMUL_TILES
from hocompile.passes.choose_algorithm import PRECISIONS as PASS_PRECISIONS
from hocompile.settings import PRECISIONS, Backend, Fallback, Precision, Settings

PACKAGE = Path(hocompile.__file__).parent
LAYERS = {
    "leaf": ("errors", "diskcache", "ir.dtypes", "ir.decisions", "ir.registry", "ir.declined", "capture.scalars"),
    "numerics": ("ops.newton_schulz_math", "precision", "optimizers", "targets"),
    "capture": ("capture", "ir", "ops", "distributed", "classes"),
    "passes": ("passes", "settings"),
    "lowering": ("lowering",),
    "runtime": ("runtime", "dynamo"),
}
ORDER = [*LAYERS, "top"]


def _layer(module: str) -> str:
    """The layer of the longest name in LAYERS that is ``module`` or a package above it."""
    named = [(len(n), layer) for layer, names in LAYERS.items() for n in names if f"{module}.".startswith(f"{n}.")]
    return max(named)[1] if named else ("?" if module else "top")


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every hocompile module ``path`` imports, at any depth, relative to the package."""
    module = _module(path)
    parts = module.split(".") if module else []
    package = parts if path.name == "__init__.py" else parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                target = ".".join([*base, alias.name])
                is_module = (PACKAGE / target.replace(".", "/")).with_suffix(".py").exists()
                found.add(target if is_module or (PACKAGE / target.replace(".", "/")).is_dir() else ".".join(base))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found |= {n.removeprefix("hocompile.") for n in names if n.startswith("hocompile.")}
    return found - {module}


def test_layers_point_forward() -> None:
    backward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _module(path)
        for target in _imports(path):
            if ORDER.index(_layer(target)) > ORDER.index(_layer(source)):
                backward.append(f"{source} ({_layer(source)}) imports {target} ({_layer(target)})")
    assert backward == []


def test_every_module_has_a_layer() -> None:
    assert [m for m in map(_module, PACKAGE.rglob("*.py")) if _layer(m) == "?"] == []


def test_lowering_and_runtime_share_the_leaf_disk_cache() -> None:
    assert _imports(PACKAGE / "diskcache.py") == {"errors"}  # its CacheWarning, defined with the others
    assert "diskcache" in _imports(PACKAGE / "lowering" / "aten.py")


def test_errors_is_a_leaf_holding_every_public_exception_and_warning() -> None:
    import hocompile.errors as errors

    assert _imports(PACKAGE / "errors.py") == set()
    exported = {n: getattr(hocompile, n) for n in hocompile.__all__}
    public = {n for n, c in exported.items() if isinstance(c, type) and issubclass(c, Warning | Exception)}
    assert len(public) == 11, sorted(public)
    assert {n for n in public if getattr(hocompile, n).__module__ != "hocompile.errors"} == set()
    assert set(errors.__all__) == public


def test_device_arch_names_a_row_of_every_table() -> None:
    assert targets.device_arch(torch.device("cpu")) == "interpret"
    assert set(MATMUL_TILES) == {"interpret", *targets.GPU_GFLOPS}


def test_setting_choices_are_enums_that_read_as_strings() -> None:
    settings = Settings.resolve(backend="triton", fallback="eager", precision="bf16")
    assert settings.backend is Backend.TRITON and settings.backend == "triton"
    assert settings.fallback is Fallback.EAGER and settings.precision is Precision.BF16
    assert f"precision={settings.precision}" == "precision=bf16"  # as cache keys and logs spell it
    assert Settings(backend="aten").backend is Backend.ATEN  # built directly, from a string
    with pytest.raises(ValueError, match="backend must be one of"):
        Settings.resolve(backend="cuda")
    with pytest.raises(ValueError):
        Settings(precision="fp12")  # type: ignore[arg-type]
    assert PRECISIONS == PASS_PRECISIONS  # the pass validates the same names


def test_no_import_circle() -> None:
    """No module reaches itself through imports, counting lazy and TYPE_CHECKING ones: a circle is
    read (and type-checked) as one module, and the runtime's checks once formed one with the optimizer."""
    graph = {_module(path): _imports(path) for path in PACKAGE.rglob("*.py")}
    circles = []
    for start in graph:
        seen, todo = set(), list(graph[start] & graph.keys())
        while todo:
            module = todo.pop()
            if module == start:
                circles.append(start)
                break
            if module not in seen:
                seen.add(module)
                todo += graph[module] & graph.keys()
    assert circles == []


def test_no_module_imports_another_modules_private_names() -> None:
    """A name with a leading underscore is its module's own: another module that needs it gets a public one."""
    reached = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            ours = isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hocompile"))
            if ours:
                reached += [f"{_module(path)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert reached == []
