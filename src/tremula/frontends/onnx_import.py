"""ONNX file -> Graph: load safely, fix dynamic dims, inline functions, fold shape arithmetic, convert op by op."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner  # a submodule: not loaded by `import onnx`
from google.protobuf.message import DecodeError
from onnx import helper, numpy_helper

from tremula.errors import TremulaError, notice
from tremula.frontends.onnx_ops import CONVERTERS, MAX_OPSET, MIN_OPSET, ONode, Unsupported, malformed, np_dtype
from tremula.frontends.rebatch import CannotRebatch, FixedBatch, rebatch
from tremula.ir.graph import Constant, Graph, Node, TensorType
from tremula.ir.interp import infer_types
from tremula.ir.ops import infer, rule

# Dims with these names take --seq-len; the first dim of every input takes --batch.
_SEQ_NAME = re.compile(r"seq|length|len\b|tokens|sequence", re.IGNORECASE)
# Folding makes constants; a folded value bigger than this stays a node, so a broadcast mask cannot eat the memory.
FOLD_LIMIT_ELEMENTS = 1 << 24


class EmptyValue(TremulaError):
    """A node of the model makes a run-time value with zero elements (a Reshape or Slice to nothing)."""


class ImportState:
    """The Graph being built: value types, known constant values, aliases; emits canonical nodes or folds them.

    Every node whose inputs are all constants is evaluated at once with the reference interpreter's op rows,
    so shape arithmetic (Shape -> Gather -> Concat -> Reshape) disappears during import.
    """

    def __init__(self, opset: int):
        self.opset = opset
        self.types: dict[str, TensorType] = {}
        self.consts: dict[str, np.ndarray] = {}
        self.aliases: dict[str, str] = {}
        self.nodes: list[Node] = []
        self.node_name = ""  # the ONNX node being converted: names what it becomes
        self._count = 0
        self._labels: set[str] = set()

    # ------------------------------------------------------------------ values
    def resolve(self, name: str) -> str:
        while name in self.aliases:
            name = self.aliases[name]
        return name

    def type(self, name: str) -> TensorType:
        return self.types[self.resolve(name)]

    def value(self, name: str) -> np.ndarray | None:
        return self.consts.get(self.resolve(name))

    def const_value(self, name: str, what: str) -> np.ndarray:
        v = self.value(name)
        if v is None:
            raise Unsupported(f"{what} computed at run time")
        return v

    def fresh(self, hint: str) -> str:
        while True:
            self._count += 1
            name = f"{hint}/{self._count}"
            if name not in self.types:
                return name

    def set_const(self, name: str, array: np.ndarray) -> None:
        array = np.asarray(array, order="C")  # not ascontiguousarray: that turns a 0-d scalar into shape (1,)
        self.types[name] = TensorType(tuple(array.shape), str(array.dtype))
        self.consts[name] = array

    def const(self, array: np.ndarray, hint: str = "const") -> str:
        name = self.fresh(f"{self.node_name or 'import'}/{hint}")
        self.set_const(name, np.asarray(array))
        return name

    def alias(self, name: str, target: str) -> None:
        target = self.resolve(target)
        if name != target:
            self.aliases[name] = target

    # ------------------------------------------------------------------ emit
    def op(self, op: str, inputs: list[str], outputs: list[str] | None = None, **attrs) -> str:
        """Emit one canonical op (or fold it when every input is constant); returns its first output's name."""
        inputs = [self.resolve(i) if i else "" for i in inputs]
        while inputs and not inputs[-1]:
            inputs.pop()
        in_types = [self.types[i] if i else None for i in inputs]
        out_types = infer(op, in_types, attrs)
        outputs = outputs or [self.fresh(f"{self.node_name or op}/{op}") for _ in out_types]
        if len(outputs) != len(out_types):
            raise Unsupported(f"{len(outputs)} outputs where {op} makes {len(out_types)}")
        vals = [self.consts.get(i) if i else None for i in inputs]
        foldable = all(v is not None for i, v in zip(inputs, vals) if i)
        if foldable and sum(t.size for t in out_types) <= FOLD_LIMIT_ELEMENTS:
            results = rule(op).ref([v for v in vals], attrs)
            for o, r, t in zip(outputs, results, out_types):
                self.set_const(o, np.asarray(r).astype(t.dtype).reshape(t.shape))
            return outputs[0]
        for o, t in zip(outputs, out_types):
            if 0 in t.shape:  # a run-time value with no elements: nothing to place, every split divides by zero
                raise EmptyValue(f"value {o!r} ({op} at ONNX node {self.node_name or o!r}) would have zero "
                                 f"elements ({t}); tremula compiles tensors with at least one element")
            self.types[o] = t
        self.nodes.append(Node(op, inputs, list(outputs), dict(attrs), self._node_label(outputs[0])))
        return outputs[0]

    def _node_label(self, first_output: str) -> str:
        """The ONNX node's name, numbered when one ONNX node becomes several canonical ones."""
        base = self.node_name or first_output
        label, k = base, 1
        while label in self._labels:
            k += 1
            label = f"{base}#{k}"
        self._labels.add(label)
        return label


