"""Property test: random valid ONNX graphs over the supported ops, imported by tremula, agree with onnxruntime.

Each example builds an ONNX model step by step (element-wise ops with broadcasting, integer and boolean paths,
matmuls, reductions, data movement, shape arithmetic that folds away, and the decomposed LayerNorm / GELU /
attention / patch-embedding patterns the fusions look for, sometimes subtly wrong so that they must not fuse). Four
answers must agree: onnxruntime on the model, the reference interpreter on the imported Graph and on the canonicalised
one, and onnxruntime on tremula's export of the canonical Graph. A few examples are also compiled for a tiny chip and
run in the functional simulator.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_ops_vs_ort import run_ort

from tremula.export import export_onnx
from tremula.frontends.onnx_import import import_onnx
from tremula.ir import run
from tremula.passes import canonicalize

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
ort.set_default_logger_severity(3)  # fuzzed models leave initializers unused; onnxruntime would warn about each

EXAMPLES = int(os.environ.get("TREMULA_FUZZ_EXAMPLES", "0"))  # > 0: that many random examples, for a longer hunt


def fuzz_settings(n: int):
    """n examples, the same ones on every run (CI); TREMULA_FUZZ_EXAMPLES=N runs N new random ones instead."""
    return hypothesis.settings(max_examples=EXAMPLES or n, deadline=None, derandomize=not EXAMPLES, database=None,
                               suppress_health_check=list(hypothesis.HealthCheck))


OPSETS = (13, 17, 18, 20, 21)  # the importer reads 13-21; 17 adds LayerNormalization, 18 axes inputs, 20 Gelu
I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
TINY16 = Path(__file__).parents[2] / "examples" / "chips" / "tiny16.toml"
MAX_ELEMENTS = 600  # per value: small enough that the reference interpreter and onnxruntime take milliseconds
_ONNX_TYPE = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "bool": TensorProto.BOOL,
              "float16": TensorProto.FLOAT16}


@dataclass
class Val:
    """One value the next steps may read."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    mag: float  # an upper bound of |values|: amplifying ops are applied only where float32 keeps its precision
    exact: bool  # fed, constant or moved (not computed): comparisons on it cannot tie-break differently in two runtimes
    fed: bool = False  # a graph input or initializer: not a graph output (ONNX outputs are made by nodes)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class ModelFuzz:
    """Builds one random valid ONNX model; every random choice is a hypothesis draw, so failures shrink."""

    def __init__(self, data, opset: int, seed: int):
        self.data, self.opset = data, opset
        self.rng = np.random.default_rng(seed)  # values only; every structural choice is drawn
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.vals: list[Val] = []
        self.outputs: list[Val] = []
        self.count = 0

    # ------------------------------------------------------------------------------------------------ drawing
    def draw(self, strategy, label: str = ""):
        return self.data.draw(strategy, label=label or None)

    def chance(self, label: str = "") -> bool:
        return self.draw(st.booleans(), label)

    def mostly(self, label: str = "") -> bool:
        """True three times in four (shrinking to True): for the usual form of a pattern, against its variants."""
        return self.choice([True, True, True, False], label)

    def pick_int(self, lo: int, hi: int, label: str = "") -> int:
        return self.draw(st.integers(lo, hi), label)

    def choice(self, options, label: str = ""):
        return self.draw(st.sampled_from(list(options)), label)

    def pick(self, dtype: str = "float32", min_rank: int = 0, exact: bool = False, where=None) -> Val | None:
        """A value of this dtype; the most recent ones first, so a shrunk example reads the newest value."""
        cands = [v for v in reversed(self.vals) if v.dtype == dtype and len(v.shape) >= min_rank
                 and (v.exact or not exact) and (where is None or where(v))]
        if not cands:
            return None
        return cands[self.pick_int(0, len(cands) - 1, "value")]

    def shape(self, min_rank: int = 1, max_rank: int = 4, max_dim: int = 5) -> tuple[int, ...]:
        rank = self.pick_int(min_rank, max_rank, "rank")
        dims = tuple(self.pick_int(1, max_dim, "dim") for _ in range(rank))
        return dims if math.prod(dims) <= MAX_ELEMENTS else tuple(min(d, 3) for d in dims)

    # ------------------------------------------------------------------------------------------------ making values
    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def add(self, v: Val) -> Val:
        if v.size <= MAX_ELEMENTS:  # a value too big to build on is still computed, just not read further
            self.vals.append(v)
        return v

    def feed(self, shape: tuple[int, ...], dtype: str = "float32", kind: str = "", graph_input: bool = False) -> Val:
        """A new graph input (or, half the time for floats, an initializer) of random values."""
        kind = kind or self.choice(["uniform", "rounded"] if dtype == "float32" else ["uniform"], "values")
        if dtype == "float32":
            # "rounded": small integers as floats, so comparisons, Max/Min and Relu see ties and exact zeros
            arr = (np.round(self.rng.uniform(-3, 3, shape)) if kind == "rounded" else self.rng.uniform(-2, 2, shape))
            arr, mag = arr.astype(np.float32), 3.0
        elif dtype == "int64":
            arr, mag = self.rng.integers(-9, 10, shape).astype(np.int64), 9.0
        else:
            arr, mag = self.rng.random(shape) < 0.5, 1.0
        arr = np.asarray(arr)  # a rank-0 draw is a NumPy scalar, which onnxruntime does not take as a feed
        if dtype != "float32" or graph_input or self.chance("input or initializer"):
            name = self.fresh("in")
            self.inputs.append(helper.make_tensor_value_info(name, _ONNX_TYPE[dtype], list(shape)))
            self.feeds[name] = arr
        else:
            name = self.const(arr, "w")
        return self.add(Val(name, tuple(shape), dtype, mag, True, fed=True))

    def const(self, arr, hint: str = "c") -> str:
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def ints(self, values) -> str:
        return self.const(np.asarray(list(values), np.int64), "ints")

    def node(self, op: str, ins: list[str], n_out: int = 1, **attrs) -> list[str]:
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, ins, outs, name=self.fresh(f"n_{op}"), **attrs))
        return outs

    def emit(self, op: str, ins: list[Val | str], shape, dtype: str, mag: float, exact: bool = False,
             **attrs) -> Val:
        (out,) = self.node(op, [i.name if isinstance(i, Val) else i for i in ins], **attrs)
        return self.add(Val(out, tuple(int(d) for d in shape), dtype, float(mag), exact))

    def bounded(self, v: Val, limit: float) -> Val:
        """v, squashed by Tanh first when its values may exceed `limit` (so products stay well inside float32)."""
        if v.mag <= limit:
            return v
        return self.emit("Tanh", [v], v.shape, v.dtype, 1.0)

    def partner(self, v: Val, dtype: str = "float32", exact: bool = False, shape=None) -> Val:
        """A second operand broadcasting with v (or with `shape`): an existing value, a new feed, or a scalar."""
        shape = v.shape if shape is None else tuple(shape)
        how = self.choice(["existing", "feed", "scalar"], "partner")
        if how == "existing":
            found = self.pick(dtype, exact=exact, where=lambda u: _broadcasts(u.shape, shape) and u is not v)
            if found is not None:
                return found
        if how == "scalar":
            value = self.rng.uniform(-2, 2) if dtype == "float32" else self.rng.integers(-5, 6)
            name = self.const(np.asarray(value, dtype=dtype), "s")
            return Val(name, (), dtype, abs(float(value)), True, fed=True)
        return self.feed(self._bcast_shape(shape), dtype)

    def _bcast_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A shape broadcasting with `shape`: some dims 1, fewer or more leading dims, a 1-dim grown."""
        out = [1 if self.chance("unit dim") else d for d in shape]
        drop = self.pick_int(0, len(out), "drop leading")
        out = [self.pick_int(1, 3, "grown") if d == 1 and s == 1 else d for d, s in zip(out[drop:], shape[drop:])]
        # new leading dims only in front of the whole shape (after dropped ones they would meet its dims)
        lead = [self.pick_int(1, 3, "lead") for _ in range(self.pick_int(0, 2 - len(shape), "new lead"))
                ] if drop == 0 and len(shape) < 2 else []
        return tuple(lead + out)

    # ------------------------------------------------------------------------------------------------ the steps
    def step(self, steps: list[str]) -> None:
        name = self.choice(steps, "step")
        getattr(self, "op_" + name)()

    def op_unary(self) -> None:
        v = self.pick()
        if v is None:
            return
        op = self.choice(["Neg", "Abs", "Tanh", "Sigmoid", "Relu", "Erf", "Identity", "Exp", "Log", "Sqrt",
                          "Reciprocal", "Dropout", "Floor"], "unary")
        if op in ("Neg", "Abs", "Relu", "Identity"):
            self.emit(op, [v], v.shape, v.dtype, v.mag, v.exact)
        elif op in ("Tanh", "Sigmoid", "Erf"):
            self.emit(op, [v], v.shape, v.dtype, 1.0)
        elif op == "Exp":
            v = self.bounded(v, 4.0)
            self.emit("Exp", [v], v.shape, v.dtype, math.exp(v.mag))
        elif op == "Dropout":  # inference: the identity, and its mask output (if asked for) all ones
            outs = self.node("Dropout", [v.name], n_out=2 if self.chance("mask") else 1)
            self.add(Val(outs[0], v.shape, v.dtype, v.mag, v.exact))
            if len(outs) == 2:
                self.add(Val(outs[1], v.shape, "bool", 1.0, True))
        elif op == "Floor":  # on a constant only (folded at import): the importer has no run-time Floor
            c = self.const(self.rng.uniform(-2, 2, v.shape).astype(np.float32))
            fl = self.emit("Floor", [c], v.shape, v.dtype, 3.0, True)
            self.emit("Add", [v, fl], v.shape, v.dtype, v.mag + 3)
        else:  # keep the argument where the function is defined and tame: |x| + 0.5
            pos = self.emit("Add", [self.emit("Abs", [v], v.shape, v.dtype, v.mag, v.exact),
                                    self.const(np.float32(0.5))], v.shape, v.dtype, v.mag + 0.5)
            mag = {"Log": max(math.log(2.0), math.log(pos.mag)), "Sqrt": math.sqrt(pos.mag), "Reciprocal": 2.0}[op]
            self.emit(op, [pos], v.shape, v.dtype, mag)

    def op_binary(self) -> None:
        v = self.pick()
        if v is None:
            return
        op = self.choice(["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Sum"], "binary")
        exact = op in ("Max", "Min", "Mod")
        if exact and not v.exact:
            op = "Add"
            exact = False
        u = self.partner(v, exact=exact)
        out = np.broadcast_shapes(v.shape, u.shape)
        if math.prod(out) > MAX_ELEMENTS:
            return
        a, b = (v, u) if self.chance("order") else (u, v)
        if op in ("Add", "Sub"):
            self.emit(op, [a, b], out, "float32", a.mag + b.mag)
        elif op in ("Max", "Min"):
            self.emit(op, [a, b], out, "float32", max(a.mag, b.mag), True)
        elif op == "Sum":
            parts = [a, b] + ([v] if self.chance("third") else [])
            self.emit("Sum", parts, out, "float32", sum(p.mag for p in parts))
        elif op == "Mul":
            a, b = self.bounded(a, 30.0), self.bounded(b, 30.0)
            self.emit("Mul", [a, b], out, "float32", a.mag * b.mag)
        else:  # Div, Pow, Mod: a positive second operand |b| + 0.5 keeps them finite and away from 0
            if op == "Pow":  # a positive base, a small exponent
                a = self.bounded(a, 3.0)
                base = self.emit("Add", [self.emit("Abs", [a], a.shape, "float32", a.mag, a.exact),
                                         self.const(np.float32(0.5))], a.shape, "float32", a.mag + 0.5)
                e = self.choice([2.0, 3.0, 0.5, -0.5, -1.0, 1.5, "tensor"], "exponent")
                if e == "tensor":
                    expo = self.bounded(b, 1.0)
                    self.emit("Pow", [base, expo], out, "float32", (base.mag + 2) ** 1.0)
                else:
                    self.emit("Pow", [base, self.const(np.float32(e))], base.shape, "float32",
                              max(base.mag, 2.0) ** abs(e))
                return
            pos = self.emit("Add", [self.emit("Abs", [b], b.shape, "float32", b.mag, b.exact),
                                    self.const(np.float32(0.5))], b.shape, "float32", b.mag + 0.5, b.exact)
            if op == "Div":
                self.emit("Div", [a, pos], out, "float32", a.mag * 2)
            else:  # float Mod must be fmod=1 in ONNX
                self.emit("Mod", [a, pos], out, "float32", a.mag, True, fmod=1)

    def op_compare(self) -> None:
        v = self.pick(exact=True)
        if v is None:
            return
        u = self.partner(v, exact=True)
        out = np.broadcast_shapes(v.shape, u.shape)
        if math.prod(out) > MAX_ELEMENTS:
            return
        op = self.choice(["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "IsNaN"], "compare")
        if op == "IsNaN":
            cond = self.emit("IsNaN", [v], v.shape, "bool", 1.0, True)
        else:
            cond = self.emit(op, [v, u], out, "bool", 1.0, True)
        self._use_bool(cond)

    def op_bool(self) -> None:
        c = self.pick("bool")
        if c is None:
            c = self.feed(self.shape(), "bool")
        op = self.choice(["And", "Or", "Xor", "Not"], "bool op")
        if op == "Not":
            self._use_bool(self.emit("Not", [c], c.shape, "bool", 1.0, True))
            return
        d = self.partner(c, "bool") if self.chance("bool partner") else self.feed(self._bcast_shape(c.shape), "bool")
        if d.dtype != "bool":
            return
        out = np.broadcast_shapes(c.shape, d.shape)
        if math.prod(out) <= MAX_ELEMENTS:
            self._use_bool(self.emit(op, [c, d], out, "bool", 1.0, True))

    def _use_bool(self, c: Val) -> None:
        """A condition becomes floats again: Where between two values, or a Cast."""
        if self.chance("where"):
            a = self.pick(where=lambda u: _broadcasts(u.shape, c.shape)) or self.feed(self._bcast_shape(c.shape))
            b = self.partner(a, shape=np.broadcast_shapes(c.shape, a.shape))
            out = np.broadcast_shapes(c.shape, a.shape, b.shape)
            if math.prod(out) <= MAX_ELEMENTS:
                self.emit("Where", [c, a, b], out, "float32", max(a.mag, b.mag), a.exact and b.exact)
        else:
            self.emit("Cast", [c], c.shape, "float32", 1.0, True, to=TensorProto.FLOAT)

    def op_integer(self) -> None:
        """Integer arithmetic (truncating Div, both Mod conventions), then back to float."""
        v = self.pick("int64")
        if v is None:
            src = self.pick(exact=True)
            if src is not None and self.chance("cast from float"):  # float -> int truncates in both runtimes
                v = self.emit("Cast", [src], src.shape, "int64", src.mag, True, to=TensorProto.INT64)
            else:
                v = self.feed(self.shape(), "int64")
        op = self.choice(["Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Max", "Min", "ReduceSum", "CumSum",
                          "Cast"], "int op")
        if not v.shape and op in ("ReduceSum", "CumSum"):
            op = "Neg"
        if op in ("Neg", "Abs"):
            self.emit(op, [v], v.shape, "int64", v.mag, True)
        elif op == "Cast":
            self.emit("Cast", [v], v.shape, "float32", v.mag, True, to=TensorProto.FLOAT)
        elif op == "ReduceSum":
            axes = sorted({self.pick_int(-len(v.shape), len(v.shape) - 1, "axis")})
            keep = self.pick_int(0, 1, "keepdims")
            self.emit("ReduceSum", [v, self.ints(axes)], _reduced(v.shape, axes, keep), "int64",
                      v.mag * v.size, True, keepdims=keep)
        elif op == "CumSum":
            self._cumsum(v)
        elif op in ("Div", "Mod"):
            u = self.partner(v, "int64")
            if u.dtype != "int64":
                return
            # a divisor of either sign, never 0: (|u| + 1) * sign
            sign = self.const(np.where(self.rng.random(u.shape) < 0.5, -1, 1).astype(np.int64), "sign")
            div = self.emit("Mul", [self.emit("Add", [self.emit("Abs", [u], u.shape, "int64", u.mag, True),
                                                      self.const(np.int64(1))], u.shape, "int64", u.mag + 1, True),
                                    sign], u.shape, "int64", u.mag + 1, True)
            out = np.broadcast_shapes(v.shape, u.shape)
            if math.prod(out) > MAX_ELEMENTS:
                return
            attrs = {"fmod": self.pick_int(0, 1, "fmod")} if op == "Mod" else {}
            self.emit(op, [v, div], out, "int64", v.mag, True, **attrs)
        else:
            u = self.partner(v, "int64")
            out = np.broadcast_shapes(v.shape, u.shape)
            if u.dtype == "int64" and math.prod(out) <= MAX_ELEMENTS:
                self.emit(op, [v, u], out, "int64", v.mag * u.mag if op == "Mul" else v.mag + u.mag, True)

    def op_matmul(self) -> None:
        v = self.pick(min_rank=1)
        if v is None:
            return
        v = self.bounded(v, 5.0)
        k = v.shape[-1]
        how = self.choice(["weight", "vector", "batched", "gemm"], "matmul")
        if how == "gemm":
            return self._gemm(v)
        if how == "vector":
            w = self.feed((k,))
            out = v.shape[:-1]
        elif how == "weight":
            n = self.pick_int(1, 6, "n")
            w = self.feed((k, n))
            out = v.shape[:-2] + ((v.shape[-2],) if len(v.shape) > 1 else ()) + (n,)
        else:  # a batched right operand that broadcasts against v's leading dims
            n = self.pick_int(1, 4, "n")
            lead = tuple(1 if self.chance("unit batch") else self.pick_int(1, 3, "batch") for _ in range(
                self.pick_int(1, 2, "batch rank")))
            w = self.feed(lead + (k, n))
            vl = v.shape[:-2] if len(v.shape) > 1 else ()
            try:
                blead = tuple(np.broadcast_shapes(vl, lead))
            except ValueError:
                return
            out = blead + ((v.shape[-2],) if len(v.shape) > 1 else ()) + (n,)
        if math.prod(out) <= MAX_ELEMENTS:
            self.emit("MatMul", [v, w], out, "float32", v.mag * w.mag * k)

    def _gemm(self, v: Val) -> None:
        if len(v.shape) != 2:
            v = self.emit("Flatten", [v], (int(np.prod(v.shape[:1])), int(np.prod(v.shape[1:]))), v.dtype, v.mag,
                          v.exact, axis=1)
        ta, tb = self.pick_int(0, 1, "transA"), self.pick_int(0, 1, "transB")
        m, k = (v.shape[1], v.shape[0]) if ta else v.shape
        n = self.pick_int(1, 5, "n")
        b = self.feed((n, k) if tb else (k, n))
        alpha, beta = self.choice([1.0, 0.5, -2.0], "alpha"), self.choice([1.0, 0.25], "beta")
        ins = [v, b]
        if self.chance("C"):
            ins.append(self.feed(self.choice([(n,), (1, n), (m, 1), (m, n), ()], "C shape")))
        if m * n <= MAX_ELEMENTS:
            self.emit("Gemm", ins, (m, n), "float32", abs(alpha) * v.mag * b.mag * k + 3, alpha=alpha, beta=beta,
                      transA=ta, transB=tb)

    def op_reduce(self) -> None:
        v = self.pick(min_rank=1)
        if v is None:
            return
        op = self.choice(["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "Softmax"], "reduce")
        rank = len(v.shape)
        if op == "Softmax":
            self.emit("Softmax", [v], v.shape, "float32", 1.0, axis=self.pick_int(-rank, rank - 1, "axis"))
            return
        axes = None if self.chance("all axes") else sorted({self.pick_int(-rank, rank - 1, "axis")
                                                            for _ in range(self.pick_int(1, rank, "n axes"))})
        if axes is not None and len({a % rank for a in axes}) != len(axes):
            return  # an axis named twice (as -1 and rank-1) is invalid ONNX
        keep = self.pick_int(0, 1, "keepdims")
        ins: list[Val | str] = [v]
        attrs: dict = {"keepdims": keep}
        if axes is not None:
            if op == "ReduceSum" or self.opset >= 18:
                ins.append(self.ints(axes))
            else:
                attrs["axes"] = axes
        shape = _reduced(v.shape, axes if axes is not None else list(range(rank)), keep)
        mag = v.mag * (v.size if op == "ReduceSum" else 1)
        self.emit(op, ins, shape, "float32", mag, v.exact and op in ("ReduceMax", "ReduceMin"), **attrs)

    def op_norm(self) -> None:
        """LayerNormalization (opset 17+) or Gelu (opset 20+) as ONNX ops."""
        v = self.pick(min_rank=1, where=lambda u: u.shape[-1] > 1)
        if v is None:
            return
        if self.opset >= 20 and self.chance("gelu op"):
            self.emit("Gelu", [v], v.shape, "float32", v.mag, approximate=self.choice(["none", "tanh"], "approx"))
            return
        if self.opset < 17:
            return
        d = v.shape[-1]
        ins: list[Val | str] = [v, self.feed((d,))]
        if self.chance("bias"):
            ins.append(self.feed((d,)))
        axis = self.choice([-1, len(v.shape) - 1], "axis")
        self.emit("LayerNormalization", ins, v.shape, "float32", 4 * math.sqrt(d) + 3, axis=axis,
                  epsilon=self.choice([1e-5, 1e-3], "eps"))

    # ------------------------------------------------------------------------------------------------ data movement
    def op_move(self) -> None:
        v = self.pick(self.choice(["float32", "float32", "int64", "bool"], "dtype"))
        if v is None:
            return
        op = self.choice(["Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Slice", "Split",
                          "Expand", "Tile", "Trilu", "CumSum", "Identity"], "move")
        getattr(self, "_" + op.lower())(v)

    def _like(self, v: Val, shape, op: str, ins, **attrs) -> Val:
        return self.emit(op, ins, shape, v.dtype, v.mag, v.exact, **attrs)

    def _reshape(self, v: Val) -> None:
        dims = _factor(v.size, self.pick_int(1, 4, "new rank"), self)
        spec = list(dims)
        if self.chance("minus one"):
            spec[self.pick_int(0, len(spec) - 1, "where -1")] = -1
        for i in range(min(len(spec), len(v.shape))):
            if spec[i] == v.shape[i] and self.chance("zero copies"):
                spec[i] = 0  # 0 = copy the input's dim (allowzero=0)
        self._like(v, dims, "Reshape", [v, self.ints(spec)])

    def _flatten(self, v: Val) -> None:
        r = len(v.shape)
        axis = self.pick_int(-r, r, "axis") if r else 0
        a = axis + r if axis < 0 else axis
        self._like(v, (math.prod(v.shape[:a]), math.prod(v.shape[a:])), "Flatten", [v], axis=axis)

    def _squeeze(self, v: Val) -> None:
        ones = [i for i, d in enumerate(v.shape) if d == 1]
        if not ones:
            return
        if self.chance("no axes"):
            self._like(v, tuple(d for d in v.shape if d != 1), "Squeeze", [v])
            return
        axes = sorted({self.choice(ones, "axis") for _ in range(len(ones))})
        spec = [a - len(v.shape) if self.chance("negative") else a for a in axes]
        self._like(v, tuple(d for i, d in enumerate(v.shape) if i not in axes), "Squeeze", [v, self.ints(spec)])

    def _unsqueeze(self, v: Val) -> None:
        if len(v.shape) >= 5:
            return
        rank = len(v.shape) + 1
        a = self.pick_int(0, rank - 1, "axis")
        shape = v.shape[:a] + (1,) + v.shape[a:]
        self._like(v, shape, "Unsqueeze", [v, self.ints([a - rank if self.chance("negative") else a])])

    def _transpose(self, v: Val) -> None:
        if self.chance("default perm") or not v.shape:  # (an empty perm cannot be written as an attribute)
            self._like(v, v.shape[::-1], "Transpose", [v])
            return
        perm = list(self.draw(st.permutations(range(len(v.shape))), "perm"))
        self._like(v, tuple(v.shape[p] for p in perm), "Transpose", [v], perm=perm)

    def _concat(self, v: Val) -> None:
        if not v.shape:
            return
        r = len(v.shape)
        axis = self.pick_int(-r, r - 1, "axis")
        parts = [v]
        for _ in range(self.pick_int(1, 2, "parts")):
            if self.chance("self"):
                parts.append(v)
            else:
                shape = list(v.shape)
                shape[axis] = self.pick_int(1, 3, "size")
                parts.append(self.feed(tuple(shape), v.dtype))
        out = list(v.shape)
        out[axis] = sum(p.shape[axis] for p in parts)
        if math.prod(out) <= MAX_ELEMENTS:
            self.emit("Concat", parts, out, v.dtype, max(p.mag for p in parts), all(p.exact for p in parts),
                      axis=axis)

    def _slice(self, v: Val) -> None:
        if not v.shape:
            return
        r = len(v.shape)
        axes = sorted({self.pick_int(0, r - 1, "axis") for _ in range(self.pick_int(1, r, "n axes"))})
        starts, ends, steps, shape = [], [], [], list(v.shape)
        for a in axes:
            d = v.shape[a]
            step = self.choice([1, 1, 2, 3, -1, -2], "step")
            start = self.choice([self.pick_int(-d - 2, d + 2, "start"), I64_MAX if step < 0 else 0], "start kind")
            end = self.choice([self.pick_int(-d - 2, d + 2, "end"), I64_MAX if step > 0 else I64_MIN], "end kind")
            n = len(range(*slice(start, end, step).indices(d)))
            if n == 0:
                return  # zero-size values are another test's business
            starts.append(start)
            ends.append(end)
            steps.append(step)
            shape[a] = n
        ins = [v, self.ints(starts), self.ints(ends)]
        if self.chance("axes input") or any(s != 1 for s in steps):
            ins.append(self.ints([a - r if self.chance("negative axis") else a for a in axes]))
            if any(s != 1 for s in steps) or self.chance("steps input"):
                ins.append(self.ints(steps))
        elif axes != list(range(len(axes))):
            return  # without an axes input the starts apply to the first axes
        self._like(v, shape, "Slice", ins)

    def _split(self, v: Val) -> None:
        if not v.shape:
            return
        r = len(v.shape)
        axis = self.pick_int(-r, r - 1, "axis")
        d = v.shape[axis]
        how = self.choice(["sizes", "equal", "num_outputs"], "split")
        attrs: dict = {"axis": axis}
        ins = [v.name]
        if how == "sizes":
            cuts = sorted({self.pick_int(1, d - 1, "cut") for _ in range(self.pick_int(0, 2, "n cuts"))}) if d > 1 else []
            sizes = np.diff([0, *cuts, d]).tolist()
            ins.append(self.ints(sizes))
        elif how == "num_outputs" and self.opset >= 18:
            k = self.pick_int(1, d, "k")
            chunk = -(-d // k)
            sizes = [chunk] * (d // chunk) + ([d % chunk] if d % chunk else [])
            attrs["num_outputs"] = len(sizes)
        else:
            k = self.choice([k for k in range(1, d + 1) if d % k == 0], "k")
            sizes = [d // k] * k
            if self.opset >= 18:  # equal parts without a split input: num_outputs says how many
                attrs["num_outputs"] = k
        outs = self.node("Split", ins, n_out=len(sizes), **attrs)
        for o, s in zip(outs, sizes):
            shape = list(v.shape)
            shape[axis] = s
            self.add(Val(o, tuple(shape), v.dtype, v.mag, v.exact))

    def _expand(self, v: Val) -> None:
        if self.chance("smaller target"):  # a target of lower rank: ONNX broadcasts both ways
            target = [d if self.chance("keep") else 1 for d in v.shape[len(v.shape) - self.pick_int(0, len(v.shape), "r"):]]
        else:
            target = list(self._bcast_shape(v.shape))
        out = np.broadcast_shapes(v.shape, tuple(target))
        if math.prod(out) <= MAX_ELEMENTS:
            self._like(v, out, "Expand", [v, self.ints(target)])

    def _tile(self, v: Val) -> None:
        reps = [self.pick_int(1, 3, "rep") for _ in v.shape]
        out = tuple(d * r for d, r in zip(v.shape, reps))
        if math.prod(out) <= MAX_ELEMENTS:
            self._like(v, out, "Tile", [v, self.ints(reps)])

    def _trilu(self, v: Val) -> None:
        if len(v.shape) < 2 or v.dtype == "bool" or self.opset < 14:  # Trilu: opset 14
            return
        ins = [v] + ([self.const(np.int64(self.pick_int(-3, 3, "k")))] if self.chance("k") else [])
        self._like(v, v.shape, "Trilu", ins, upper=self.pick_int(0, 1, "upper"))

    def _cumsum(self, v: Val) -> None:
        if not v.shape or v.dtype == "bool":
            return
        r = len(v.shape)
        axis = np.asarray(self.pick_int(-r, r - 1, "axis"), self.choice([np.int64, np.int32], "axis type"))
        self.emit("CumSum", [v, self.const(axis)], v.shape, v.dtype, v.mag * v.shape[int(axis)], v.dtype == "int64",
                  exclusive=self.pick_int(0, 1, "exclusive"), reverse=self.pick_int(0, 1, "reverse"))

    def _identity(self, v: Val) -> None:
        self._like(v, v.shape, "Identity", [v])

    def op_gather(self) -> None:
        v = self.pick(self.choice(["float32", "int64"], "dtype"), min_rank=1)
        if v is None:
            return
        r = len(v.shape)
        how = self.choice(["Gather", "GatherElements", "GatherND"], "gather")
        if how == "Gather":
            axis = self.pick_int(-r, r - 1, "axis")
            d = v.shape[axis]
            ishape = tuple(self.pick_int(1, 3, "idx dim") for _ in range(self.pick_int(0, 2, "idx rank")))
            idx = self.rng.integers(-d, d, ishape).astype(np.int64)
            shape = v.shape[: axis % r] + ishape + v.shape[axis % r + 1:]
            if math.prod(shape) <= MAX_ELEMENTS:
                self._like(v, shape, "Gather", [v, self.const(idx, "idx")], axis=axis)
        elif how == "GatherElements":
            axis = self.pick_int(-r, r - 1, "axis")
            ishape = tuple(self.pick_int(1, d, "idx dim") if i != axis % r else self.pick_int(1, 4, "idx dim")
                           for i, d in enumerate(v.shape))
            idx = self.rng.integers(-v.shape[axis], v.shape[axis], ishape).astype(np.int64)
            self._like(v, ishape, "GatherElements", [v, self.const(idx, "idx")], axis=axis)
        else:
            k = self.pick_int(1, r, "k")
            lead = tuple(self.pick_int(1, 3, "idx dim") for _ in range(self.pick_int(0, 2, "idx rank")))
            idx = np.stack([self.rng.integers(-d, d, lead) for d in v.shape[:k]], axis=-1).astype(np.int64)
            self._like(v, lead + v.shape[k:], "GatherND", [v, self.const(idx, "idx")])

    def op_shape_arith(self) -> None:
        """Shapes computed from Shape() at run time, as exporters write them: they must fold away at import."""
        v = self.pick(min_rank=2)
        if v is None:
            return
        r = len(v.shape)
        how = self.choice(["merge_last", "constant_of_shape", "range", "size", "shape_slice"], "shape arith")
        if how == "merge_last":  # Reshape(v, Concat(Shape(v)[:r-2], [-1]))
            (s,) = self.node("Shape", [v.name])
            (lead,) = self.node("Slice", [s, self.ints([0]), self.ints([r - 2])])
            (spec,) = self.node("Concat", [lead, self.ints([-1])], axis=0)
            self._like(v, v.shape[:-2] + (v.shape[-2] * v.shape[-1],), "Reshape", [v, spec])
        elif how == "shape_slice" and self.opset >= 15:  # Shape with start/end, then Gather of one dim
            (s,) = self.node("Shape", [v.name], start=1)
            (d,) = self.node("Gather", [s, self.const(np.int64(0))], axis=0)
            (d1,) = self.node("Unsqueeze", [d, self.ints([0])])
            (spec,) = self.node("Concat", [self.ints([-1]), d1], axis=0)
            self._like(v, (v.size // v.shape[1], v.shape[1]), "Reshape", [v, spec])
        elif how == "constant_of_shape":  # v + ConstantOfShape(Shape(v)) filled with c
            (s,) = self.node("Shape", [v.name])
            c = float(self.rng.uniform(-1, 1))
            fill = helper.make_tensor("value", TensorProto.FLOAT, [1], [c])
            (k,) = self.node("ConstantOfShape", [s], value=fill)
            self.emit("Add", [v, k], v.shape, "float32", v.mag + 1)
        elif how == "range":  # v + Range(0, d, 1) cast to float, along the last axis
            d = v.shape[-1]
            (s,) = self.node("Shape", [v.name])
            (last,) = self.node("Gather", [s, self.const(np.int64(r - 1))], axis=0)
            (rg,) = self.node("Range", [self.const(np.int64(0)), last, self.const(np.int64(1))])
            (f,) = self.node("Cast", [rg], to=TensorProto.FLOAT)
            self.emit("Add", [v, f], v.shape, "float32", v.mag + d)
        else:  # v * Size(v) / Size(v)
            (n,) = self.node("Size", [v.name])
            (f,) = self.node("Cast", [n], to=TensorProto.FLOAT)
            (y,) = self.node("Div", [v.name, f])
            self.emit("Mul", [y, f], v.shape, "float32", v.mag * 1.01)

    def op_cast(self) -> None:
        """Round trips through float16 (exact rounding in both runtimes) and CastLike."""
        v = self.pick(exact=True)  # a computed value could round to a different half in each runtime
        if v is None or v.mag > 60000:
            return
        if self.opset >= 15 and self.chance("castlike"):
            like = self.feed((1,), "int64") if self.chance("to int") and v.exact else None
            if like is not None:
                self.emit("CastLike", [v, like], v.shape, "int64", v.mag, True)
                return
        h = self.emit("Cast", [v], v.shape, "float16", v.mag, v.exact, to=TensorProto.FLOAT16)
        self.emit("Cast", [h], v.shape, "float32", v.mag, v.exact, to=TensorProto.FLOAT)

    # ------------------------------------------------------------------------------------------------ patterns
    def op_layernorm_pattern(self) -> None:
        """(x - mean) / sqrt(mean((x - mean)^2) + eps) [* g] [+ b], as exporters decompose it, sometimes not over
        the last axis or with an interior value also read elsewhere (then it must not fuse, or fuse correctly)."""
        x = self.pick(min_rank=1, where=lambda u: u.shape[-1] > 1)
        if x is None:
            return
        x = self.bounded(x, 5.0)
        r, d = len(x.shape), x.shape[-1]
        axes = [-1 if self.mostly("last axis") else self.pick_int(-r, r - 1, "axis")]

        def mean(v: Val) -> Val:  # keepdims=1 (the default), so it broadcasts back against v
            shape = _reduced(v.shape, axes, 1)
            if self.opset >= 18:
                return self.emit("ReduceMean", [v, self.ints(axes)], shape, "float32", v.mag)
            return self.emit("ReduceMean", [v], shape, "float32", v.mag, axes=axes)

        m = mean(x)
        xc = self.emit("Sub", [x, m], x.shape, "float32", 2 * x.mag)
        sq = (self.emit("Pow", [xc, self.const(np.float32(2.0))], x.shape, "float32", 4 * x.mag**2)
              if self.chance("pow") else self.emit("Mul", [xc, xc], x.shape, "float32", 4 * x.mag**2))
        var = mean(sq)
        eps = self.const(np.asarray(self.choice([1e-3, 1e-2], "eps"), np.float32).reshape(
            self.choice([(), (1,)], "eps shape")))
        ve = self.emit("Add", [var, eps] if self.chance("eps order") else [eps, var], var.shape, "float32", 4 * x.mag**2)
        form = self.choice(["div_sqrt", "div_pow", "mul_rsqrt", "mul_pow"], "form")
        if form == "div_sqrt":
            y = self.emit("Div", [xc, self.emit("Sqrt", [ve], ve.shape, "float32", 3 * x.mag)], x.shape, "float32",
                          40 * x.mag)
        elif form == "div_pow":
            y = self.emit("Div", [xc, self.emit("Pow", [ve, self.const(np.float32(0.5))], ve.shape, "float32", 3)],
                          x.shape, "float32", 40 * x.mag)
        elif form == "mul_rsqrt":
            rs = self.emit("Reciprocal", [self.emit("Sqrt", [ve], ve.shape, "float32", 3)], ve.shape, "float32", 40)
            y = self.emit("Mul", [xc, rs] if self.chance("order") else [rs, xc], x.shape, "float32", 40 * x.mag)
        else:
            rs = self.emit("Pow", [ve, self.const(np.float32(-0.5))], ve.shape, "float32", 40)
            y = self.emit("Mul", [xc, rs], x.shape, "float32", 40 * x.mag)
        if self.chance("gamma"):
            g = self.feed(self.choice([(d,), (1, d)], "gamma shape"))
            y = self.emit("Mul", [y, g] if self.chance("order") else [g, y],
                          np.broadcast_shapes(y.shape, g.shape), "float32", y.mag * g.mag)
        if self.chance("beta"):
            b = self.feed((d,))
            y = self.emit("Add", [y, b], y.shape, "float32", y.mag + b.mag)
        if not self.mostly("no leak"):  # an interior value also read outside: the fusion must leave it computable
            self.outputs.append(self.choice([m, xc, var], "leaked"))

    def op_gelu_pattern(self) -> None:
        """0.5 x (1 + erf(x / sqrt 2)) or the tanh form, in the orders exporters write, sometimes with a wrong
        constant or a second x (then it must not fuse)."""
        x = self.pick(min_rank=1)
        if x is None:
            return
        x = self.bounded(x, 6.0)
        other = None if self.mostly("one x") else self.pick(where=lambda u: u.shape == x.shape and u is not x)

        def c(value: float, wrong: float) -> str:
            # one in ten constants is wrong (then it is not a GELU); shrinking goes to the right one
            return self.const(np.float32(self.choice([value] * 9 + [wrong], "constant")))

        z = other or x
        if self.chance("erf"):
            arg = (self.emit("Div", [z, c(math.sqrt(2), 1.5)], x.shape, "float32", z.mag) if self.chance("div")
                   else self.emit("Mul", [z, c(1 / math.sqrt(2), 0.7)], x.shape, "float32", z.mag))
            t = self.emit("Erf", [arg], x.shape, "float32", 1.0)
        else:
            cube = (self.emit("Pow", [z, c(3.0, 2.0)], x.shape, "float32", z.mag**3) if self.chance("pow")
                    else self.emit("Mul", [z, self.emit("Mul", [z, z], x.shape, "float32", z.mag**2)], x.shape,
                                   "float32", z.mag**3))
            inner = self.emit("Add", [z, self.emit("Mul", [cube, c(0.044715, 0.05)], x.shape, "float32", z.mag**3)],
                              x.shape, "float32", 2 * z.mag**3)
            t = self.emit("Tanh", [self.emit("Mul", [inner, c(math.sqrt(2 / math.pi), 0.8)], x.shape, "float32",
                                             inner.mag)], x.shape, "float32", 1.0)
        one = self.emit("Add", [t, c(1.0, 1.5)] if self.chance("order") else [c(1.0, 1.5), t], x.shape, "float32",
                        2.5)
        if self.chance("half first"):
            h = self.emit("Mul", [x, c(0.5, 0.4)], x.shape, "float32", x.mag)
            self.emit("Mul", [h, one], x.shape, "float32", 3 * x.mag)
        else:
            h = self.emit("Mul", [x, one], x.shape, "float32", 3 * x.mag)
            self.emit("Mul", [h, c(0.5, 0.4)] if self.chance("order") else [c(0.5, 0.4), h], x.shape, "float32",
                      3 * x.mag)
        if not self.mostly("no leak"):
            self.outputs.append(t)

    def op_attention_pattern(self) -> None:
        """softmax(q k^T * scale [+ mask | where]) v on [B, H, S, D], as exporters and SDPA write it."""
        b, h = self.pick_int(1, 2, "B"), self.pick_int(1, 3, "H")
        sq, sk, dq, dv = (self.pick_int(1, 5, "Sq"), self.pick_int(1, 5, "Sk"), self.pick_int(1, 6, "D"),
                          self.pick_int(1, 4, "Dv"))
        q = self.feed((b, h, sq, dq), kind="uniform", graph_input=True)  # else all of it may fold
        kform = self.choice(["transpose", "given", "heads_last", "rank2"], "k form")
        if kform == "transpose":
            k = self.feed((b, h, sk, dq), kind="uniform")
            kt = self.emit("Transpose", [k], (b, h, dq, sk), "float32", k.mag, perm=[0, 1, 3, 2])
        elif kform == "heads_last":  # k as [B, Sk, H, D], one Transpose straight to k^T
            k = self.feed((b, sk, h, dq), kind="uniform")
            kt = self.emit("Transpose", [k], (b, h, dq, sk), "float32", k.mag, perm=[0, 2, 3, 1])
        elif kform == "rank2":  # k^T shared by every batch and head: MatMul broadcasts it
            kt = self.feed((dq, sk), kind="uniform")
        else:
            kt = self.feed((b, h, dq, sk), kind="uniform")
        scale = self.choice([1 / math.sqrt(dq), 0.5, 1.0], "scale")
        how = self.choice(["after", "div", "split", "none"], "scale form")
        if how == "split":  # sqrt(scale) on each operand, as torch's SDPA decomposition writes it
            rs = self.const(np.float32(math.sqrt(scale)))
            q = self.emit("Mul", [q, rs], q.shape, "float32", q.mag)
            kt = self.emit("Mul", [kt, rs], kt.shape, "float32", kt.mag)
        s = self.emit("MatMul", [q, kt], (b, h, sq, sk), "float32", 4 * dq)
        if how == "after":
            s = self.emit("Mul", [s, self.const(np.float32(scale))], s.shape, "float32", s.mag)
        elif how == "div":
            s = self.emit("Div", [s, self.const(np.float32(1 / scale))], s.shape, "float32", s.mag)
        mask = self.choice(["none", "causal", "padding", "input", "where_causal", "where_random", "zeros"], "mask")
        allowed = np.tril(np.ones((sq, sk), bool), k=sk - sq)
        if sk < sq and mask in ("causal", "where_causal"):
            mask = "none"  # rows with every key masked: onnxruntime's softmax gives NaN there
        fill = self.choice([-1e9, float(np.finfo(np.float32).min), -1e4], "fill")
        if mask in ("causal", "padding", "zeros"):
            if mask == "causal":
                m = np.where(allowed, 0, fill)[None, None]
            elif mask == "padding":
                keep = self.rng.random((b, 1, 1, sk)) < 0.7
                keep[..., 0] = True
                m = np.where(keep, 0, fill)
            else:
                m = np.zeros((1, 1, sq, sk))
            s = self.emit("Add", [s, self.const(m.astype(np.float32), "mask")], s.shape, "float32", s.mag)
        elif mask == "input":
            mk = self.feed((b, 1, 1, sk), kind="uniform")
            s = self.emit("Add", [mk, s] if self.chance("order") else [s, mk], s.shape, "float32", s.mag + 2)
        elif mask.startswith("where"):
            keep = allowed if mask == "where_causal" else self.rng.random((sq, sk)) < 0.7
            keep[:, 0] = keep[-1, :] = True  # every row and column keeps a key (softmax may run over either)
            flag_kept = self.chance("condition flags the kept positions")
            cond = self.const(keep if flag_kept else ~keep, "cond")
            fillc = self.const(np.float32(-np.inf if self.chance("inf") else fill))
            ins = [cond, s, fillc] if flag_kept else [cond, fillc, s]
            s = self.emit("Where", ins, s.shape, "float32", s.mag)
        axis = self.choice([-1, 3, -1, 3, 2], "softmax axis")  # 2 is not attention: must stay unfused and correct
        p = self.emit("Softmax", [s], s.shape, "float32", 1.0, axis=axis)
        if not self.mostly("no nan guard"):  # SDPA's Where(IsNaN(p), 0, p)
            isnan = self.emit("IsNaN", [p], p.shape, "bool", 1.0)
            p = self.emit("Where", [isnan, self.const(np.float32(0)), p], p.shape, "float32", 1.0)
        v = self.feed((b, h, sk, dv), kind="uniform")
        self.emit("MatMul", [p, v], (b, h, sq, dv), "float32", v.mag)
        if not self.mostly("no leak"):
            self.outputs.append(s)

    def op_conv(self) -> None:
        """Conv with strides, pads, dilations, groups and auto_pad; or the patch embedding (stride = kernel) with
        the Reshape + Transpose tail ViTs have."""
        n, c = self.pick_int(1, 2, "N"), self.pick_int(1, 4, "C")
        hh, ww = self.pick_int(2, 8, "H"), self.pick_int(2, 8, "W")
        x = self.feed((n, c, hh, ww), kind="uniform")
        if self.chance("patch embedding"):
            p = self.pick_int(1, min(hh, ww), "patch")
            o = self.pick_int(1, 4, "O")
            w = self.feed((o, c, p, p), kind="uniform")
            ins = [x, w] + ([self.feed((o,), kind="uniform")] if self.chance("bias") else [])
            gh, gw = hh // p, ww // p
            y = self.emit("Conv", ins, (n, o, gh, gw), "float32", 4 * c * p * p + 2, strides=[p, p],
                          kernel_shape=[p, p])
            if self.chance("tail"):
                r = self.emit("Reshape", [y, self.ints([n, o, gh * gw])], (n, o, gh * gw), "float32", y.mag)
                self.emit("Transpose", [r], (n, gh * gw, o), "float32", y.mag, perm=[0, 2, 1])
            return
        g = self.choice([d for d in range(1, c + 1) if c % d == 0], "group")
        o = g * self.pick_int(1, 2, "O per group")
        kh, kw = self.pick_int(1, 3, "kh"), self.pick_int(1, 3, "kw")
        sh, sw = self.pick_int(1, 2, "sh"), self.pick_int(1, 2, "sw")
        dh, dw = self.pick_int(1, 2, "dh"), self.pick_int(1, 2, "dw")
        auto = self.choice(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"], "auto_pad")
        pads = [self.pick_int(0, 1, "pad") for _ in range(4)] if auto == "NOTSET" else [0, 0, 0, 0]
        if auto.startswith("SAME"):
            dh = dw = 1  # onnxruntime refuses dilations with SAME padding
        attrs: dict = {"strides": [sh, sw], "dilations": [dh, dw], "group": g}
        if auto == "NOTSET":
            attrs["pads"] = pads
        else:
            attrs["auto_pad"] = auto
        if auto.startswith("SAME"):
            oh, ow = -(-hh // sh), -(-ww // sw)
        else:
            oh = (hh + pads[0] + pads[2] - dh * (kh - 1) - 1) // sh + 1
            ow = (ww + pads[1] + pads[3] - dw * (kw - 1) - 1) // sw + 1
        if oh < 1 or ow < 1:
            return
        w = self.feed((o, c // g, kh, kw), kind="uniform")
        ins = [x, w] + ([self.feed((o,), kind="uniform")] if self.chance("bias") else [])
        self.emit("Conv", ins, (n, o, oh, ow), "float32", 4 * c * kh * kw + 2, **attrs)

    # ------------------------------------------------------------------------------------------------ the model
    def model(self) -> onnx.ModelProto:
        last = [v for v in self.vals if not v.fed]
        outs = list(self.outputs) + last[-1:]
        for _ in range(self.choice([0, 0, 1, 2], "extra outputs")):  # which may read a pattern's inside
            if last:
                outs.append(last[self.pick_int(0, len(last) - 1, "output")])
        if not outs:  # nothing was computed: one op so the graph has an output made by a node
            v = self.vals[0]
            outs.append(self.emit("Identity", [v], v.shape, v.dtype, v.mag, v.exact))
        seen: set[str] = set()
        out_info = []
        for v in outs:
            if v.name not in seen:
                seen.add(v.name)
                out_info.append(helper.make_tensor_value_info(v.name, _ONNX_TYPE[v.dtype], list(v.shape)))
        self.out_mag = {v.name: v.mag for v in outs}
        g = helper.make_graph(self.nodes, "fuzz", self.inputs, out_info, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 8
        return m


STEPS = ["unary", "binary", "binary", "compare", "bool", "integer", "matmul", "reduce", "norm", "move", "move",
         "gather", "shape_arith", "cast", "layernorm_pattern", "gelu_pattern", "attention_pattern", "conv"]


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        out = np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return math.prod(out) <= MAX_ELEMENTS


def _reduced(shape: tuple[int, ...], axes, keep: int) -> tuple[int, ...]:
    ax = {a % len(shape) for a in axes}
    return tuple(1 if i in ax else d for i, d in enumerate(shape) if keep or i not in ax)


def _factor(n: int, rank: int, fz: ModelFuzz) -> tuple[int, ...]:
    """A random shape of `rank` dims with product n (drawn, so it shrinks)."""
    dims = []
    for _ in range(rank - 1):
        divs = [d for d in range(1, n + 1) if n % d == 0]
        d = fz.choice(divs, "factor")
        dims.append(d)
        n //= d
    return tuple(dims + [n])


# ------------------------------------------------------------------------------------------------------- checking


def _close(name: str, what: str, got: np.ndarray, want: np.ndarray, mag: float) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what} {name}: shape {got.shape}, onnxruntime {want.shape}"
    assert got.dtype == want.dtype, f"{what} {name}: dtype {got.dtype}, onnxruntime {want.dtype}"
    if want.dtype.kind == "f":
        # The bound on |values| sets the absolute tolerance: float32 implementations of exp, erf, tanh and the
        # order of a sum differ in the last bits, relative to the largest value they handled.
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * max(1.0, min(mag, 1e6)), err_msg=f"{what} {name}")
    else:
        np.testing.assert_array_equal(got, want, err_msg=f"{what} {name}")


def agree_with_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray], mags: dict[str, float],
                           path: Path) -> None:
    """onnxruntime on the model == reference on the imported Graph == on the canonical Graph == onnxruntime on the
    canonical Graph's export."""
    want = run_ort(model, feeds)
    onnx.save(model, str(path))
    g = import_onnx(path)
    assert g.outputs == list(want), (g.outputs, list(want))
    for what, graph in (("imported", g), ("canonical", canon := canonicalize(g))):
        got = run(graph, feeds)
        for name in want:
            _close(name, what, got[name], want[name], mags[name])
    exported = run_ort(export_onnx(canon), {k: v for k, v in feeds.items() if k in canon.inputs})
    for name in want:
        _close(name, "exported", exported[name], want[name], mags[name])


