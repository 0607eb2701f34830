"""The canonical op set: one op = one row of rules (type rule, NumPy reference, FLOP count).

Semantics follow the ONNX operator of the same name with every attribute made static (shapes, axes and slice bounds
are attributes here, not runtime inputs), plus the fused ops a tile machine cares about: LayerNorm, Gelu, Linear,
Attention and Patchify. Ops marked `host_only` (shape arithmetic) must be folded away before planning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import TensorType
from tremula.numerics.amp import half_partials_matmul
from tremula.numerics.erf import erf, gelu

Attrs = dict[str, Any]
TypeRule = Callable[[list[TensorType], Attrs], list[TensorType]]
RefRule = Callable[[list[np.ndarray], Attrs], list[np.ndarray]]
FlopRule = Callable[[list[TensorType], list[TensorType], Attrs], int]


# The stages an op passes through, each named in its row (how to add an op: ARCHITECTURE.md).
IMPORTS = ("direct", "own", "pass")  # ONNX import: the ONNX op of this name as it is (frontends/onnx_ops._direct),
#   a converter of its own there, or made by tremula's passes only (no ONNX op of this meaning)
EXPORTS = ("direct", "own")  # ONNX export: the ONNX op of this name as it is, or a converter of its own
LOWERINGS = ("elementwise", "move", "rows", "own", "")  # plan/lower_ops.RULES: its family's rule, a rule of its own
#   (keyed by the op's name), or "" (the planner refuses it; folding or a pass must remove it first)
DOMAINS = ("real", "positive", "bool")  # an element-wise unary op's inputs, for its tests


@dataclass(frozen=True)
class OpDef:
    """One canonical op: every stage's facts in one row."""

    name: str
    infer: TypeRule
    ref: RefRule
    flops: FlopRule
    n_inputs: tuple[int, int]  # (min, max) number of inputs; optional ones may be ""
    host_only: bool = False  # shape arithmetic that constant folding must remove before planning
    onnx: str = "own"  # IMPORTS
    export: str = "own"  # EXPORTS
    widen_f16: bool = False  # the reference computes float16 in float32: exported in float32 between casts to match
    elementwise: bool = False  # output element i reads element i of each (broadcast) input: any batch (rebatch)
    lower: str = ""  # LOWERINGS
    codelet: str = ""  # the codelet that runs it when it is element-wise ("unary", "binary", "where", "fp8_cast")
    # (name, op id, NumPy kernel) of each variant the unary/binary codelet runs: the id is what a Program stores, so it
    # never changes once given; the kernel is the one the reference rule calls
    kernels: tuple[tuple[str, int, Callable[..., np.ndarray]], ...] = ()
    cost: tuple[tuple[str, int], ...] = ()  # its codelet's work per element: (chip vector op, passes), cost_terms
    domain: str = ""  # DOMAINS, for an element-wise unary op


OPS: dict[str, OpDef] = {}


def _row(name: str, infer: TypeRule, ref: RefRule, flops: FlopRule, n_inputs: tuple[int, int], host_only=False,
         **stages):
    OPS[name] = OpDef(name, infer, ref, flops, n_inputs, host_only, **stages)


def rule(op: str) -> OpDef:
    try:
        return OPS[op]
    except KeyError:
        raise TremulaError(f"op {op!r} is not in tremula's canonical op set") from None


# ---------------------------------------------------------------------------------------------------- helpers


def _short(values, keep: int = 8) -> str:
    """A list for an error message, cut after `keep` items: a hostile file can make it megabytes long (a MatMul
    weight read as Split sizes listed 1,024 of them)."""
    values = list(values)
    if len(values) <= keep:
        return str(values)
    return "[" + ", ".join(str(v) for v in values[:keep]) + f", ... ({len(values)} in all)]"


