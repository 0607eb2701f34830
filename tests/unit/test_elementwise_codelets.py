"""The element-wise codelets compute what the reference interpreter's rules compute: they call the same kernels."""

import numpy as np
import pytest

from tremula.codelets import codelet
from tremula.codelets.elementwise import BINARY, BINARY_IDS, UNARY, UNARY_IDS
from tremula.ir.ops import rule


@pytest.mark.parametrize("dtype", ["int32", "int64", "float32"])
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_codelet_matches_the_reference(op, dtype):
    rng = np.random.default_rng(3)
    a = rng.integers(-50, 50, (4, 6)).astype(dtype)
    b = rng.integers(1, 9, (4, 6)).astype(dtype) * np.where(rng.random((4, 6)) < 0.5, -1, 1).astype(dtype)
    if op == "Pow":  # integers to negative powers are not defined
        b = np.abs(b) % 4
    want = np.asarray(rule(op).ref([a, b], {})[0])
    out = np.zeros(want.shape, want.dtype)
    codelet("binary").run([a, b, out], (BINARY_IDS[op],))
    assert np.array_equal(out, want), op


def test_integer_div_truncates_toward_zero_in_the_codelet():
    """ONNX's integer Div is C division: -7 / 2 is -3 (floor would give -4)."""
    a, b = np.array([[-7, 7, -7, 7]], np.int64), np.array([[2, 2, -2, -2]], np.int64)
    out = np.zeros_like(a)
    codelet("binary").run([a, b, out], (BINARY_IDS["Div"],))
    assert out.tolist() == [[-3, 3, 3, -3]]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", sorted(set(UNARY) - {"Cast", "GeluTanh", "Not"}))
def test_unary_codelet_matches_the_reference(op, dtype):
    x = np.random.default_rng(5).uniform(0.1, 3.0, (3, 7)).astype(dtype)  # positive: Log and Sqrt defined
    x[0] *= -1 if op not in ("Log", "Sqrt") else 1
    want = np.asarray(rule(op).ref([x], {})[0])
    out = np.zeros(want.shape, want.dtype)
    codelet("unary").run([x, out], (UNARY_IDS[op],))
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), op