def build(data, n_steps: tuple[int, int] = (1, 8), steps: list[str] = STEPS) -> tuple[onnx.ModelProto, dict, dict]:
    opset = data.draw(st.sampled_from(OPSETS), label="opset")
    fz = ModelFuzz(data, opset, data.draw(st.integers(0, 2**16), label="seed"))
    fz.feed(fz.shape(), kind=fz.choice(["uniform", "rounded"], "values"), graph_input=True)
    for _ in range(data.draw(st.integers(*n_steps), label="steps")):
        fz.step(steps)
    return fz.model(), fz.feeds, fz.out_mag


@fuzz_settings(400)
@hypothesis.given(st.data())
def test_random_onnx_graphs_match_onnxruntime(tmp_path_factory, data) -> None:
    model, feeds, mags = build(data)
    agree_with_onnxruntime(model, feeds, mags, tmp_path_factory.mktemp("fuzz") / "m.onnx")


# Float graphs of the ops the planner places (no integer or boolean paths, no Conv: canonicalize makes Patchify only
# from the patch-embedding form), compiled for small chips and run in the functional simulator.
PLANNED_STEPS = ["unary", "binary", "matmul", "reduce", "norm", "layernorm_pattern", "gelu_pattern",
                 "attention_pattern"]


@fuzz_settings(50)
@hypothesis.given(st.data())
def test_random_graphs_compile_and_simulate_on_small_chips(tmp_path_factory, data) -> None:
    """A few random graphs on tiny16 with 1 to 16 tiles: the simulated Program matches the reference, or the
    compile refuses in one line (an op the planner cannot place, or it does not fit)."""
    from tremula.target.chip import load_chip
    from tremula.compiler import DoesNotFit
    from tremula.check import check_model as compile_and_check
    from tremula.errors import TremulaError

    model, _, _ = build(data, (1, 5), PLANNED_STEPS)
    path = tmp_path_factory.mktemp("compile") / "m.onnx"
    onnx.save(model, str(path))
    tiles = data.draw(st.sampled_from([1, 2, 3, 5, 16]), label="tiles")
    text = re.sub(r"^tiles = 16$", f"tiles = {tiles}", TINY16.read_text(), flags=re.MULTILINE)
    chip_path = path.with_name("chip.toml")
    chip_path.write_text(text.replace("sram_bytes_per_tile = 65536", "sram_bytes_per_tile = 262144"))
    try:
        res = compile_and_check(import_onnx(path), load_chip(str(chip_path)), None, "fp32")  # the graph's batch
    except DoesNotFit:
        return
    except TremulaError as e:  # the planner's own limits, said in one line
        assert "\n" not in str(e) and re.search(r"cannot place|not supported by the planner|does not fit|is over",
                                                 str(e)), str(e)
        return
    assert res.passed, [(o.name, o.metric, o.value) for o in res.outputs]


