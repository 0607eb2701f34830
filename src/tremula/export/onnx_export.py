"""Graph -> ONNX: every canonical op becomes standard ONNX ops, so onnxruntime can check the reference interpreter."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tremula.errors import TremulaError
from tremula.ir.graph import Graph, Node, TensorType
from tremula.ir.ops import OPS, transpose_perm
from tremula.numerics.fp8 import is_fp8

MIN_OPSET, MAX_OPSET = 17, 21  # 17: first with LayerNormalization; 21: newest the importer also reads
INT64_MIN = np.iinfo(np.int64).min


def onnx_dtype(dtype: str) -> int:
    """The ONNX element type of a Graph dtype; FP8 tensors are exported as their uint8 codes (_codes)."""
    return onnx.TensorProto.UINT8 if is_fp8(dtype) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


class _Emitter:
    """Collects ONNX nodes and initializers, handing out value names that cannot clash with the Graph's."""

    def __init__(self, graph: Graph, opset: int):
        self.graph = graph
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.used: set[str] = set(graph.types) | set(graph.constants)
        self.count = 0

    def fresh(self, hint: str) -> str:
        while True:
            self.count += 1
            name = f"{hint}__{self.count}"
            if name not in self.used:
                self.used.add(name)
                return name

    def const(self, array: np.ndarray, hint: str = "c") -> str:
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def ints(self, values, hint: str = "ints") -> str:
        return self.const(np.asarray(list(values), dtype=np.int64), hint)

    def scalar(self, value: float, dtype: str, hint: str = "s") -> str:
        return self.const(np.asarray(value, dtype=dtype), hint)

    def op(self, op_type: str, inputs: list[str], outputs: list[str] | None = None, n_out: int = 1, **attrs) -> str:
        """Emit one ONNX node; returns its (first) output name, made fresh unless `outputs` is given."""
        outs = outputs if outputs is not None else [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh(f"n_{op_type}"), **attrs))
        return outs[0]


@dataclass
class _Ctx:
    """One canonical node being converted: its input/output names and types (types may be float32 stand-ins)."""

    em: _Emitter
    node: Node
    ins: list[str]  # "" = omitted optional input
    outs: list[str]
    in_types: list[TensorType | None]
    out_types: list[TensorType]

    @property
    def a(self) -> dict:
        return self.node.attrs

    def has(self, i: int) -> bool:
        return len(self.ins) > i and bool(self.ins[i])


Converter = Callable[[_Ctx], None]
CONVERTERS: dict[str, Converter] = {}


def _conv(*names: str):
    def deco(fn: Converter) -> Converter:
        for n in names:
            CONVERTERS[n] = fn
        return fn

    return deco


# ------------------------------------------------------------------------------------------------------- one-to-one ops


@_conv(*(name for name, d in OPS.items() if d.export == "direct"))  # (each op's row says so: ir/ops.py)
def _direct(c: _Ctx) -> None:
    c.em.op(c.node.op, c.ins, c.outs)  # (ONNX's integer Div truncates toward zero, as the reference row does)


@_conv("Mod")
def _mod(c: _Ctx) -> None:
    c.em.op("Mod", c.ins, c.outs, fmod=1)  # the reference is np.fmod: the sign follows the dividend


@_conv("Cast")
def _cast(c: _Ctx) -> None:
    c.em.op("Cast", c.ins, c.outs, to=onnx_dtype(c.a["to"]))


@_conv("Softmax")
def _softmax(c: _Ctx) -> None:
    c.em.op("Softmax", c.ins, c.outs, axis=int(c.a.get("axis", -1)))


@_conv("Concat")
def _concat(c: _Ctx) -> None:
    c.em.op("Concat", c.ins, c.outs, axis=int(c.a["axis"]))


@_conv("Gather")
def _gather(c: _Ctx) -> None:
    c.em.op("Gather", c.ins, c.outs, axis=int(c.a.get("axis", 0)))


@_conv("Transpose")
def _transpose(c: _Ctx) -> None:
    c.em.op("Transpose", c.ins, c.outs, perm=list(transpose_perm(c.a, len(c.in_types[0].shape))))


