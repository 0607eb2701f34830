"""Property test: random chains of element-wise ops, layout noise and constant subgraphs keep their results."""

import numpy as np
import pytest

from tremula.ir import GraphBuilder, infer_types, run
from tremula.passes import canonicalize

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

_STEPS = st.lists(st.tuples(st.sampled_from(["add", "mul", "neg", "tanh", "identity", "cast", "reshape", "transpose",
                                             "const_only", "expand"]),
                            st.integers(0, 1000), st.floats(-2, 2, allow_nan=False, width=32)),
                  min_size=1, max_size=14)


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(_STEPS, st.booleans())
def test_random_graphs_keep_their_results(steps, from_constant):
    """Any chain of element-wise ops, layout noise and constant-only subgraphs: canonicalize changes no result."""
    b = GraphBuilder("random")
    x = b.input("x", (3, 4))
    vals = [b.const("c0", np.arange(12, dtype=np.float32).reshape(3, 4) / 7) if from_constant else x]
    for op, pick, k in steps:
        v = vals[pick % len(vals)]
        shape = b.type(v).shape
        if op in ("add", "mul"):
            same = [u for u in vals if b.type(u).shape == shape]
            other = same[pick % len(same)] if pick % 3 == 0 else b.const(f"k{len(vals)}", np.float32(k))
            v = b.op("Add" if op == "add" else "Mul", [v, other])
        elif op in ("neg", "tanh", "identity"):
            v = b.op(op.capitalize(), [v])
        elif op == "cast":
            v = b.op("Cast", [v], to="float32")
        elif op == "reshape":
            v = b.op("Reshape", [v], shape=[(12,), (2, 6), (4, 3), (3, 4)][pick % 4])
        elif op == "transpose":
            v = b.op("Transpose", [v], perm=tuple(reversed(range(len(shape)))))
        elif op == "expand":
            v = b.op("Expand", [v], shape=(1,) * len(shape))
        else:
            v = b.op("Mul", [b.const(f"a{len(vals)}", np.float32([k] * 12)), b.const(f"b{len(vals)}", np.float32(2))])
        vals.append(v)
    b.output(vals[-1], "y")
    b.output(b.op("Add", [x, b.const("one", np.float32(1))]), "z")
    g = b.build()
    c = canonicalize(g)
    assert not any(n.op in ("Identity", "Expand") for n in c.nodes if n.outputs[0] != "y")
    _same(g, c, {"x": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}, rtol=1e-5)


def _same(before, after, feeds, rtol):
    infer_types(after)
    want, got = run(before, feeds), run(after, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-6)
