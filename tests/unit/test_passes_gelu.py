"""GELU fusion: erf and tanh forms in the orderings exporters write, and near misses that must stay unfused."""

import math

import numpy as np
import pytest

from tremula.ir import GraphBuilder, infer_types, run
from tremula.passes import fuse_gelu

RNG = np.random.default_rng(2)


def _c(b, name, v):
    return b.const(name, np.float32(v))


def _erf_gelu(b, x, order="hf", scale="div", sqrt2=math.sqrt(2.0), half=0.5):
    u = b.op("Div", [x, _c(b, "s2", sqrt2)]) if scale == "div" else b.op("Mul", [_c(b, "is2", 1 / sqrt2), x])
    a = b.op("Add", [b.op("Erf", [u]), _c(b, "one", 1.0)])
    if order == "hf":  # (x * a) * 0.5
        return b.op("Mul", [b.op("Mul", [x, a]), _c(b, "half", half)])
    if order == "half_first":  # (x * 0.5) * a
        return b.op("Mul", [b.op("Mul", [x, _c(b, "half", half)]), a])
    return b.op("Mul", [_c(b, "half", half), b.op("Mul", [a, x])])  # 0.5 * (a * x)


def _tanh_gelu(b, x, cube="pow", order="gpt2", kappa=0.044715):
    if cube == "pow":
        x3 = b.op("Pow", [x, _c(b, "three", 3.0)])
    elif cube == "mul_left":
        x3 = b.op("Mul", [b.op("Mul", [x, x]), x])
    else:
        x3 = b.op("Mul", [x, b.op("Mul", [x, x])])
    inner = b.op("Add", [x, b.op("Mul", [x3, _c(b, "kappa", kappa)])])
    t = b.op("Tanh", [b.op("Mul", [inner, _c(b, "beta", math.sqrt(2 / math.pi))])])
    a = b.op("Add", [t, _c(b, "one", 1.0)])
    if order == "gpt2":  # (x * 0.5) * a
        return b.op("Mul", [b.op("Mul", [x, _c(b, "half", 0.5)]), a])
    return b.op("Mul", [_c(b, "half", 0.5), b.op("Mul", [x, a])])  # torch's legacy symbolic


def _graph(make, leak=False, **kw):
    b = GraphBuilder("gelu")
    x = b.op("Relu", [b.input("x", (3, 7))])
    x = b.op("Sub", [x, _c(b, "shift", 1.0)])
    y = make(b, x, **kw)
    b.output(y, "y")
    if leak:  # the 1 + erf(...) / 1 + tanh(...) intermediate is also read elsewhere
        add = next(n for n in b.graph.nodes if n.op == "Add" and b.graph.types[n.outputs[0]].shape == (3, 7)
                   and any(i in b.graph.constants and "one" in i for i in n.inputs))
        b.output(b.op("Neg", [add.outputs[0]]), "leak")
    return b.build()


def _check(g, approximate):
    snapshot = [(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in g.nodes]
    f = fuse_gelu(g)
    assert [(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in g.nodes] == snapshot  # input kept
    infer_types(f)
    gelus = [n for n in f.nodes if n.op == "Gelu"]
    if approximate is None:
        assert not gelus
    else:
        assert len(gelus) == 1 and gelus[0].attrs["approximate"] == approximate
        assert not {"Erf", "Tanh", "Pow"} & {n.op for n in f.nodes}
    feeds = {"x": RNG.standard_normal((3, 7)).astype(np.float32) * 3}
    want, got = run(g, feeds), run(f, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["hf", "half_first", "half_outer"])
@pytest.mark.parametrize("scale", ["div", "mul"])
def test_erf_gelu_fuses(order, scale):
    _check(_graph(_erf_gelu, order=order, scale=scale), "none")


@pytest.mark.parametrize("cube", ["pow", "mul_left", "mul_right"])
@pytest.mark.parametrize("order", ["gpt2", "torch"])
def test_tanh_gelu_fuses(cube, order):
    _check(_graph(_tanh_gelu, cube=cube, order=order), "tanh")


@pytest.mark.parametrize("make,kw", [
    (_erf_gelu, dict(sqrt2=1.5)),  # wrong constant inside erf
    (_erf_gelu, dict(half=0.25)),  # wrong outer constant
    (_tanh_gelu, dict(kappa=0.05)),  # wrong cubic coefficient
    (_erf_gelu, dict(leak=True)),  # an intermediate with another reader
    (_tanh_gelu, dict(leak=True)),
])
def test_gelu_near_misses_do_not_fuse(make, kw):
    _check(_graph(make, **kw), None)


def test_erf_of_another_value_does_not_fuse():
    b = GraphBuilder("g")
    x, z = b.input("x", (3, 7)), b.input("z", (3, 7))
    a = b.op("Add", [b.op("Erf", [b.op("Div", [z, _c(b, "s2", math.sqrt(2))])]), _c(b, "one", 1.0)])
    b.output(b.op("Mul", [b.op("Mul", [x, a]), _c(b, "half", 0.5)]), "y")
    g = b.build()
    assert "Gelu" not in [n.op for n in fuse_gelu(g).nodes]