@_conv("Shape")
def _shape(c: _Ctx) -> None:
    attrs = {"start": int(c.a.get("start", 0))}
    if c.a.get("end") is not None:
        attrs["end"] = int(c.a["end"])
    c.em.op("Shape", c.ins, c.outs, **attrs)


@_conv("Range")
def _range(c: _Ctx) -> None:
    c.em.op("Range", c.ins, c.outs)


@_conv("Trilu")
def _trilu(c: _Ctx) -> None:
    k = c.em.const(np.asarray(int(c.a.get("k", 0)), np.int64), "k")
    c.em.op("Trilu", [c.ins[0], k], c.outs, upper=int(c.a.get("upper", 1)))


@_conv("CumSum")
def _cumsum(c: _Ctx) -> None:
    axis = c.em.const(np.asarray(int(c.a["axis"]), np.int64), "axis")
    c.em.op("CumSum", [c.ins[0], axis], c.outs)


# ----------------------------------------------------------------------------------------------- static attrs -> inputs


@_conv("Reshape")
def _reshape(c: _Ctx) -> None:
    shape = c.out_types[0].shape
    # The output type is fully static, so write it out: no 0/-1 placeholders. allowzero keeps a real 0 a 0.
    attrs = {"allowzero": 1} if 0 in shape else {}
    c.em.op("Reshape", [c.ins[0], c.em.ints(shape, "shape")], c.outs, **attrs)


@_conv("Expand")
def _expand(c: _Ctx) -> None:
    c.em.op("Expand", [c.ins[0], c.em.ints(c.out_types[0].shape, "shape")], c.outs)


def slice_bounds(shape: tuple[int, ...], a: dict) -> tuple[list[int], list[int], list[int], list[int]]:
    """Normalised ONNX Slice inputs (starts, ends, axes, steps) equal to the canonical op's Python-slice semantics."""
    steps = a.get("steps") or [1] * len(a["axes"])
    starts, ends, axes, out_steps = [], [], [], []
    for st, en, ax, sp in zip(a["starts"], a["ends"], a["axes"], steps):
        ax = int(ax) % len(shape)
        start, stop, step = slice(int(st), int(en), int(sp)).indices(shape[ax])
        if stop < 0:  # Python's "before index 0" for a negative step; ONNX reads -1 as "last", so say INT64_MIN
            stop = int(INT64_MIN)
        starts.append(start), ends.append(stop), axes.append(ax), out_steps.append(step)
    return starts, ends, axes, out_steps


@_conv("Slice")
def _slice(c: _Ctx) -> None:
    starts, ends, axes, steps = slice_bounds(c.in_types[0].shape, c.a)
    em = c.em
    em.op(
        "Slice",
        [c.ins[0], em.ints(starts, "starts"), em.ints(ends, "ends"), em.ints(axes, "axes"), em.ints(steps, "steps")],
        c.outs,
    )


@_conv("Split")
def _split(c: _Ctx) -> None:
    c.em.op("Split", [c.ins[0], c.em.ints(c.a["sizes"], "split")], c.outs, axis=int(c.a["axis"]))


@_conv("ReduceMean", "ReduceSum", "ReduceMax")
def _reduce(c: _Ctx) -> None:
    keepdims = int(c.a.get("keepdims", 1))
    axes = c.a.get("axes")
    # ReduceSum takes axes as an input from opset 13, the others from opset 18; before that it is an attribute.
    as_input = c.node.op == "ReduceSum" or c.em.opset >= 18
    if axes is None:
        c.em.op(c.node.op, c.ins, c.outs, keepdims=keepdims)
    elif as_input:
        c.em.op(c.node.op, [c.ins[0], c.em.ints(axes, "axes")], c.outs, keepdims=keepdims)
    else:
        c.em.op(c.node.op, c.ins, c.outs, keepdims=keepdims, axes=[int(x) for x in axes])