# -------------------------------------------------------------------------------------------------------------- loading


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def load_onnx_model(path: str | Path) -> onnx.ModelProto:
    """onnx.load with every failure turned into one line. External data goes through onnx's own loader, which
    refuses locations outside the model's folder (`../x`, absolute paths) and missing files."""
    path = Path(path)
    if not path.exists():
        raise TremulaError(f"no such ONNX file: {path}")
    if not path.is_file():
        raise TremulaError(f"{path} is not a file; give the path of the .onnx file")
    try:
        model = onnx.load(str(path))
    except DecodeError:
        raise TremulaError(f"{path} is not a valid ONNX file (truncated or corrupt protobuf); re-export it") from None
    except onnx.checker.ValidationError as e:
        raise TremulaError(f"{path}: refusing its external data: {_first_line(e)}") from None
    except (OSError, ValueError, RuntimeError) as e:
        raise TremulaError(f"{path}: cannot read the model or its external data: {_first_line(e)}") from None
    if model.ir_version <= 0 or not model.graph.output or not model.opset_import:
        raise TremulaError(f"{path} does not look like an ONNX model (no IR version, graph outputs or opset)")
    if (why := malformed(model)) is not None:  # before anything trusts its names or dims
        raise TremulaError(f"{path} is not a valid ONNX file ({why}); re-export it")
    return model


def _default_opset(model: onnx.ModelProto, path: Path) -> int:
    opsets = {o.domain: o.version for o in model.opset_import}
    opset = opsets.get("", opsets.get("ai.onnx"))
    if opset is None:
        raise TremulaError(
            f"{path} imports no default-domain opset; tremula reads ai.onnx opsets {MIN_OPSET}-{MAX_OPSET}"
        )
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise TremulaError(
            f"{path} uses ONNX opset {opset}; tremula reads opsets {MIN_OPSET}-{MAX_OPSET} "
            f"(convert with onnx.version_converter or re-export with opset {MAX_OPSET if opset > MAX_OPSET else 17})"
        )
    return opset


def _check_supported(model: onnx.ModelProto, opset: int) -> None:
    """Every (op, opset) pair tremula has no converter for, listed at once."""
    opsets = {o.domain: o.version for o in model.opset_import}
    missing: dict[str, None] = {}
    for node in model.graph.node:
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        if domain:
            missing[f"{domain}.{node.op_type} (opset {opsets.get(domain, '?')})"] = None
            continue
        try:
            since = onnx.defs.get_schema(node.op_type, max_inclusive_version=opset, domain="").since_version
        except onnx.defs.SchemaError:
            missing[f"{node.op_type} (opset {opset})"] = None
            continue
        if (node.op_type, since) not in CONVERTERS:
            missing[f"{node.op_type} (opset {opset})"] = None
    if missing:
        raise TremulaError(
            f"unsupported ONNX ops: {', '.join(missing)} — tremula converts the default-domain ops in "
            f"frontends/onnx_ops.py; export without them (e.g. torch.onnx.export without custom/contrib ops)"
        )


def _initializer_names(model: onnx.ModelProto) -> set[str]:
    return {t.name for t in model.graph.initializer}


def _is_token_dim(inp: onnx.ValueInfoProto, k: int) -> bool:
    """Dim 1 of a [batch, tokens] integer input (ids, masks): the sequence, whatever the exporter named it."""
    tt = inp.type.tensor_type
    return k == 1 and len(tt.shape.dim) == 2 and tt.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


