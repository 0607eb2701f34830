"""The ONNX importer's converter table: (op_type, since_version) -> a function emitting canonical ops for one node."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tremula.ir.graph import DTYPES
from tremula.ir.ops import OPS
from tremula.numerics.fp8 import FP8_DTYPES

if TYPE_CHECKING:
    from tremula.frontends.onnx_import import ImportState

MIN_OPSET, MAX_OPSET = 13, 21


class Unsupported(Exception):
    """This node cannot be imported as written (e.g. a shape computed at run time); the reason is short."""


@dataclass
class ONode:
    """One ONNX node as the converters see it: inputs resolved through aliases, attributes as Python values."""

    op_type: str
    since: int
    ins: list[str]  # "" = omitted optional input
    outs: list[str]
    attrs: dict[str, Any]
    name: str

    def has(self, i: int) -> bool:
        return len(self.ins) > i and bool(self.ins[i])

    def used(self, i: int) -> bool:
        return len(self.outs) > i and bool(self.outs[i])


Converter = Callable[["ImportState", ONode], None]
CONVERTERS: dict[tuple[str, int], Converter] = {}


def since_versions(op_type: str) -> list[int]:
    """The distinct since_versions the default-domain schema of `op_type` has across the supported opsets."""
    out = set()
    for v in range(MIN_OPSET, MAX_OPSET + 1):
        try:
            out.add(onnx.defs.get_schema(op_type, max_inclusive_version=v, domain="").since_version)
        except onnx.defs.SchemaError:
            pass
    return sorted(out)


def _reg(*ops: str, versions: tuple[int, ...] | None = None):
    """Register a converter for every since_version of each op (or the given ones, when semantics differ)."""

    def deco(fn: Converter) -> Converter:
        for op in ops:
            for v in versions or since_versions(op):
                CONVERTERS[(op, v)] = fn
        return fn

    return deco


def undecodable_text(msg) -> str | None:
    """The first string field of a protobuf message (recursively) that is not UTF-8 text, or None.

    ONNX's protobuf is proto2: a corrupt file can hold any bytes in a string field, and protobuf hands such a field
    back as bytes instead of str (a bit flip in an op_type then reached onnx.defs as bytes: a TypeError). Only string
    and message fields are read, so no tensor's raw bytes are copied."""
    for field in msg.DESCRIPTOR.fields:
        if field.type not in (field.TYPE_STRING, field.TYPE_MESSAGE):
            continue
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        if not repeated and field.type == field.TYPE_MESSAGE and not msg.HasField(field.name):
            continue
        value = getattr(msg, field.name)
        for item in value if repeated else [value]:
            if field.type == field.TYPE_STRING:
                if not isinstance(item, str):
                    return field.full_name
            elif (bad := undecodable_text(item)) is not None:
                return bad
    return None


def initializer_mismatch(t: onnx.TensorProto) -> str | None:
    """Why a tensor's (an initializer's, a Constant's) declared dims disagree with the data it holds (None when they agree or cannot be told).

    Checked before anything reads the dims: shape inference treats a big initializer as a typed input, and a corrupt
    file declaring [2**40] over 8 KB of data made onnx's C++ shape inference allocate until the host ran out."""
    dims = [int(d) for d in t.dims]
    if any(d < 0 for d in dims):
        return f"negative dims {dims}"
    n = math.prod(dims)
    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        field = helper.tensor_dtype_to_field(t.data_type)
    except (KeyError, TypeError, ValueError):
        return None  # an element type the importer refuses anyway (with its own message)
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return None  # still on disk: onnx's loader checks its length when it reads it
    if t.HasField("raw_data"):
        have, want = len(t.raw_data), n * itemsize
    elif field in ("float_data", "double_data", "int64_data", "uint64_data") and t.data_type not in (
            onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
        have, want = len(getattr(t, field)), n
    else:
        return None  # packed or complex layouts: left to numpy_helper, which reads only what is there
    if have != want:
        unit = "bytes" if t.HasField("raw_data") else "values"
        return f"tensor {t.name!r} cannot be read: it declares dims {dims} ({want:,} {unit}) but holds {have:,}"
    return None


def malformed(model: onnx.ModelProto) -> str | None:
    """Why a model that parsed is still not a valid ONNX file (None when nothing is seen): text that is not UTF-8, or
    a tensor (initializer or Constant value) whose dims disagree with its data."""
    if (field := undecodable_text(model)) is not None:
        return f"{field} is not UTF-8 text"
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        for a in node.attribute:
            tensors += ([a.t] if a.HasField("t") else []) + list(a.tensors)
    for t in tensors:
        if (why := initializer_mismatch(t)) is not None:
            return why
    return None


def np_dtype(onnx_type: int) -> str:
    try:
        dt = str(np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type)))
    except (KeyError, TypeError, ValueError):
        try:
            dt = onnx.TensorProto.DataType.Name(onnx_type).lower()
        except ValueError:  # not even a DataType (a corrupt or hand-edited file): name the number
            raise Unsupported(f"element type {onnx_type} (not an ONNX data type)") from None
    if dt not in DTYPES or dt in FP8_DTYPES:  # FP8 is made by the precision pass (passes/precision.py), not imported
        raise Unsupported(f"element type {dt}")
    return dt