@_conv("Conv")
def _conv_op(c: _Ctx) -> None:
    w = c.in_types[1].shape
    ins = [i for i in c.ins if i]
    c.em.op(
        "Conv",
        ins,
        c.outs,
        kernel_shape=[int(w[2]), int(w[3])],
        strides=[int(s) for s in c.a.get("strides", (1, 1))],
        dilations=[int(d) for d in c.a.get("dilations", (1, 1))],
        pads=[int(p) for p in c.a.get("pads", (0, 0, 0, 0))],
        group=int(c.a.get("group", 1)),
    )


# -------------------------------------------------------------------------------------------------- fused ops decompose


@_conv("Linear")
def _linear(c: _Ctx) -> None:
    if c.has(2):
        y = c.em.op("MatMul", c.ins[:2])
        c.em.op("Add", [y, c.ins[2]], c.outs)
    else:
        c.em.op("MatMul", c.ins[:2], c.outs)


@_conv("LayerNorm")
def _layernorm(c: _Ctx) -> None:
    ins = [i for i in c.ins if i]
    c.em.op("LayerNormalization", ins, c.outs, axis=-1, epsilon=float(c.a.get("epsilon", 1e-5)))


@_conv("Gelu")
def _gelu(c: _Ctx) -> None:
    em, x, dt = c.em, c.ins[0], c.in_types[0].dtype
    if c.a.get("approximate", "none") == "tanh":
        x3 = em.op("Mul", [em.op("Mul", [x, x]), x])
        inner = em.op("Add", [x, em.op("Mul", [x3, em.scalar(0.044715, dt)])])
        t = em.op("Tanh", [em.op("Mul", [inner, em.scalar(math.sqrt(2.0 / math.pi), dt)])])
    else:
        t = em.op("Erf", [em.op("Div", [x, em.scalar(math.sqrt(2.0), dt)])])
    one_plus = em.op("Add", [t, em.scalar(1.0, dt)])
    em.op("Mul", [em.op("Mul", [x, one_plus]), em.scalar(0.5, dt)], c.outs)


@_conv("Attention")
def _attention(c: _Ctx) -> None:
    em, dt = c.em, c.in_types[0].dtype
    q, k, v = c.ins[:3]
    rank = len(c.in_types[0].shape)
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    s = em.op("MatMul", [q, em.op("Transpose", [k], perm=perm)])
    s = em.op("Mul", [s, em.scalar(float(c.a["scale"]), dt)])
    if c.has(3):
        mask = c.ins[3]
        if c.in_types[3].dtype != dt:
            mask = em.op("Cast", [mask], to=onnx_dtype(dt))
        s = em.op("Add", [s, mask])
    if c.a.get("causal", 0):
        sq, sk = c.in_types[0].shape[-2], c.in_types[1].shape[-2]
        allowed = em.const(np.tril(np.ones((sq, sk), bool), k=sk - sq), "causal")
        s = em.op("Where", [allowed, s, em.scalar(-np.inf, dt)])
    p = em.op("Softmax", [s], axis=-1)
    em.op("MatMul", [p, v], c.outs)


@_conv("Patchify")
def _patchify(c: _Ctx) -> None:
    em, x = c.em, c.ins[0]
    b, ch, h, w = c.in_types[0].shape
    ph, pw = (int(p) for p in c.a["patch"])
    gh, gw = h // ph, w // pw
    if (gh * ph, gw * pw) != (h, w):  # drop the pixels past the last whole patch, as Conv does
        x = em.op("Slice", [x, em.ints([0, 0]), em.ints([gh * ph, gw * pw]), em.ints([2, 3])])
    x = em.op("Reshape", [x, em.ints([b, ch, gh, ph, gw, pw], "shape")])
    x = em.op("Transpose", [x], perm=[0, 2, 4, 1, 3, 5])
    em.op("Reshape", [x, em.ints([b, gh * gw, ch * ph * pw], "shape")], c.outs)


# --------------------------------------------------------------------------------------------------------------- driver

# Ops whose reference computes float16 in float32 (or wider): exported in float32 between casts, to match it.
_WIDEN_F16 = {name for name, d in OPS.items() if d.widen_f16}


