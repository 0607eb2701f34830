"""LayerNorm fusion on every decomposed form exporters write, and near misses that must stay unfused."""

import numpy as np
import pytest

from tremula.ir import GraphBuilder, infer_types, run
from tremula.passes import canonicalize, fuse_layernorm

RNG = np.random.default_rng(1)
D = 16


def _ln(*, square="pow", divide="div", affine=True, swap=False, axis=-1, exponent=2.0, gamma_shape=(D,),
        leak=False, other_x=False):
    b = GraphBuilder("ln")
    x = b.input("x", (2, 5, D))
    x2 = b.op("Relu", [x])
    mean = b.op("ReduceMean", [x], axes=(axis,), keepdims=1)
    xc = b.op("Sub", [x, mean])
    sq = b.op("Pow", [xc, b.const("two", np.float32(exponent))]) if square == "pow" else b.op("Mul", [xc, xc])
    var = b.op("ReduceMean", [x2 if other_x else sq], axes=(-1,), keepdims=1)
    eps = b.const("eps", np.float32(1e-5))
    ve = b.op("Add", [eps, var] if swap else [var, eps])
    if divide == "pow_half":
        y = b.op("Div", [xc, b.op("Pow", [ve, b.const("half", np.float32(0.5))])])
    elif divide == "rsqrt_pow":
        y = b.op("Mul", [xc, b.op("Pow", [ve, b.const("mhalf", np.float32(-0.5))])])
    elif divide == "div":
        y = b.op("Div", [xc, b.op("Sqrt", [ve])])
    else:
        std = b.op("Sqrt", [ve])
        r = b.op("Reciprocal", [std])
        y = b.op("Mul", [r, xc] if swap else [xc, r])
    if affine:
        g = b.const("gamma", (1 + 0.1 * RNG.standard_normal(gamma_shape)).astype(np.float32))
        be = b.const("beta", RNG.standard_normal(D).astype(np.float32))
        y = b.op("Mul", [g, y] if swap else [y, g])
        y = b.op("Add", [be, y] if swap else [y, be])
    b.output(y, "y")
    if leak:
        b.output(xc, "centred")  # the intermediate is read outside the pattern
    return b.build()


def _check(g, fused: bool):
    snapshot = [(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in g.nodes]
    f = fuse_layernorm(g)
    assert [(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in g.nodes] == snapshot  # input kept
    infer_types(f)
    ops = [n.op for n in f.nodes]
    assert ("LayerNorm" in ops) == fused, ops
    if fused:
        assert not {"ReduceMean", "Sqrt", "Sub"} & set(ops)
    feeds = {"x": RNG.standard_normal((2, 5, D)).astype(np.float32) * 3 + 1}
    want, got = run(g, feeds), run(f, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
    return f


@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("divide", ["div", "reciprocal", "pow_half", "rsqrt_pow"])
@pytest.mark.parametrize("swap", [False, True])
def test_layernorm_forms_fuse(square, divide, swap):
    f = _check(_ln(square=square, divide=divide, swap=swap), fused=True)
    ln = next(n for n in f.nodes if n.op == "LayerNorm")
    assert ln.attrs["epsilon"] == pytest.approx(1e-5) and len(ln.inputs) == 3


def test_layernorm_without_affine_gets_unit_gamma():
    f = _check(_ln(affine=False), fused=True)
    ln = next(n for n in f.nodes if n.op == "LayerNorm")
    assert len(ln.inputs) == 2 and np.all(f.constants[ln.inputs[1]].value() == 1)


def test_layernorm_broadcast_shaped_gamma_is_reshaped():
    _check(_ln(gamma_shape=(1, 1, D)), fused=True)


@pytest.mark.parametrize("miss", ["axis", "exponent", "leak", "other_x"])
def test_layernorm_near_misses_do_not_fuse(miss):
    kwargs = {"axis": dict(axis=1), "exponent": dict(exponent=4.0), "leak": dict(leak=True),
              "other_x": dict(other_x=True)}[miss]
    _check(_ln(**kwargs), fused=False)


def test_per_row_scale_is_not_a_gamma():
    # A [S, D] scale is not LayerNorm's [D] gamma: the normalisation fuses, the scale and shift stay outside.
    f = _check(_ln(gamma_shape=(5, D)), fused=True)
    ln = next(n for n in f.nodes if n.op == "LayerNorm")
    assert len(ln.inputs) == 2
    assert {"Mul", "Add"} <= {n.op for n in f.nodes}


def test_canonicalize_fuses_layernorm_too():
    g = _ln()
    assert [n.op for n in canonicalize(g).nodes] == ["LayerNorm"]
