"""Every canonical op's row (ir/ops.py OpDef) names each stage, and each stage has what the row promises: an ONNX
import and export, a lowering, a codelet with its op ids, and a cost every built-in chip can price."""

from __future__ import annotations

import numpy as np
import pytest

from tremula.codelets.elementwise import BINARY_IDS, UNARY_IDS
from tremula.export import export_onnx
from tremula.export.onnx_export import CONVERTERS as EXPORTERS
from tremula.frontends.onnx_import import import_onnx
from tremula.frontends.onnx_ops import CONVERTERS as IMPORTERS
from tremula.frontends.onnx_ops import _direct, since_versions
from tremula.ir import OPS, GraphBuilder
from tremula.ir.graph import Node
from tremula.ir.ops import DOMAINS, EXPORTS, IMPORTS, LOWERINGS
from tremula.plan.lower_ops import rule_of, supported
from tremula.target import cost_terms
from tremula.target.chip import builtin_chip_names, load_chip

# The op ids Programs store for the element-wise codelets (a saved Program names its ops by these numbers): a row
# may add an id, never move one.
STORED_UNARY_IDS = {"Neg": 0, "Abs": 1, "Exp": 2, "Log": 3, "Sqrt": 4, "Reciprocal": 5, "Tanh": 6, "Erf": 7,
                    "Sigmoid": 8, "Relu": 9, "Not": 10, "Identity": 11, "Cast": 12, "Gelu": 13, "GeluTanh": 14}
STORED_BINARY_IDS = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3, "Pow": 4, "Max": 5, "Min": 6, "Mod": 7, "Equal": 8,
                     "Less": 9, "Greater": 10, "And": 11, "Or": 12}


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_row_names_every_stage(name):
    d = OPS[name]
    assert d.onnx in IMPORTS and d.export in EXPORTS and d.lower in LOWERINGS, name
    assert not (d.host_only and d.lower), f"{name}: shape arithmetic is folded, never planned"
    if d.codelet in ("unary", "binary"):
        assert d.kernels and d.cost and d.elementwise, f"{name}: an element-wise codelet needs kernels and a cost"
    if d.codelet == "unary" and d.export == "direct":
        assert d.domain in DOMAINS, f"{name}: its tests need the inputs it is defined on"
    if d.lower == "elementwise":
        assert d.elementwise and d.codelet, f"{name}: planned element-wise, so some codelet must run it"


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_an_onnx_export(name):
    assert name in EXPORTERS, f"{name} has no converter in export/onnx_export.py"


@pytest.mark.parametrize("name", sorted(n for n, d in OPS.items() if d.onnx == "direct"))
def test_direct_imports_use_the_direct_converter_at_every_opset(name):
    assert all(IMPORTERS[(name, v)] is _direct for v in since_versions(name)), name


@pytest.mark.parametrize("name", sorted(n for n, d in OPS.items() if d.onnx == "direct" and d.export == "direct"))
def test_direct_ops_survive_export_and_import(name, tmp_path):
    """The op written as the ONNX op of its name comes back as itself."""
    d = OPS[name]
    b = GraphBuilder(f"rt_{name}")
    dtype = "bool" if d.domain == "bool" or name in ("And", "Or") else "float32"
    if name == "Where":
        ins = [b.input("c", (2, 3), "bool"), b.input("x", (2, 3), "float32"), b.input("y", (2, 3), "float32")]
    elif name == "MatMul":
        ins = [b.input("x", (2, 3), "float32"), b.input("w", (3, 4), "float32")]
    else:
        ins = [b.input(f"x{i}", (2, 3), dtype) for i in range(d.n_inputs[0])]
    b.output(b.op(name, ins))
    path = tmp_path / "op.onnx"
    path.write_bytes(export_onnx(b.build()).SerializeToString())
    assert [n.op for n in import_onnx(path).nodes] == [name]


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_planned_op_has_its_lowering(name):
    d = OPS[name]
    if d.lower:
        assert callable(rule_of(name)), f"{name}: no lowering rule"
        return
    g = GraphBuilder("refused").build()  # the planner refuses it by name (folding or a pass must remove it)
    g.nodes.append(Node(name, ["x"], ["y"], {}, name))
    assert supported(g) == [name]


@pytest.mark.parametrize("chip_name", builtin_chip_names())
def test_every_elementwise_cost_prices_on_every_builtin_chip(chip_name):
    chip = load_chip(chip_name)
    for name, d in OPS.items():
        if d.cost:
            for dtype in ("float32", "float16"):
                assert cost_terms.sequence_cycles(chip, d.cost, 64, dtype) > 0, (name, dtype)


def test_stored_op_ids_never_move():
    assert {k: v for k, v in UNARY_IDS.items() if k in STORED_UNARY_IDS} == STORED_UNARY_IDS
    assert {k: v for k, v in BINARY_IDS.items() if k in STORED_BINARY_IDS} == STORED_BINARY_IDS
    assert sorted(UNARY_IDS.values()) == list(range(len(UNARY_IDS)))
    assert sorted(BINARY_IDS.values()) == list(range(len(BINARY_IDS)))


def test_softplus_is_one_row():
    """Softplus was added as its row alone (ir/ops.py): the codelet runs the row's kernel, the planner lowers it as
    element-wise, and ONNX import and export pass it through."""
    from tremula.codelets import codelet
    from tremula.plan.context import ELEMENTWISE

    x = np.array([[-30.0, -1.0, 0.0, 1.0, 30.0]], np.float32)
    out = np.zeros_like(x)
    codelet("unary").run([x[None], out[None]], (UNARY_IDS["Softplus"],))
    assert np.allclose(out, np.log1p(np.exp(x.astype(np.float64))), rtol=1e-6)
    assert "Softplus" in ELEMENTWISE and "Softplus" in EXPORTERS and ("Softplus", 1) in IMPORTERS


@pytest.mark.parametrize("name", sorted(n for n, d in OPS.items() if d.codelet == "unary" and d.domain == "real"))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_every_real_unary_row_compiles_and_simulates(name, dtype):
    """A row is enough for the whole pipeline: planned on a 16-tile chip, run by the simulator, equal to the
    reference."""
    from tremula.check import check_model

    b = GraphBuilder(f"one_{name}")
    b.output(b.op(name, [b.input("x", (4, 24), "float32")]))
    res = check_model(b.build(), "examples/chips/tiny16.toml", dtype=dtype)
    assert res.passed, (name, dtype)
