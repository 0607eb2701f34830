"""A Transpose that moves only axes of size 1 keeps every element in place: the sequence-first view [S, 1, D] of a
[1, S, D] activation, which torch's MultiheadAttention takes at batch 1 (SigLIP's pooling head in a legacy export),
is planned as a Reshape, in place, not as an exchange; and the Program still computes the graph."""

from tremula.check import check_model
from tremula.compiler import compile_model
from tremula.ir import GraphBuilder
from tremula.target.chip import load_chip

C600 = load_chip("c600")


def _graph(perm, shape=(1, 12, 16)):
    b = GraphBuilder("seq_first")
    x = b.input("x", shape)
    t = b.op("Transpose", [x], perm=perm)
    y = b.op("Linear", [t, b.param("w", (16, 8)), b.param("b", (8,))])
    b.output(y, "y")
    return b.build()


def test_a_transpose_of_unit_axes_is_planned_in_place_and_checks():
    res = compile_model(_graph((1, 0, 2)), C600, 1, "fp32")
    moves = [s for k, s in res.strategies.items() if s.startswith("Transpose")]
    assert moves == ["Transpose free (same bytes)"]
    assert check_model(_graph((1, 0, 2)), C600, 1, "fp32").passed


def test_a_transpose_that_reorders_elements_still_moves_them():
    res = compile_model(_graph((1, 0, 2), shape=(2, 12, 16)), C600, 2, "fp32")
    assert [s for s in res.strategies.values() if s.startswith("Transpose")] == ["Transpose exchange"]
    res = compile_model(_graph((0, 2, 1), shape=(1, 16, 16)), C600, 1, "fp32")  # [1, S, D] -> [1, D, S]
    assert [s for s in res.strategies.values() if s.startswith("Transpose")] == ["Transpose exchange"]
    assert check_model(_graph((0, 2, 1), shape=(1, 16, 16)), C600, 1, "fp32").passed