def _norm(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise Unsupported(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def _ints(st: ImportState, n: ONode, i: int, what: str) -> list[int] | None:
    """The values of optional int input i, which must be constant (None when omitted)."""
    if not n.has(i):
        return None
    return [int(v) for v in np.asarray(st.const_value(n.ins[i], what)).reshape(-1)]


# A constant the importer makes must fit in memory: a hostile file could ask for ConstantOfShape([10**12]).
MAX_CONST_ELEMENTS = 1 << 28


def _check_size(shape, what: str) -> None:
    n = int(np.prod([max(int(d), 0) for d in shape], dtype=np.float64))
    if any(int(d) < 0 for d in shape) or n > MAX_CONST_ELEMENTS:
        raise Unsupported(f"{what} of shape {list(shape)} (over {MAX_CONST_ELEMENTS} elements or negative)")


def _fold_only(n: ONode, st: ImportState, fn: Callable[..., np.ndarray]) -> None:
    """Ops tremula has no canonical row for but that exporters apply to shapes: fine when every input is constant."""
    vals = [st.value(i) if i else None for i in n.ins]
    if any(i and v is None for i, v in zip(n.ins, vals)):
        raise Unsupported("only supported on constant inputs")
    st.set_const(n.outs[0], np.asarray(fn(*vals)))


# ------------------------------------------------------------------------------------------------- no-ops and constants


@_reg("Identity")
def _identity(st: ImportState, n: ONode) -> None:
    st.alias(n.outs[0], n.ins[0])


@_reg("Dropout")
def _dropout(st: ImportState, n: ONode) -> None:
    if n.has(2) and st.value(n.ins[2]) is not None and bool(np.asarray(st.value(n.ins[2])).item()):
        raise Unsupported("training_mode=True")
    st.alias(n.outs[0], n.ins[0])
    if n.used(1):  # inference: nothing is dropped
        st.set_const(n.outs[1], np.ones(st.type(n.ins[0]).shape, bool))


@_reg("Constant")
def _constant(st: ImportState, n: ONode) -> None:
    a = n.attrs
    if "value" in a:
        arr = numpy_helper.to_array(a["value"])
    elif "value_float" in a:
        arr = np.asarray(a["value_float"], np.float32)
    elif "value_floats" in a:
        arr = np.asarray(a["value_floats"], np.float32)
    elif "value_int" in a:
        arr = np.asarray(a["value_int"], np.int64)
    elif "value_ints" in a:
        arr = np.asarray(a["value_ints"], np.int64)
    else:
        raise Unsupported(f"attribute {sorted(a)}")
    st.set_const(n.outs[0], arr)


@_reg("ConstantOfShape")
def _constant_of_shape(st: ImportState, n: ONode) -> None:
    shape = _ints(st, n, 0, "shape")
    _check_size(shape, "constant")
    value = numpy_helper.to_array(n.attrs["value"]).reshape(-1) if "value" in n.attrs else np.zeros(1, np.float32)
    st.set_const(n.outs[0], np.full(shape, value[0], dtype=value.dtype))


# --------------------------------------------------------------------------------------------------------- element-wise


@_reg(*(name for name, d in OPS.items() if d.onnx == "direct"))  # (each op's row says so: ir/ops.py)
def _direct(st: ImportState, n: ONode) -> None:
    st.op(n.op_type, n.ins, n.outs)


@_reg("Max", "Min", "Sum")
def _variadic(st: ImportState, n: ONode) -> None:
    op = "Add" if n.op_type == "Sum" else n.op_type
    ins = [i for i in n.ins if i]
    if len(ins) == 1:
        st.alias(n.outs[0], ins[0])
        return
    acc = ins[0]
    for k, x in enumerate(ins[1:]):
        acc = st.op(op, [acc, x], [n.outs[0]] if k == len(ins) - 2 else None)


@_reg("LessOrEqual", "GreaterOrEqual")
def _le_ge(st: ImportState, n: ONode) -> None:
    strict = st.op("Greater" if n.op_type == "LessOrEqual" else "Less", n.ins[:2])
    st.op("Not", [strict], n.outs)


@_reg("Xor")
def _xor(st: ImportState, n: ONode) -> None:
    st.op("Not", [st.op("Equal", n.ins[:2])], n.outs)


@_reg("IsNaN")
def _isnan(st: ImportState, n: ONode) -> None:
    st.op("Not", [st.op("Equal", [n.ins[0], n.ins[0]])], n.outs)  # NaN is the one value not equal to itself


@_reg("Mod")
def _mod(st: ImportState, n: ONode) -> None:
    if n.attrs.get("fmod", 0) or st.type(n.ins[0]).dtype.startswith("float"):
        st.op("Mod", n.ins[:2], n.outs)
        return
    # Integer Mod with fmod=0 takes the divisor's sign: fix up the truncating remainder where the signs differ.
    a, b = n.ins[:2]
    r = st.op("Mod", [a, b])
    zero = st.const(np.zeros((), st.type(r).dtype))
    differ = st.op(
        "And",
        [
            st.op("Not", [st.op("Equal", [r, zero])]),
            st.op("Not", [st.op("Equal", [st.op("Less", [r, zero]), st.op("Less", [b, zero])])]),
        ],
    )
    st.op("Where", [differ, st.op("Add", [r, b]), r], n.outs)


@_reg("Cast")
def _cast(st: ImportState, n: ONode) -> None:
    to = np_dtype(n.attrs["to"])
    if st.type(n.ins[0]).dtype == to:
        st.alias(n.outs[0], n.ins[0])
    else:
        st.op("Cast", n.ins[:1], n.outs, to=to)


@_reg("CastLike")
def _cast_like(st: ImportState, n: ONode) -> None:
    to = st.type(n.ins[1]).dtype
    if st.type(n.ins[0]).dtype == to:
        st.alias(n.outs[0], n.ins[0])
    else:
        st.op("Cast", n.ins[:1], n.outs, to=to)


def _fold_unary(fn: Callable[[np.ndarray], np.ndarray]) -> Converter:
    return lambda st, n: _fold_only(n, st, lambda x: fn(x).astype(x.dtype))


for _op, _fn in {"Floor": np.floor, "Ceil": np.ceil, "Round": np.round, "Sign": np.sign}.items():
    _reg(_op)(_fold_unary(_fn))
_reg("NonZero")(lambda st, n: _fold_only(n, st, lambda x: np.array(np.nonzero(x), dtype=np.int64)))
_reg("Size")(lambda st, n: st.set_const(n.outs[0], np.asarray(st.type(n.ins[0]).size, np.int64)))

# -------------------------------------------------------------------------------------------------------- matmul family


@_reg("Gemm")
def _gemm(st: ImportState, n: ONode) -> None:
    a, b = n.ins[:2]
    if n.attrs.get("transA", 0):
        a = st.op("Transpose", [a], perm=(1, 0))
    if n.attrs.get("transB", 0):
        b = st.op("Transpose", [b], perm=(1, 0))
    alpha, beta = float(n.attrs.get("alpha", 1.0)), float(n.attrs.get("beta", 1.0))
    dt = st.type(n.ins[0]).dtype
    has_c = n.has(2)
    y = st.op("MatMul", [a, b], None if (has_c or alpha != 1.0) else n.outs)
    if alpha != 1.0:
        y = st.op("Mul", [y, st.const(np.asarray(alpha, dt))], None if has_c else n.outs)
    if has_c:
        c = n.ins[2]
        if beta != 1.0:
            c = st.op("Mul", [c, st.const(np.asarray(beta, dt))])
        st.op("Add", [y, c], n.outs)


# ----------------------------------------------------------------------------------------------------------- reductions


def _reduce_axes(st: ImportState, n: ONode) -> list[int] | None:
    if "axes" in n.attrs:
        return [int(x) for x in n.attrs["axes"]]
    return _ints(st, n, 1, "axes")


@_reg("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")
def _reduce(st: ImportState, n: ONode) -> None:
    axes = _reduce_axes(st, n)
    keep = int(n.attrs.get("keepdims", 1))
    if not axes:
        if n.attrs.get("noop_with_empty_axes", 0):
            st.alias(n.outs[0], n.ins[0])
            return
        axes = None
    if n.op_type == "ReduceMin":  # min(x) = -max(-x): no separate row needed
        neg = st.op("ReduceMax", [st.op("Neg", n.ins[:1])], axes=axes, keepdims=keep)
        st.op("Neg", [neg], n.outs)
    else:
        st.op(n.op_type, n.ins[:1], n.outs, axes=axes, keepdims=keep)


@_reg("Softmax")
def _softmax(st: ImportState, n: ONode) -> None:
    st.op("Softmax", n.ins[:1], n.outs, axis=int(n.attrs.get("axis", -1)))  # opset 13+: a single axis


# ------------------------------------------------------------------------------------------------ fused in ONNX already


@_reg("LayerNormalization")
def _layernorm(st: ImportState, n: ONode) -> None:
    x = st.type(n.ins[0])
    rank = len(x.shape)
    if _norm(int(n.attrs.get("axis", -1)), rank) != rank - 1:
        raise Unsupported(f"axis {n.attrs.get('axis')} (only the last axis)")
    if n.used(1) or n.used(2):
        raise Unsupported("Mean/InvStdDev outputs")
    d = x.shape[-1]
    params = []
    for i in (1, 2):
        if not n.has(i):
            continue
        p = n.ins[i]
        if st.type(p).shape != (d,):
            if st.type(p).size != d:
                raise Unsupported(f"scale/bias of shape {st.type(p).shape}")
            p = st.op("Reshape", [p], shape=(d,))
        params.append(p)
    st.op("LayerNorm", [n.ins[0]] + params, n.outs, epsilon=float(n.attrs.get("epsilon", 1e-5)))


@_reg("Gelu")
def _gelu(st: ImportState, n: ONode) -> None:
    approx = n.attrs.get("approximate", "none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    st.op("Gelu", n.ins[:1], n.outs, approximate=approx)


# ---------------------------------------------------------------------------------------------------------- convolution


@_reg("Conv")
def _conv(st: ImportState, n: ONode) -> None:
    x, w = st.type(n.ins[0]).shape, st.type(n.ins[1]).shape
    if len(x) != 4:
        raise Unsupported(f"{len(x) - 2}-D convolution (only 2-D)")
    strides = [int(s) for s in n.attrs.get("strides", (1, 1))]
    dil = [int(d) for d in n.attrs.get("dilations", (1, 1))]
    pads = [int(p) for p in n.attrs.get("pads", (0, 0, 0, 0))]
    auto = n.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0, 0, 0, 0]
        for k in range(2):
            out = -(-x[2 + k] // strides[k])
            total = max(0, (out - 1) * strides[k] + dil[k] * (w[2 + k] - 1) + 1 - x[2 + k])
            small, big = total // 2, total - total // 2
            pads[k], pads[k + 2] = (small, big) if auto == "SAME_UPPER" else (big, small)
    elif auto == "VALID":
        pads = [0, 0, 0, 0]
    ins = [i for i in n.ins[:3] if i]
    st.op(
        "Conv",
        ins,
        n.outs,
        strides=tuple(strides),
        dilations=tuple(dil),
        pads=tuple(pads),
        group=int(n.attrs.get("group", 1)),
    )


# -------------------------------------------------------------------------------------------------------- data movement


@_reg("Reshape")
def _reshape(st: ImportState, n: ONode) -> None:
    x = st.type(n.ins[0]).shape
    shape = _ints(st, n, 1, "shape")
    assert shape is not None
    if not n.attrs.get("allowzero", 0):
        shape = [x[i] if s == 0 else s for i, s in enumerate(shape)]
    if shape.count(-1) > 1:
        raise Unsupported(f"shape {shape} has more than one -1")
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
        shape[shape.index(-1)] = int(np.prod(x, dtype=np.int64)) // max(known, 1)
    st.op("Reshape", n.ins[:1], n.outs, shape=tuple(shape))


@_reg("Flatten")
def _flatten(st: ImportState, n: ONode) -> None:
    x = st.type(n.ins[0]).shape
    # axis in [-r, r]; a negative one counts from the rank r (not r + 1): -1 leaves the last dim alone
    axis = int(n.attrs.get("axis", 1))
    if not -len(x) <= axis <= len(x):
        raise Unsupported(f"axis {axis} out of range for rank {len(x)}")
    axis = axis + len(x) if axis < 0 else axis
    shape = (int(np.prod(x[:axis], dtype=np.int64)), int(np.prod(x[axis:], dtype=np.int64)))
    st.op("Reshape", n.ins[:1], n.outs, shape=shape)


@_reg("Squeeze")
def _squeeze(st: ImportState, n: ONode) -> None:
    x = st.type(n.ins[0]).shape
    axes = _ints(st, n, 1, "axes")
    drop = {i for i, d in enumerate(x) if d == 1} if axes is None else {_norm(a, len(x)) for a in axes}
    st.op("Reshape", n.ins[:1], n.outs, shape=tuple(d for i, d in enumerate(x) if i not in drop))


@_reg("Unsqueeze")
def _unsqueeze(st: ImportState, n: ONode) -> None:
    x = st.type(n.ins[0]).shape
    axes = _ints(st, n, 1, "axes") or []
    rank = len(x) + len(axes)
    new = {_norm(a, rank) for a in axes}
    it = iter(x)
    st.op("Reshape", n.ins[:1], n.outs, shape=tuple(1 if i in new else next(it) for i in range(rank)))


@_reg("Transpose")
def _transpose(st: ImportState, n: ONode) -> None:
    perm = n.attrs.get("perm")
    perm = tuple(int(p) for p in perm) if perm else tuple(reversed(range(len(st.type(n.ins[0]).shape))))
    st.op("Transpose", n.ins[:1], n.outs, perm=perm)


@_reg("Concat")
def _concat(st: ImportState, n: ONode) -> None:
    st.op("Concat", [i for i in n.ins if i], n.outs, axis=int(n.attrs["axis"]))


@_reg("Slice")
def _slice(st: ImportState, n: ONode) -> None:
    starts, ends = _ints(st, n, 1, "starts"), _ints(st, n, 2, "ends")
    assert starts is not None and ends is not None
    axes = _ints(st, n, 3, "axes") or list(range(len(starts)))
    steps = _ints(st, n, 4, "steps") or [1] * len(starts)
    if 0 in steps:
        raise Unsupported("step 0")
    st.op("Slice", n.ins[:1], n.outs, starts=starts, ends=ends, axes=axes, steps=steps)


@_reg("Split")
def _split(st: ImportState, n: ONode) -> None:
    x = st.type(n.ins[0]).shape
    axis = _norm(int(n.attrs.get("axis", 0)), len(x))
    sizes = _ints(st, n, 1, "split")
    k = len(n.outs)
    if sizes is None:
        if "num_outputs" in n.attrs:  # opset 18: ceil-sized chunks, the last one smaller
            k = int(n.attrs["num_outputs"])
            chunk = -(-x[axis] // k)
            sizes = [chunk] * (k - 1) + [x[axis] - chunk * (k - 1)]
        else:
            if x[axis] % k:
                raise Unsupported(f"dimension {x[axis]} does not split evenly into {k}")
            sizes = [x[axis] // k] * k
    outs = [o or st.fresh(f"{n.name}_unused") for o in n.outs]
    st.op("Split", n.ins[:1], outs, axis=axis, sizes=list(sizes))


@_reg("Gather")
def _gather(st: ImportState, n: ONode) -> None:
    st.op("Gather", n.ins[:2], n.outs, axis=int(n.attrs.get("axis", 0)))


def _gather_flat(st: ImportState, n: ONode, data: str, lead: int, flat_idx: np.ndarray) -> None:
    """Gather along the first `lead` axes of data merged into one, at constant linear indices."""
    shape = st.type(data).shape
    merged = st.op("Reshape", [data], shape=(int(np.prod(shape[:lead], dtype=np.int64)),) + shape[lead:])
    st.op("Gather", [merged, st.const(flat_idx.astype(np.int64), "indices")], n.outs, axis=0)


@_reg("GatherElements")
def _gather_elements(st: ImportState, n: ONode) -> None:
    # With constant indices this is a Gather from the flattened data at precomputed positions.
    shape = st.type(n.ins[0]).shape
    axis = _norm(int(n.attrs.get("axis", 0)), len(shape))
    idx = st.const_value(n.ins[1], "indices").astype(np.int64)
    idx = np.where(idx < 0, idx + shape[axis], idx)
    coords = list(np.indices(idx.shape, dtype=np.int64))
    coords[axis] = idx
    _gather_flat(st, n, n.ins[0], len(shape), np.ravel_multi_index(tuple(coords), shape))


@_reg("GatherND")
def _gather_nd(st: ImportState, n: ONode) -> None:
    if int(n.attrs.get("batch_dims", 0)):
        raise Unsupported("batch_dims != 0")
    shape = st.type(n.ins[0]).shape
    idx = st.const_value(n.ins[1], "indices").astype(np.int64)
    k = idx.shape[-1]
    idx = np.where(idx < 0, idx + np.asarray(shape[:k]), idx)
    flat = np.ravel_multi_index(tuple(np.moveaxis(idx, -1, 0)), shape[:k]) if k else np.zeros(idx.shape[:-1], np.int64)
    _gather_flat(st, n, n.ins[0], k, np.asarray(flat))


@_reg("Expand")
def _expand(st: ImportState, n: ONode) -> None:
    shape = _ints(st, n, 1, "shape")
    out = tuple(np.broadcast_shapes(st.type(n.ins[0]).shape, tuple(shape)))
    if out == st.type(n.ins[0]).shape:
        st.alias(n.outs[0], n.ins[0])
    else:
        st.op("Expand", n.ins[:1], n.outs, shape=out)


@_reg("Tile")
def _tile(st: ImportState, n: ONode) -> None:
    x = st.type(n.ins[0]).shape
    reps = _ints(st, n, 1, "repeats")
    # Tile = insert a unit axis before each dim, broadcast it to the repeat count, merge each pair.
    y = st.op("Reshape", n.ins[:1], shape=tuple(v for d in x for v in (1, d)))
    y = st.op("Expand", [y], shape=tuple(v for r, d in zip(reps, x) for v in (r, d)))
    st.op("Reshape", [y], n.outs, shape=tuple(r * d for r, d in zip(reps, x)))


@_reg("Shape")
def _shape(st: ImportState, n: ONode) -> None:
    x = st.type(n.ins[0]).shape
    start, end = int(n.attrs.get("start", 0)), n.attrs.get("end")
    st.set_const(n.outs[0], np.asarray(x[start : end if end is None else int(end)], np.int64))


@_reg("Range")
def _range(st: ImportState, n: ONode) -> None:
    def arange(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        if c.item() == 0:
            raise Unsupported("delta 0")
        _check_size([math.ceil((b.item() - a.item()) / c.item())], "range")
        return np.arange(a.item(), b.item(), c.item(), dtype=a.dtype)

    _fold_only(n, st, arange)


@_reg("Trilu")
def _trilu(st: ImportState, n: ONode) -> None:
    k = _ints(st, n, 1, "k")
    st.op("Trilu", n.ins[:1], n.outs, upper=int(n.attrs.get("upper", 1)), k=k[0] if k else 0)


@_reg("CumSum")
def _cumsum(st: ImportState, n: ONode) -> None:
    (axis,) = _ints(st, n, 1, "axis") or [0]
    rank = len(st.type(n.ins[0]).shape)
    axis = _norm(axis, rank)
    x = n.ins[0]
    rev = dict(starts=[-1], ends=[-(2**63)], axes=[axis], steps=[-1])
    if n.attrs.get("reverse", 0):
        x = st.op("Slice", [x], **rev)
    exclusive = n.attrs.get("exclusive", 0)
    last = not exclusive and not n.attrs.get("reverse", 0)
    y = st.op("CumSum", [x], n.outs if last else None, axis=axis)
    if exclusive:  # sum of the elements strictly before: inclusive sum minus the element itself
        y = st.op("Sub", [y, x], None if n.attrs.get("reverse", 0) else n.outs)
    if n.attrs.get("reverse", 0):
        st.op("Slice", [y], n.outs, **rev)