# ------------------------------------------------------------------------------------------- bugs the fuzzer found


def _one_node_model(node: onnx.NodeProto, inputs, output, inits=(), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph([node], "found", inputs, [output], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("axis, shape", [(-2, (3, 5)), (-1, (15, 1)), (-3, (1, 15)), (0, (1, 15)), (3, (15, 1))])
def test_flatten_negative_axis_counts_from_the_rank(tmp_path, axis, shape) -> None:
    """Flatten(axis=-2) of [3, 5, 1] is [3, 5]: the importer took -2 modulo rank + 1 and made [15, 1] ("internal
    import error" against ONNX's own shape inference)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))
    model = _one_node_model(helper.make_node("Flatten", ["x"], ["y"], axis=axis), [x], y)
    feeds = {"x": np.arange(15, dtype=np.float32).reshape(3, 5, 1)}
    agree_with_onnxruntime(model, feeds, {"y": 15.0}, tmp_path / "m.onnx")


def test_attention_with_a_shared_rank2_key_is_left_unfused(tmp_path) -> None:
    """softmax(q[B,H,S,D] @ kt[D,S]) @ v: a kᵀ broadcast over batch and heads is not one k per head. The attention
    fusion unpacked its shape as four dims and raised ValueError; now it stays MatMuls and matches onnxruntime."""
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 2, 3, 4])
    v = helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 2, 5, 2])
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, [1, 2, 3, 2])
    kt = numpy_helper.from_array(np.linspace(-1, 1, 20, dtype=np.float32).reshape(4, 5), "kt")
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    g = helper.make_graph(nodes, "shared_k", [q, v], [out], [kt])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((1, 2, 3, 4)).astype(np.float32),
             "v": rng.standard_normal((1, 2, 5, 2)).astype(np.float32)}
    agree_with_onnxruntime(model, feeds, {"o": 3.0}, tmp_path / "m.onnx")
    assert "Attention" not in {n.op for n in canonicalize(import_onnx(tmp_path / "m.onnx")).nodes}


def test_check_accepts_the_infinities_the_reference_makes(tmp_path) -> None:
    """A causal -inf fill read as an output: the simulator gives the reference's -inf exactly, and `check` said
    "max rel err inf" (inf - inf is NaN). Matching infinities pass; a different one, or a NaN, still fails."""
    from tremula.check import check_model as compile_and_check
    from tremula.check import compare

    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 1, 3, 2])
    kt = numpy_helper.from_array(np.ones((1, 1, 2, 3), np.float32), "kt")
    cond = numpy_helper.from_array(np.tril(np.ones((3, 3), bool)), "cond")
    fill = numpy_helper.from_array(np.float32(-np.inf), "fill")
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Where", ["cond", "s", "fill"], ["w"])]
    g = helper.make_graph(nodes, "masked", [q], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [1, 1, 3, 3])],
                          [kt, cond, fill])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    res = compile_and_check(import_onnx(tmp_path / "m.onnx"), "mk2", None, "fp32")
    assert res.passed and res.outputs[0].value == 0.0, res.outputs
    ref = np.array([1.0, -np.inf, 2.0])
    assert compare("y", ref.copy(), ref, "float32").passed
    assert not compare("y", np.array([1.0, 5.0, 2.0]), ref, "float32").passed
    assert not compare("y", np.array([1.0, np.inf, 2.0]), ref, "float32").passed
    assert not compare("y", np.array([np.nan, -np.inf, 2.0]), ref, "float32").passed