@_conv("Fp8Cast")
def _fp8_cast(c: _Ctx) -> None:
    # QuantizeLinear/DequantizeLinear with an FNUZ zero point (opset >= 19) saturate like the IPU. ONNX rounds
    # float32 straight to FP8 while the IPU goes through half; the two agree whenever the input is a half value.
    from tremula.numerics.fp8 import Fp8Format, scale_for_max_abs

    fmt = Fp8Format.parse(c.a["fmt"])
    scale = c.a.get("scale")
    if scale is None:
        src = c.em.graph.constants.get(c.ins[0])
        if src is None:
            raise TremulaError("Fp8Cast without a scale can only be exported on a constant")
        scale = scale_for_max_abs(float(np.max(np.abs(src.value()), initial=0.0)), fmt)
    q, s = _quantize_fp8(c, fmt, int(scale))
    c.em.op("DequantizeLinear", [q, s], c.outs)


def _quantize_fp8(c: _Ctx, fmt, scale: int) -> tuple[str, str]:
    """QuantizeLinear of the node's input to the format's FNUZ FP8 type at 2**scale, saturating like the IPU:
    (FP8 tensor, scale constant). FP8 types need opset 19."""
    from tremula.numerics.fp8 import Fp8Format

    em = c.em
    if em.opset < 19:
        raise TremulaError(f"exporting {c.node.op} needs ONNX opset >= 19 (export_onnx(graph, opset=19))")
    zero_type = onnx.TensorProto.FLOAT8E4M3FNUZ if fmt is Fp8Format.F143 else onnx.TensorProto.FLOAT8E5M2FNUZ
    s = em.const(np.array(2.0 ** scale, np.float32))
    z = em.fresh("fp8_zero")
    em.inits.append(helper.make_tensor(z, zero_type, [], [0.0]))
    return em.op("QuantizeLinear", [c.ins[0], s, z], saturate=1), s


def _fp8_table(em, fmt) -> str:
    """float32[256]: the value of every code at scale 0 (the NaN code's entry is NaN)."""
    return em.const(np.arange(256, dtype=np.uint8).view(fmt.np_dtype).astype(np.float32), "fp8_table")


@_conv("Fp8Quantize")
def _fp8_quantize(c: _Ctx) -> None:
    # ONNX has no bit cast from an FP8 tensor to its byte: quantise and dequantise at scale 0, then find the code
    # whose value that is (each fnuz value has exactly one code).
    from tremula.numerics.fp8 import Fp8Format

    if c.a.get("rounding", "nearest") != "nearest":
        raise TremulaError("Fp8Quantize with stochastic rounding has no ONNX form")
    em, fmt = c.em, Fp8Format.parse(c.a["fmt"])
    q, _ = _quantize_fp8(c, fmt, int(c.a["scale"]))
    v = em.op("DequantizeLinear", [q, em.const(np.array(1.0, np.float32))])
    hit = em.op("Equal", [em.op("Unsqueeze", [v, em.ints([-1])]), _fp8_table(em, fmt)])
    code = em.op("ArgMax", [em.op("Cast", [hit], to=onnx.TensorProto.FLOAT)], axis=-1, keepdims=0)
    em.op("Cast", [code], c.outs, to=onnx.TensorProto.UINT8)


@_conv("LinearFp8")
def _linear_fp8(c: _Ctx) -> None:
    # Decode both code tensors (uint8 in the export, see _codes) by table lookup and apply the scales; ONNX's float32
    # MatMul then matches the AMP's half partials whenever no partial needs rounding (the tests choose such values).
    from tremula.numerics.fp8 import fp8_format

    em = c.em
    x_fmt, w_fmt = (fp8_format(em.graph.types[v].dtype) for v in c.node.inputs[:2])
    x = em.op("Gather", [_fp8_table(em, x_fmt),
                         em.op("Cast", [c.ins[0]], to=onnx.TensorProto.INT64)])
    x = em.op("Mul", [x, em.const(np.array(2.0 ** int(c.a["x_scale"]), np.float32))])
    w = em.op("Gather", [_fp8_table(em, w_fmt),
                         em.op("Cast", [c.ins[1]], to=onnx.TensorProto.INT64)])
    ws = em.op("Pow", [em.const(np.array(2.0, np.float32)), em.op("Cast", [c.ins[2]], to=onnx.TensorProto.FLOAT)])
    y = em.op("MatMul", [x, em.op("Mul", [w, ws])])
    if c.has(3):
        y = em.op("Add", [y, c.ins[3]])
    em.op("Cast", [y], c.outs, to=onnx_dtype(c.out_types[0].dtype))  # float16, or float32 inside a widened node