def _norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise TremulaError(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def _zero_flops(ins, outs, a) -> int:
    return 0


def _per_output(k: int) -> FlopRule:
    return lambda ins, outs, a: k * outs[0].size


def _same(ins: list[TensorType], a: Attrs) -> list[TensorType]:
    return [ins[0]]


# ---------------------------------------------------------------------------------------------------- element-wise

# The element-wise ops. The reference rule and the simulator's codelets (codelets/elementwise.py) call the same
# kernel, so an op computes the same in both (integer Div once floored in the codelet and truncated here). A row's
# `cost` is the chip's vector instructions per element: comparisons, select and logic are one 64-bit instruction per
# loop like max; reciprocal is a divide; erf, pow, mod and softplus have no popops entry of their own: a few-term
# polynomial, exp(y log x), x - y * trunc(x / y) and log(1 + exp(x)).
_V = {op: ((op, 1),) for op in ("add", "sub", "mul", "divide", "max", "min", "neg", "exp", "log", "sqrt", "tanh",
                                "sigmoid", "relu", "cast", "copy", "gelu")}


def _int_div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Integer Div truncates toward zero, as in ONNX (C semantics), not floor like Python's //.
    if np.issubdtype(x.dtype, np.integer):
        return (np.abs(x) // np.abs(y)) * np.sign(x) * np.sign(y)
    return np.divide(x, y)


def _binary(name: str, fn, op_id: int, cost, onnx="direct", export="direct", compare=False) -> None:
    if compare:
        infer = lambda ins, a: [TensorType(tuple(np.broadcast_shapes(ins[0].shape, ins[1].shape)), "bool")]
        ref = lambda xs, a: [np.asarray(fn(xs[0], xs[1]))]
    else:
        infer = lambda ins, a: [TensorType(tuple(np.broadcast_shapes(ins[0].shape, ins[1].shape)), ins[0].dtype)]
        ref = lambda xs, a: [np.asarray(fn(xs[0], xs[1])).astype(xs[0].dtype)]
    _row(name, infer, ref, _per_output(1), (2, 2), onnx=onnx, export=export, widen_f16=not compare, elementwise=True,
         lower="elementwise", codelet="binary", kernels=((name, op_id, fn),), cost=cost)


_binary("Add", np.add, 0, _V["add"])
_binary("Sub", np.subtract, 1, _V["sub"])
_binary("Mul", np.multiply, 2, _V["mul"])
_binary("Div", _int_div, 3, _V["divide"])
_binary("Pow", lambda x, y: np.power(x, y).astype(x.dtype), 4, (("log", 1), ("mul", 1), ("exp", 1)))
_binary("Max", np.maximum, 5, _V["max"], onnx="own")  # (ONNX's Max and Min are variadic)
_binary("Min", np.minimum, 6, _V["min"], onnx="own")
_binary("Mod", np.fmod, 7, (("divide", 1), ("mul", 1), ("sub", 1)), onnx="own", export="own")  # (ONNX's fmod attr)
_binary("Equal", np.equal, 8, _V["max"], compare=True)
_binary("Less", np.less, 9, _V["max"], compare=True)
_binary("Greater", np.greater, 10, _V["max"], compare=True)
_binary("And", np.logical_and, 11, _V["max"], compare=True)
_binary("Or", np.logical_or, 12, _V["max"], compare=True)


def _erf(x: np.ndarray) -> np.ndarray:
    # float64 math.erf rounded to x's type (numerics/erf.py: fast, with the same bits)
    return erf(x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (0.5 * (1.0 + np.tanh(0.5 * x64))).astype(x.dtype)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x.astype(np.float64)).astype(x.dtype)  # log(1 + exp(x)) without overflow, rounded once


def _unary(name: str, fn, op_id: int, cost, domain="real", flops=1, onnx="direct", export="direct", widen_f16=True,
           lower="elementwise") -> None:
    # Transcendentals count 1 FLOP per element, as FLOP counters usually do.
    _row(name, _same, lambda xs, a: [np.asarray(fn(xs[0])).astype(xs[0].dtype)], _per_output(flops), (1, 1),
         onnx=onnx, export=export, widen_f16=widen_f16, elementwise=True, lower=lower, codelet="unary",
         kernels=((name, op_id, fn),), cost=cost, domain=domain)


_unary("Neg", np.negative, 0, _V["neg"])
_unary("Abs", np.abs, 1, _V["max"])
_unary("Exp", np.exp, 2, _V["exp"])
_unary("Log", np.log, 3, _V["log"], domain="positive")
_unary("Sqrt", np.sqrt, 4, _V["sqrt"], domain="positive")
_unary("Reciprocal", np.reciprocal, 5, _V["divide"], domain="positive")
_unary("Tanh", np.tanh, 6, _V["tanh"])
_unary("Erf", _erf, 7, (("tanh", 1), ("mul", 4), ("add", 2)))
_unary("Sigmoid", _sigmoid, 8, _V["sigmoid"])
_unary("Relu", lambda x: np.maximum(x, 0).astype(x.dtype), 9, _V["relu"])
_unary("Not", np.logical_not, 10, _V["max"], domain="bool", flops=0, widen_f16=False)
# Identity is planned as a move (a view of its input), and runs on the unary codelet where a copy is needed.
_unary("Identity", lambda x: x, 11, _V["copy"], flops=0, onnx="own", widen_f16=False, lower="move")
_unary("Softplus", _softplus, 15, (("exp", 1), ("add", 1), ("log", 1)))

_row(
    "Cast",  # on the unary codelet, which converts in the output's assignment
    lambda ins, a: [TensorType(ins[0].shape, a["to"])],
    lambda xs, a: [xs[0].astype(a["to"])],
    _zero_flops,
    (1, 1),
    elementwise=True, lower="elementwise", codelet="unary", kernels=(("Cast", 12, lambda x: x),), cost=_V["cast"],
)
_row(
    "Where",
    lambda ins, a: [
        TensorType(tuple(np.broadcast_shapes(ins[0].shape, ins[1].shape, ins[2].shape)), ins[1].dtype)
    ],
    lambda xs, a: [np.where(xs[0], xs[1], xs[2]).astype(xs[1].dtype)],
    _per_output(1),
    (3, 3),
    onnx="direct", export="direct", elementwise=True, lower="elementwise", codelet="where", cost=_V["max"],
)

# ---------------------------------------------------------------------------------------------------- matmul family


def _matmul_type(ins: list[TensorType], a: Attrs) -> list[TensorType]:
    x, w = ins[0].shape, ins[1].shape
    if len(x) < 1 or len(w) < 1:
        raise TremulaError("MatMul operands must have rank >= 1")
    xs, ws = (x if len(x) > 1 else (1,) + x), (w if len(w) > 1 else w + (1,))
    if xs[-1] != ws[-2]:
        raise TremulaError(f"MatMul inner dimensions differ: {x} x {w}")
    batch = np.broadcast_shapes(xs[:-2], ws[:-2])
    out = tuple(batch) + (xs[-2], ws[-1])
    if len(x) == 1:
        out = out[:-2] + out[-1:]
    if len(w) == 1:
        out = out[:-1]
    return [TensorType(out, ins[0].dtype)]


def _matmul_flops(ins, outs, a) -> int:
    return 2 * outs[0].size * ins[0].shape[-1]


def _matmul_ref(xs, a):
    x, w = xs
    if a.get("partials") == "half" and x.dtype == np.float16:  # the AMP's half partials (numerics/amp.py)
        return [half_partials_matmul(x, w, int(a["group"]))]
    acc = np.float32 if x.dtype == np.float16 else x.dtype  # accumulate half in float, as the AMP can
    return [np.matmul(x.astype(acc, copy=False), w.astype(acc, copy=False)).astype(x.dtype, copy=False)]


# attrs partials="half", group=G (set by passes/precision.with_partials): half partials, rounded every G of K
_row("MatMul", _matmul_type, _matmul_ref, _matmul_flops, (2, 2), onnx="direct", export="direct", widen_f16=True,
     lower="own")


def _linear_type(ins, a):
    (out,) = _matmul_type(ins[:2], a)
    if len(ins) > 2 and ins[2] is not None and ins[2].shape != (ins[1].shape[-1],):
        raise TremulaError(f"Linear bias shape {ins[2].shape} is not ({ins[1].shape[-1]},)")
    return [out]


def _linear_ref(xs, a):
    (y,) = _matmul_ref(xs[:2], a)
    if len(xs) > 2 and xs[2] is not None:
        if xs[2].dtype == y.dtype:  # into the product (a new array): no second output-sized array
            np.add(y, xs[2], out=y)
        else:
            y = (y + xs[2]).astype(y.dtype, copy=False)
    return [y]


_row(
    "Linear",  # x[..., K] @ w[K, N] (+ b[N]): the matmul+bias fusion
    _linear_type,
    _linear_ref,
    lambda ins, outs, a: _matmul_flops(ins, outs, a) + (outs[0].size if len(ins) > 2 and ins[2] is not None else 0),
    (2, 3),
    onnx="pass", widen_f16=True, lower="own",
)

# ---------------------------------------------------------------------------------------------------- reductions


def _reduce_type(ins, a):
    rank = len(ins[0].shape)
    axes = tuple(sorted(_norm_axis(ax, rank) for ax in a["axes"])) if a.get("axes") is not None else tuple(range(rank))
    if a.get("keepdims", 1):
        shape = tuple(1 if i in axes else d for i, d in enumerate(ins[0].shape))
    else:
        shape = tuple(d for i, d in enumerate(ins[0].shape) if i not in axes)
    return [TensorType(shape, ins[0].dtype)]


def _reduce_ref(fn):
    def ref(xs, a):
        x = xs[0]
        axes = tuple(a["axes"]) if a.get("axes") is not None else None
        acc = np.float32 if x.dtype == np.float16 else x.dtype
        y = fn(x.astype(acc), axis=axes, keepdims=bool(a.get("keepdims", 1)))
        return [np.asarray(y).astype(x.dtype)]

    return ref


for _name, _fn in {"ReduceMean": np.mean, "ReduceSum": np.sum, "ReduceMax": np.max}.items():
    _row(_name, _reduce_type, _reduce_ref(_fn), lambda ins, outs, a: ins[0].size, (1, 1), widen_f16=True,
         lower="rows")


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    from tremula.numerics.attention import softmax

    return softmax(x, axis).astype(x.dtype)


_row(
    "Softmax",
    _same,
    lambda xs, a: [_softmax(xs[0], a.get("axis", -1))],
    _per_output(5),  # max, subtract, exp, sum, divide
    (1, 1),
    widen_f16=True, lower="rows",
)

# ---------------------------------------------------------------------------------------------------- fused ops


def _layernorm_ref(xs, a):
    x, g = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    acc = x.astype(np.float32) if x.dtype == np.float16 else x
    mu = acc.mean(axis=-1, keepdims=True)
    var = ((acc - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (acc - mu) / np.sqrt(var + np.asarray(a.get("epsilon", 1e-5), acc.dtype)) * g.astype(acc.dtype)
    if b is not None:
        y = y + b.astype(acc.dtype)
    return [y.astype(x.dtype)]


def _layernorm_type(ins, a):
    d = ins[0].shape[-1]
    for t in ins[1:]:
        if t is not None and t.shape != (d,):
            raise TremulaError(f"LayerNorm scale/bias shape {t.shape} is not ({d},)")
    return [ins[0]]


_row("LayerNorm", _layernorm_type, _layernorm_ref, _per_output(8), (2, 3), widen_f16=True,  # over the last axis
     lower="rows")


def _gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    # in float64, rounded to x's type once (numerics/erf.gelu_exact defines it; gelu returns its bits, fast)
    return gelu(x, approximate)


# Two kernels on the unary codelet, one per `approximate` (the op id picks the formula).
_row("Gelu", _same, lambda xs, a: [_gelu(xs[0], a.get("approximate", "none"))], _per_output(8), (1, 1),
     widen_f16=True, elementwise=True, lower="elementwise", codelet="unary",
     kernels=(("Gelu", 13, lambda x: _gelu(x, "none")), ("GeluTanh", 14, lambda x: _gelu(x, "tanh"))),
     cost=_V["gelu"])


def _attention_type(ins, a):
    q, k, v = ins[0].shape, ins[1].shape, ins[2].shape
    if len(q) < 2 or q[-1] != k[-1] or k[-2] != v[-2] or q[:-2] != k[:-2] or k[:-2] != v[:-2]:
        raise TremulaError(f"Attention shapes do not agree: q{q} k{k} v{v}")
    if len(ins) > 3 and ins[3] is not None:
        try:
            np.broadcast_shapes(ins[3].shape, q[:-1] + (k[-2],))
        except ValueError:
            raise TremulaError(f"Attention mask {ins[3].shape} does not broadcast to {q[:-1] + (k[-2],)}") from None
    return [TensorType(q[:-1] + (v[-1],), ins[0].dtype)]


def _attention_ref(xs, a, mm=np.matmul):
    from tremula.numerics.attention import attention, causal_allowed, group_of

    q, k, v = xs[:3]
    mask = xs[3] if len(xs) > 3 else None
    allowed = causal_allowed(q.shape[-2], k.shape[-2]) if a.get("causal", 0) else None
    return [attention(q, k, v, a["scale"], mask, allowed, group_of(a), mm)]


def _attention_flops(ins, outs, a) -> int:
    q, k, v = ins[0].shape, ins[1].shape, ins[2].shape
    rows = int(np.prod(q[:-1]))
    return 2 * rows * k[-2] * q[-1] + 2 * rows * k[-2] * v[-1] + 5 * rows * k[-2]


_row(
    "Attention",  # softmax(q @ k^T * scale + mask [, causal]) @ v over [..., S, D]; mask is additive
    _attention_type,
    _attention_ref,
    _attention_flops,
    (3, 4),
    onnx="pass", widen_f16=True, lower="own",
)


def _patchify_type(ins, a):
    b, c, h, w = ins[0].shape
    ph, pw = a["patch"]
    gh, gw = h // ph, w // pw
    return [TensorType((b, gh * gw, c * ph * pw), ins[0].dtype)]


def _patchify_ref(xs, a):
    # [B, C, H, W] -> [B, gh*gw, C*ph*pw], patches in row-major order, features in (C, ph, pw) order to match a
    # Conv weight [O, C, ph, pw] flattened to [O, C*ph*pw]. Pixels past the last whole patch are dropped, as Conv does.
    x = xs[0]
    b, c, h, w = x.shape
    ph, pw = a["patch"]
    gh, gw = h // ph, w // pw
    x = x[:, :, : gh * ph, : gw * pw].reshape(b, c, gh, ph, gw, pw).transpose(0, 2, 4, 1, 3, 5)
    return [np.ascontiguousarray(x.reshape(b, gh * gw, c * ph * pw))]


_row("Patchify", _patchify_type, _patchify_ref, _zero_flops, (1, 1), onnx="pass", lower="move")

# ---------------------------------------------------------------------------------------------------- convolution


def _conv_type(ins, a):
    x, w = ins[0].shape, ins[1].shape
    if len(x) != 4 or len(w) != 4:
        raise TremulaError("Conv supports 2-D images only")
    sh, sw = a.get("strides", (1, 1))
    dh, dw = a.get("dilations", (1, 1))
    pt, pl, pb, pr = a.get("pads", (0, 0, 0, 0))
    g = a.get("group", 1)
    if x[1] != w[1] * g:
        raise TremulaError(f"Conv channels differ: input {x[1]}, weight {w[1]} x group {g}")
    oh = (x[2] + pt + pb - dh * (w[2] - 1) - 1) // sh + 1
    ow = (x[3] + pl + pr - dw * (w[3] - 1) - 1) // sw + 1
    return [TensorType((x[0], w[0], oh, ow), ins[0].dtype)]


def _conv_ref(xs, a):
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    sh, sw = a.get("strides", (1, 1))
    dh, dw = a.get("dilations", (1, 1))
    pt, pl, pb, pr = a.get("pads", (0, 0, 0, 0))
    g = a.get("group", 1)
    acc = np.float32 if x.dtype == np.float16 else x.dtype
    xp = np.pad(x.astype(acc), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    n, c, _, _ = x.shape
    o, cg, kh, kw = w.shape
    (out_t,) = _conv_type([TensorType(x.shape, "float32"), TensorType(w.shape, "float32")], a)
    oh, ow = out_t.shape[2:]
    y = np.zeros((n, o, oh, ow), acc)
    og = o // g
    for gi in range(g):
        xg = xp[:, gi * cg : (gi + 1) * cg]
        wg = w[gi * og : (gi + 1) * og].astype(acc)
        for i in range(kh):
            for j in range(kw):
                patch = xg[:, :, i * dh : i * dh + sh * (oh - 1) + 1 : sh, j * dw : j * dw + sw * (ow - 1) + 1 : sw]
                y[:, gi * og : (gi + 1) * og] += np.einsum("nchw,oc->nohw", patch, wg[:, :, i, j])
    if b is not None:
        y += b.astype(acc)[None, :, None, None]
    return [y.astype(x.dtype)]


def _conv_flops(ins, outs, a) -> int:
    o, cg, kh, kw = ins[1].shape
    return 2 * outs[0].size * cg * kh * kw + (outs[0].size if len(ins) > 2 else 0)


_row("Conv", _conv_type, _conv_ref, _conv_flops, (2, 3), widen_f16=True)

# ---------------------------------------------------------------------------------------------------- data movement


def _reshape_type(ins, a):
    shape = tuple(a["shape"])
    if int(np.prod(shape, dtype=np.int64)) != ins[0].size:
        raise TremulaError(f"cannot reshape {_short(ins[0].shape)} to {_short(shape)}")
    return [TensorType(shape, ins[0].dtype)]


_row("Reshape", _reshape_type, lambda xs, a: [xs[0].reshape(a["shape"])], _zero_flops, (1, 1), lower="move")


def transpose_perm(attrs: dict, rank: int) -> tuple[int, ...]:
    """A Transpose's permutation: its `perm`, or without one the axes reversed (ONNX's default)."""
    return tuple(int(p) for p in attrs.get("perm") or reversed(range(rank)))


def _transpose_type(ins, a):
    perm = transpose_perm(a, len(ins[0].shape))
    if sorted(perm) != list(range(len(ins[0].shape))):
        raise TremulaError(f"Transpose perm {_short(perm)} does not match rank {len(ins[0].shape)}")
    return [TensorType(tuple(ins[0].shape[p] for p in perm), ins[0].dtype)]


_row(
    "Transpose",
    _transpose_type,
    lambda xs, a: [np.asarray(np.transpose(xs[0], transpose_perm(a, xs[0].ndim)), order="C")],
    _zero_flops,
    (1, 1),
    lower="move",
)


def _concat_type(ins, a):
    axis = _norm_axis(a["axis"], len(ins[0].shape))
    shape = list(ins[0].shape)
    for t in ins[1:]:
        if len(t.shape) != len(shape) or any(t.shape[i] != shape[i] for i in range(len(shape)) if i != axis):
            raise TremulaError(f"Concat shapes disagree: {_short(t.shape for t in ins)}")
    shape[axis] = sum(t.shape[axis] for t in ins)
    return [TensorType(tuple(shape), ins[0].dtype)]


_row("Concat", _concat_type, lambda xs, a: [np.concatenate(xs, axis=a["axis"])], _zero_flops, (1, 1 << 30),
     lower="move")


def _slices(shape: tuple[int, ...], a: Attrs) -> tuple[slice, ...]:
    idx = [slice(None)] * len(shape)
    steps = a.get("steps") or [1] * len(a["axes"])
    for st, en, ax, sp in zip(a["starts"], a["ends"], a["axes"], steps):
        ax = _norm_axis(ax, len(shape))
        # Python slicing clamps exactly like ONNX Slice (huge ends mean "to the end", INT64_MIN with a negative step
        # means "through index 0"). Do not rebuild the slice from .indices(): its stop of -1 would then mean "last".
        idx[ax] = slice(int(st), int(en), int(sp))
    return tuple(idx)


def slice_index_map(shape: tuple[int, ...], a: Attrs) -> np.ndarray:
    """What Slice's reference gives for the flat index map np.arange(size).reshape(shape), made from the output's
    size alone: one axis at a time, the kept indices of each axis appended below the ones before (the planner's
    moves read this map; a CLS-token slice of BERT-base b145's last hidden state made and sliced a 14 M-entry map)."""
    out = np.zeros((), np.int64)
    for d, s in zip(shape, _slices(shape, a)):
        out = out[..., None] * d + np.arange(d, dtype=np.int64)[s]
    return out


def _slice_type(ins, a):
    # From the shape alone (no array of the input's size: type inference must cost nothing at any batch). A range
    # clamps and counts exactly like slicing a dim of that length.
    shape = ins[0].shape
    out = tuple(len(range(*s.indices(d))) for s, d in zip(_slices(shape, a), shape))
    return [TensorType(out, ins[0].dtype)]


_row(
    "Slice",
    _slice_type,
    lambda xs, a: [np.ascontiguousarray(xs[0][_slices(xs[0].shape, a)])],
    _zero_flops,
    (1, 1),
    lower="move",
)


def _split_type(ins, a):
    axis = _norm_axis(a["axis"], len(ins[0].shape))
    if sum(a["sizes"]) != ins[0].shape[axis]:
        raise TremulaError(f"Split sizes {_short(a['sizes'])} do not sum to {ins[0].shape[axis]}")
    return [TensorType(ins[0].shape[:axis] + (s,) + ins[0].shape[axis + 1 :], ins[0].dtype) for s in a["sizes"]]


def _split_ref(xs, a):
    cuts = np.cumsum(a["sizes"])[:-1]
    return [np.ascontiguousarray(p) for p in np.split(xs[0], cuts, axis=a["axis"])]


_row("Split", _split_type, _split_ref, _zero_flops, (1, 1), lower="move")


def _gather_type(ins, a):
    data, idx = ins[0].shape, ins[1].shape
    axis = _norm_axis(a.get("axis", 0), len(data))
    return [TensorType(data[:axis] + idx + data[axis + 1 :], ins[0].dtype)]


def _gather_ref(xs, a):
    data, idx = xs
    axis = a.get("axis", 0)
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    if np.any(idx < 0) or np.any(idx >= data.shape[axis]):
        raise TremulaError(f"Gather index out of range [0, {data.shape[axis]})")
    return [np.take(data, idx, axis=axis)]


_row("Gather", _gather_type, _gather_ref, _zero_flops, (2, 2), lower="own")


def _expand_type(ins, a):
    return [TensorType(tuple(np.broadcast_shapes(ins[0].shape, tuple(a["shape"]))), ins[0].dtype)]


_row(
    "Expand",
    _expand_type,
    lambda xs, a: [np.asarray(np.broadcast_to(xs[0], np.broadcast_shapes(xs[0].shape, tuple(a["shape"]))), order="C")],
    _zero_flops,
    (1, 1),
    lower="move",
)

# ---------------------------------------------------------------------------------------------------- shape arithmetic
# These only make sense on constants; folding removes them. They are rows so that folding runs one interpreter.

_row(
    "Shape",
    lambda ins, a: [TensorType((len(ins[0].shape[a.get("start", 0) : a.get("end")]),), "int64")],
    lambda xs, a: [np.array(xs[0].shape[a.get("start", 0) : a.get("end")], dtype=np.int64)],
    _zero_flops,
    (1, 1),
    host_only=True,
)


def _range_ref(xs, a):
    start, limit, delta = (x.item() for x in xs)
    return [np.arange(start, limit, delta, dtype=xs[0].dtype)]


_row(
    "Range",
    lambda ins, a: [TensorType((a["length"],), ins[0].dtype)],
    _range_ref,
    _zero_flops,
    (3, 3),
    host_only=True,
)

_row(
    "Trilu",  # lower (upper=0) or upper triangle of the last two axes, with diagonal offset k
    _same,
    lambda xs, a: [(np.triu if a.get("upper", 1) else np.tril)(xs[0], a.get("k", 0))],
    _zero_flops,
    (1, 1),
)

_row(
    "CumSum",
    _same,
    lambda xs, a: [np.cumsum(xs[0], axis=a["axis"]).astype(xs[0].dtype)],
    _per_output(1),
    (1, 1),
)


# ---------------------------------------------------------------------------------------------------- precision


def _fp8_cast_ref(xs, a):
    # Imported here: numerics depends on ml_dtypes, which only this row needs.
    from tremula.numerics.fp8 import Fp8Format, dequantize, fake_quantize, max_abs, quantize, scale_for_max_abs

    x = xs[0]
    fmt = Fp8Format.parse(a["fmt"])
    scale = a.get("scale")
    if scale is None:  # a weight's scale comes from its own max-abs (ipu-hardware.md section 5: per-tensor scale)
        scale = scale_for_max_abs(max_abs(x), fmt)
    if a.get("rounding", "nearest") == "nearest":
        return [fake_quantize(x, fmt, int(scale))]
    rng = np.random.default_rng(a.get("seed", 0)) if a.get("rounding") == "stochastic" else None
    codes = quantize(x, fmt, int(scale), a.get("rounding", "nearest"), rng)
    return [dequantize(codes, fmt, int(scale), x.dtype)]


_row(
    "Fp8Cast",  # round to FP8 (QUARTER, format fmt, power-of-two scale) and back: the values an FP8 operand holds
    _same,
    _fp8_cast_ref,
    _per_output(1),
    (1, 1),
    onnx="pass", widen_f16=True, elementwise=True,
)


# The storage form of an FP8 Linear (passes/precision.fp8_storage): what the planner places and the C600 runs.


def _fp8_quantize_type(ins, a):
    from tremula.numerics.fp8 import Fp8Format

    return [TensorType(ins[0].shape, Fp8Format.parse(a["fmt"]).np_dtype.name)]


def _fp8_quantize_ref(xs, a):
    from tremula.numerics.fp8 import Fp8Format, quantize

    fmt = Fp8Format.parse(a["fmt"])
    rng = np.random.default_rng(a.get("seed", 0)) if a.get("rounding") == "stochastic" else None
    return [quantize(xs[0], fmt, int(a["scale"]), a.get("rounding", "nearest"), rng).view(fmt.np_dtype)]


def _linear_fp8_type(ins, a):
    from tremula.numerics.fp8 import is_fp8

    x, w, s = ins[0], ins[1], ins[2]
    if not is_fp8(x.dtype) or not is_fp8(w.dtype) or s.dtype != "int8" or s.shape != (1, 1):
        raise TremulaError(f"LinearFp8 takes FP8 activations, FP8 weights and an int8[1,1] weight scale, got {x}, {w}, "
                           f"{s}")
    (out,) = _linear_type([x, w] + ins[3:], a)
    return [TensorType(out.shape, "float16")]


def _linear_fp8_ref(xs, a):
    from tremula.numerics.fp8 import amp_fp8_matmul, code_bytes, fp8_format

    x, w, s = xs[:3]
    y = amp_fp8_matmul(code_bytes(x), code_bytes(w), fp8_format(x.dtype), fp8_format(w.dtype), int(a["x_scale"]),
                       int(s.reshape(-1)[0]), int(a["group"]))
    if len(xs) > 3 and xs[3] is not None:
        y = y + xs[3].astype(np.float32)
    return [y.astype(np.float16)]


_row(
    "Fp8Quantize",  # float -> FP8 (the dtype of format fmt) at power-of-two scale; the activation cast vertex
    _fp8_quantize_type,
    _fp8_quantize_ref,
    _per_output(1),
    (1, 1),
    onnx="pass", widen_f16=True, elementwise=True, lower="elementwise", codelet="fp8_cast",
)
_row(
    "LinearFp8",  # FP8 x @ FP8 w (+ b) on the quarter->half AMP; w's scale is an int8[1,1] tensor set at load
    _linear_fp8_type,
    _linear_fp8_ref,
    lambda ins, outs, a: _matmul_flops(ins, outs, a) + (outs[0].size if len(ins) > 3 and ins[3] is not None else 0),
    (3, 4),
    onnx="pass", widen_f16=True, lower="own",
)


def infer(op: str, ins: list[TensorType | None], attrs: Attrs) -> list[TensorType]:
    r = rule(op)
    lo, hi = r.n_inputs
    if not lo <= len(ins) <= hi:
        raise TremulaError(f"{op} takes {lo}..{hi} inputs, got {len(ins)}")
    return r.infer(ins, attrs)  # type: ignore[arg-type]


def flops(op: str, ins: list[TensorType], outs: list[TensorType], attrs: Attrs) -> int:
    return int(rule(op).flops(ins, outs, attrs))