def fix_input_dims(model: onnx.ModelProto, batch: int, seq_len: int | None) -> int:
    """Give every dynamic input dim a value: the first dim <- batch, a sequence-like name <- seq_len.

    A symbol resolved once (e.g. `s0` as dim 0) takes the same value wherever else it appears. Returns how many dims
    took seq_len.
    """
    inits = _initializer_names(model)
    inputs = [i for i in model.graph.input if i.name not in inits]
    symbols: dict[str, int] = {}
    for inp in inputs:
        dims = inp.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_value") and dims[0].dim_param:
            symbols.setdefault(dims[0].dim_param, batch)
    unresolved: list[str] = []
    took_seq = 0
    for inp in inputs:
        if not inp.type.HasField("tensor_type"):
            raise TremulaError(f"model input {inp.name!r} is not a tensor; tremula imports tensor inputs only")
        for k, dim in enumerate(inp.type.tensor_type.shape.dim):
            if dim.HasField("dim_value"):
                continue
            sym = dim.dim_param
            if sym in symbols:
                value = symbols[sym]
            elif k == 0:
                value = batch
            elif seq_len is not None and (sym and _SEQ_NAME.search(sym) or _is_token_dim(inp, k)):
                value = seq_len
                took_seq += 1
            else:
                unresolved.append(f"{inp.name}[{k}]" + (f" ({sym})" if sym else ""))
                continue
            if sym:
                symbols[sym] = value
            dim.Clear()
            dim.dim_value = value
    if unresolved:
        hint = "set --seq-len" if seq_len is None else "re-export the model with static shapes for these dims"
        raise TremulaError(f"dynamic input dims with no value: {', '.join(unresolved)}; {hint}")
    return took_seq


