"""Imports run down only (ARCHITECTURE.md): every module under src/tremula, read as an AST, imports only its own layer
and the layers its layer may import. Imports inside functions count too; an exception would be listed in KNOWN with
its reason (none is)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Layer of each top-level part of the package (tremula.<part>[...]); the root package is the bottom layer.
LAYER_OF = {
    "target": "base", "errors": "base", "numerics": "base", "sorting": "base", "beside": "base",
    "ir": "ir",
    "frontends": "graph", "models": "graph", "passes": "graph", "export": "graph",
    "program": "program",
    "codelets": "codelets",
    "plan": "planner",
    "sim": "backend", "timing": "backend", "report": "backend",
    **{m: "driver" for m in ("compiler", "pipeline", "batch_search", "fp8_calibration", "feeds", "check", "calibrate",
                             "limits", "cli", "__main__", "run_program", "provenance", "outputs", "user_inputs",
                             "ort_oracle", "model_info", "stages", "multichip", "cache")},
}
# What each layer may import besides itself.
MAY_IMPORT = {
    "base": set(),
    "ir": {"base"},
    "graph": {"base", "ir"},
    "program": {"base", "ir"},
    "codelets": {"base", "ir", "program"},  # ir: the reference's kernels, which the codelets call
    "planner": {"base", "ir", "program", "codelets"},
    "backend": {"base", "ir", "program", "codelets"},  # never the planner's internals, never the driver
    "driver": {"base", "ir", "graph", "program", "codelets", "planner", "backend"},
}
# (importing module, imported module prefix) -> why it is still allowed. None are left; an entry needs its reason.
KNOWN: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(name: str, source: str, is_package: bool = False, known_modules: set[str] | None = None) -> list[str]:
    """Every tremula module `source` (module `name`) imports, anywhere in it (functions included). `from X import y`
    names module X.y when that is a module (`known_modules`), else X."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append(sub if known_modules is not None and sub in known_modules else mod)
    return [m for m in out if m == "tremula" or m.startswith("tremula.")]


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "base"  # the root package: its version
    if parts[1] not in LAYER_OF:
        raise AssertionError(f"{module}: no layer for tremula.{parts[1]}; add it to LAYER_OF (and ARCHITECTURE.md)")
    return LAYER_OF[parts[1]]


def violations(module: str, source: str, is_package: bool = False, known_modules: set[str] | None = None,
               known: dict | None = None) -> list[str]:
    """The backward imports of one module's source: imports of a layer its own layer may not import."""
    known = KNOWN if known is None else known
    mine = layer(module)
    bad = []
    for dep in imported(module, source, is_package, known_modules):
        if dep.split(".")[1:2] and dep.split(".")[1] not in LAYER_OF:
            bad.append(f"{module} imports {dep}, which is in no layer (LAYER_OF)")
            continue
        theirs = layer(dep)
        if theirs == mine or theirs in MAY_IMPORT[mine]:
            continue
        if any(module == k and (dep == d or dep.startswith(d + ".")) for k, d in known):
            continue
        bad.append(f"{module} ({mine}) imports {dep} ({theirs})")
    return bad


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / "tremula").rglob("*.py"))}


def test_imports_run_down_only():
    mods = _modules()
    assert len(mods) > 50 and "tremula.target.step_cost" in mods
    bad = []
    for name, path in mods.items():
        bad += violations(name, path.read_text(encoding="utf-8"), path.name == "__init__.py", set(mods))
    assert not bad, "backward imports (ARCHITECTURE.md, 'Layers'):\n" + "\n".join(bad)


def test_known_exceptions_are_still_needed():
    """An exception that no longer happens is removed from KNOWN, so the list stays the truth."""
    mods = _modules()
    for (module, dep), why in KNOWN.items():
        assert why
        deps = imported(module, mods[module].read_text(encoding="utf-8"), False, set(mods))
        assert any(d == dep or d.startswith(dep + ".") for d in deps), f"{module} no longer imports {dep}"


def test_every_part_has_a_layer():
    for name in _modules():
        layer(name)


# ------------------------------------------------------------------------------------------------ the checker itself


MODS = {"tremula.plan", "tremula.plan.finalize", "tremula.target", "tremula.target.cost", "tremula.codelets"}


@pytest.mark.parametrize("module,source", [
    ("tremula.target.fake", "from tremula.plan.finalize import memory_plan\n"),
    ("tremula.target.fake", "def f():\n    if True:\n        from tremula.codelets import codelet\n"),  # in a function
    ("tremula.codelets.fake", "from tremula.plan import finalize\n"),
    ("tremula.sim.fake", "import tremula.compiler\n"),
    ("tremula.report.fake", "from tremula.plan.layout import blocks\n"),
    ("tremula.ir.fake", "from ..program import Program\n"),  # relative
    ("tremula.program", "from tremula.sim.functional import simulate\n"),
])
def test_a_backward_import_fails(module, source):
    assert len(violations(module, source, known_modules=MODS, known={})) == 1


@pytest.mark.parametrize("module,source", [
    ("tremula.codelets.fake", "from tremula.target import cost_terms\nfrom tremula.numerics.fp8 import quantize\n"),
    ("tremula.plan.fake", "from tremula.codelets import codelet\nfrom tremula.ir.graph import Graph\n"),
    ("tremula.report.fake", "from tremula.target.step_cost import price_step\nimport tremula.codelets\n"),
    ("tremula.timing.fake", "from . import konig\nfrom tremula.sim import functional\n"),
    ("tremula.cli", "def main():\n    from tremula.compiler import compile_model\n"),
])
def test_a_forward_import_passes(module, source):
    assert violations(module, source, known_modules=MODS, known={}) == []


def test_a_known_exception_is_named_exactly():
    src = "from tremula.compiler import canonical\n"
    known = {("tremula.report.profile", "tremula.compiler"): "why"}
    assert violations("tremula.report.profile", src, known=known) == []
    assert len(violations("tremula.report.trace", src, known=known)) == 1


def test_an_unplaced_part_fails():
    with pytest.raises(AssertionError, match="no layer"):
        violations("tremula.newpart", "import numpy\n")