def _f32(t: TensorType | None) -> TensorType | None:
    return TensorType(t.shape, "float32") if t is not None and t.dtype == "float16" else t


def _emit(em: _Emitter, node: Node) -> None:
    g = em.graph
    try:
        conv = CONVERTERS[node.op]
    except KeyError:
        raise TremulaError(
            f"cannot export op {node.op!r} to ONNX (no converter); add one in export/onnx_export.py"
        ) from None
    in_types = [g.types[i] if i else None for i in node.inputs]
    out_types = [g.types[o] for o in node.outputs]
    if node.op in _WIDEN_F16 and any(t is not None and t.dtype == "float16" for t in in_types):
        ins = [
            em.op("Cast", [i], to=onnx.TensorProto.FLOAT) if t is not None and t.dtype == "float16" else i
            for i, t in zip(node.inputs, in_types)
        ]
        outs = [em.fresh(o) if t.dtype == "float16" else o for o, t in zip(node.outputs, out_types)]
        conv(_Ctx(em, node, ins, outs, [_f32(t) for t in in_types], [_f32(t) for t in out_types]))  # type: ignore
        for tmp, o, t in zip(outs, node.outputs, out_types):
            if tmp != o:
                em.op("Cast", [tmp], [o], to=onnx.TensorProto.FLOAT16)
        return
    conv(_Ctx(em, node, list(node.inputs), list(node.outputs), in_types, out_types))


def _codes(data: np.ndarray) -> np.ndarray:
    """FP8 data as its code bytes: the export keeps FP8 tensors as uint8 codes, which every ONNX runtime reads and
    the FP8 ops above decode by table (ONNX's FP8 types have no bit cast to their byte)."""
    return data.view(np.uint8) if is_fp8(data.dtype) else data


def _value_info(name: str, t: TensorType) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, onnx_dtype(t.dtype), list(t.shape))


def export_onnx(graph: Graph, opset: int = 17) -> onnx.ModelProto:
    """The Graph as a standalone ONNX model (default domain, `opset`), lazy constants materialised as initializers.

    The Graph is not changed: lazy constants are made for the export and not cached in it.
    """
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise TremulaError(f"ONNX export supports opsets {MIN_OPSET}..{MAX_OPSET}, not {opset}")
    em = _Emitter(graph, opset)
    for node in graph.nodes:
        _emit(em, node)
    used = {i for n in graph.nodes for i in n.inputs if i} | set(graph.outputs)
    inits = []
    for name, c in graph.constants.items():
        if name in used and name not in graph.inputs:
            data = c.data if c.data is not None else c.init.make(c.type)  # type: ignore[union-attr]
            inits.append(numpy_helper.from_array(_codes(np.asarray(data)), name))
    onnx_graph = helper.make_graph(
        em.nodes,
        graph.name or "tremula",
        [_value_info(n, graph.types[n]) for n in graph.inputs],
        [_value_info(n, graph.types[n]) for n in graph.outputs],
        initializer=inits + em.inits,
    )
    model = helper.make_model(onnx_graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="tremula")
    # IR version 8 is what onnxruntime releases from 1.14 on read; newer onnx would stamp a newer one.
    model.ir_version = 8 if opset <= 18 else 9 if opset <= 20 else 10
    return model


# Protobuf cannot serialise a message over 2 GiB; bigger models keep their weights in a side file.
_INLINE_LIMIT_BYTES = 1 << 30


def save_onnx(graph: Graph, path: str | Path, opset: int = 17) -> Path:
    """Write the Graph as an .onnx file; weights go to `<name>.data` beside it when the model is large."""
    path = Path(path)
    model = export_onnx(graph, opset)
    if graph.param_bytes() > _INLINE_LIMIT_BYTES:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))
    return path