def _inference_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its big weights replaced by typed graph inputs, for shape inference: it serialises the whole
    model, which would copy every weight (and fail past protobuf's 2 GiB)."""
    m = onnx.ModelProto()
    _copy_without_weights(model, m)
    del m.graph.value_info[:]
    for out in m.graph.output:  # exporters write symbolic output dims; let inference fill in the fixed ones
        out.type.tensor_type.ClearField("shape")
    return m


def _copy_without_weights(model: onnx.ModelProto, m: onnx.ModelProto) -> None:
    m.ir_version = model.ir_version
    m.opset_import.extend(model.opset_import)
    g = m.graph
    g.name = model.graph.name
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    existing = {i.name for i in model.graph.input}
    for t in model.graph.initializer:
        if len(t.dims) and int(np.prod(t.dims)) > 1024:
            if t.name not in existing:
                g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            g.initializer.append(t)


def _exporter_flags(first_input: str, axis: int, label: str) -> str:
    return (f"re-export with a dynamic {label}: dynamic_axes={{{first_input!r}: {{{axis}: {label!r}}}}} in "
            "torch.onnx.export (legacy exporter), or dynamic_shapes= with dynamo=True")


def fixed_dims(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """The dims an exporter wrote as numbers: (input -> its fixed first dim, only when no input leaves its first dim
    dynamic; "input[1]" -> the fixed token dim of each [batch, tokens] integer input)."""
    inits = _initializer_names(model)
    batch: dict[str, int] = {}
    seq: dict[str, int] = {}
    dynamic = False
    for inp in model.graph.input:
        if inp.name in inits or not inp.type.HasField("tensor_type"):
            continue
        dims = inp.type.tensor_type.shape.dim
        if not dims:
            continue
        if dims[0].HasField("dim_value"):
            batch[inp.name] = dims[0].dim_value
        else:
            dynamic = True
        if _is_token_dim(inp, 1) and dims[1].HasField("dim_value"):
            seq[f"{inp.name}[1]"] = dims[1].dim_value
    return ({} if dynamic else batch), seq


def own_batch(fixed: dict[str, int]) -> int | None:
    """The one batch the fixed first dims agree on (None when there are none or they disagree)."""
    values = set(fixed.values())
    return values.pop() if len(values) == 1 else None


def fixed_batch(path: str | Path) -> int | None:
    """The batch an ONNX file fixes, read from its inputs only (None when dynamic or unreadable: the import says
    why)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - any failure is reported by the real import
        return None
    return own_batch(fixed_dims(model)[0])


def _inferred_types(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...], int]]:
    try:
        inferred = onnx.shape_inference.infer_shapes(_inference_copy(model), strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError, ValueError) as e:
        raise TremulaError(f"ONNX shape inference rejects the model: {_first_line(e)}") from None
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out[vi.name] = (tuple(d.dim_value for d in tt.shape.dim), tt.elem_type)
    return out


# ----------------------------------------------------------------------------------------------------------- converting


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            raise Unsupported("subgraph attributes")
        out[a.name] = helper.get_attribute_value(a)
        if isinstance(out[a.name], bytes):
            out[a.name] = out[a.name].decode()
    return out


def _convert(model: onnx.ModelProto, opset: int, inits: set[str]) -> ImportState:
    """Convert node by node. The model's initializers move into the state (the proto is emptied of them, so a big
    model's weights are held once)."""
    st = ImportState(opset)
    problems: dict[str, None] = {}
    for t in model.graph.initializer:
        try:
            st.set_const(t.name, numpy_helper.to_array(t))
        except TremulaError as e:
            raise TremulaError(f"initializer {t.name!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a corrupt tensor can fail in many ways inside onnx
            raise TremulaError(f"initializer {t.name!r} cannot be read: {_first_line(e)}") from None
    model.graph.ClearField("initializer")
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        if not tt.HasField("shape"):
            raise TremulaError(f"model input {inp.name!r} has no shape (not even a rank); re-export with shapes")
        try:
            st.types[inp.name] = TensorType(tuple(d.dim_value for d in tt.shape.dim), np_dtype(tt.elem_type))
        except Unsupported as e:
            raise TremulaError(f"model input {inp.name!r}: {e}") from None
    poisoned: set[str] = set()  # values downstream of a node that could not be converted
    for node in model.graph.node:
        since = onnx.defs.get_schema(node.op_type, max_inclusive_version=opset, domain="").since_version
        if any(i in poisoned for i in node.input):
            poisoned.update(node.output)
            continue
        st.node_name = node.name or (node.output[0] if node.output else node.op_type)
        try:
            onode = ONode(
                node.op_type,
                since,
                [st.resolve(i) if i else "" for i in node.input],
                list(node.output),
                _attrs(node),
                st.node_name,
            )
            CONVERTERS[(node.op_type, since)](st, onode)
        except EmptyValue:
            raise
        except (Unsupported, TremulaError) as e:
            problems[f"{node.op_type} (opset {opset}) at {st.node_name}: {e}"] = None
            poisoned.update(node.output)
        except (KeyError, IndexError, ValueError, TypeError) as e:  # a node missing an attribute or input
            problems[f"{node.op_type} (opset {opset}) at {st.node_name}: malformed ({type(e).__name__}: {e})"] = None
            poisoned.update(node.output)
    if problems:
        raise TremulaError(f"cannot import {len(problems)} ONNX node(s): {'; '.join(problems)}")
    return st


def _finish(st: ImportState, name: str, inputs: list[str], outputs: list[str]) -> Graph:
    nodes = st.nodes
    types = {i: st.types[i] for i in inputs}
    out_names = []
    for o in outputs:
        src = st.resolve(o)
        if src != o and src not in st.consts:  # an output reached through Identity keeps its public name
            nodes.append(Node("Identity", [src], [o], {}, o))
            st.types[o] = st.types[src]
        elif src != o:
            st.set_const(o, st.consts[src])
        out_names.append(o)
    # Drop nodes no output depends on (an exported pooler nobody asked for, an unused mask branch).
    live, kept = set(out_names), []
    for n in reversed(nodes):
        if live.intersection(n.outputs):
            kept.append(n)
            live.update(i for i in n.inputs if i)
    nodes = kept[::-1]
    used = {i for n in nodes for i in n.inputs if i} | set(out_names)
    constants = {c: Constant.of(c, st.consts[c]) for c in st.consts if c in used}
    types.update({c: k.type for c, k in constants.items()})
    for n in nodes:
        types.update({o: st.types[o] for o in n.outputs})
    g = Graph(name, list(inputs), out_names, nodes, constants, types)
    return infer_types(g)  # the op rows agree with what was emitted, in topological order


def _cross_check(g: Graph, inferred: dict[str, tuple[tuple[int, ...], int]]) -> None:
    """ONNX's own shape inference and the op rows must agree on every value both know: a converter bug shows here."""
    for name, (shape, elem) in inferred.items():
        t = g.types.get(name)
        if t is None:
            continue
        try:
            dtype = np_dtype(elem)
        except Unsupported:
            dtype = "?"
        if t.shape != shape or t.dtype != dtype:
            raise TremulaError(f"internal import error: {name} is {t} here but ONNX infers {dtype}{list(shape)}")


def import_onnx(path: str | Path, batch: int | None = None, seq_len: int | None = None) -> Graph:
    """Read an ONNX model (default-domain opsets 13-21) into a Graph with static shapes and canonical ops.

    batch=None is the model's own batch when its inputs fix one, else 1. A model exported with a fixed batch is
    imported at that batch and rebatched (frontends/rebatch.py) when another is asked, or refused (FixedBatch) when
    some op ties it to its batch; a fixed sequence length is never changed: another --seq-len is refused.
    """
    path = Path(path)
    if (batch is not None and batch < 1) or (seq_len is not None and seq_len < 1):
        raise TremulaError(f"batch ({batch}) and seq_len ({seq_len}) must be positive")
    model = load_onnx_model(path)
    opset = _default_opset(model, path)
    if model.functions:
        try:
            model = onnx.inliner.inline_local_functions(model)
        except Exception as e:  # noqa: BLE001 - the inliner reports malformed functions with several exception types
            raise TremulaError(f"{path}: cannot inline its local functions: {_first_line(e)}") from None
    _check_supported(model, opset)
    fixed, fixed_seq = fixed_dims(model)
    own = own_batch(fixed)
    dims = ", ".join(f"{k}[0] = {v}" for k, v in fixed.items())
    if batch is not None and fixed and own is None:
        raise TremulaError(f"{path.name}: its inputs fix different first dims ({dims}), so it has no one batch to "
                           "change; leave --batch out")
    wrong = {k: v for k, v in fixed_seq.items() if seq_len is not None and v != seq_len}
    if wrong:
        first = next(iter(wrong)).split("[")[0]
        raise TremulaError(f"{path.name} was exported with a fixed sequence length "
                           f"({', '.join(f'{k} = {v}' for k, v in wrong.items())}); tremula does not change it, so "
                           f"--seq-len {seq_len} cannot apply: leave --seq-len out or "
                           f"{_exporter_flags(first, 1, 'sequence')}")
    took_seq = fix_input_dims(model, own or (1 if batch is None else batch), seq_len)
    if seq_len is not None and not took_seq and not fixed_seq:
        notice(f"--seq-len {seq_len} changes nothing in {path.name}: none of its inputs has a sequence dim")
    inits = _initializer_names(model)
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    _refuse_empty_inputs(model, inits)
    inferred = _inferred_types(model)
    outputs = [o.name for o in model.graph.output]
    st = _convert(model, opset, inits)
    graph = _finish(st, model.graph.name or path.stem, inputs, outputs)
    _cross_check(graph, inferred)
    if own is not None and batch is not None and batch != own:
        try:
            graph = rebatch(graph, batch)
        except CannotRebatch as e:
            raise FixedBatch(f"{path.name} was exported with a fixed batch of {own} ({dims}) and cannot be "
                             f"rebatched to {batch}: {e}. Use --batch {own} (or leave --batch out), or "
                             f"{_exporter_flags(inputs[0], 0, 'batch')}") from None
        # Said once per run: the text does not name the batch, which a batch search changes at every probe.
        notice(f"{path.name} was exported with a fixed batch of {own} ({dims}); tremula rewrote its batch dim "
               "(every op allows it)")
    return graph


def _refuse_empty_inputs(model: onnx.ModelProto, inits: set[str]) -> None:
    """Zero-size dims give values with nothing to place or divide among tiles: refused at the input naming it."""
    for inp in model.graph.input:
        dims = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        if inp.name not in inits and 0 in dims:
            raise TremulaError(f"model input {inp.name!r} has a zero-size dim (shape {dims}); tremula compiles "
                               "tensors with at least one element: give every dim a positive size")
