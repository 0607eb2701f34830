"""Precision policy: which tensors become FP8 (Fp8Cast round trips, the QDQ form) and the calibration of their scales.

The policy for `--dtype fp8` (PopRT's default FP8 path too): the two operands of every Linear are FP8 — weights in
format `weight_fmt` with a scale from their own max-abs, activations in `act_fmt` with a scale calibrated on a batch of
inputs — and everything else runs in FP16. Attention's two matmuls stay in FP16: their operands are activations whose
range changes with every input, and softmax is sensitive to their error. The planner recognises
Linear(Fp8Cast(x), Fp8Cast(W)) and stores both operands as one-byte codes for the C600's FP8 AMP path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from tremula.beside import usable_cores
from tremula.errors import TremulaError
from tremula.ir.blocked import BlockedMatmuls
from tremula.ir.graph import Constant, DerivedInit, Graph, LazyInit, Node, TensorType
from tremula.ir.interp import infer_types, run
from tremula.numerics.fp8 import Fp8Format, max_abs, quantize, scale_for_max_abs


@dataclass(frozen=True)
class Fp8Policy:
    act_fmt: Fp8Format = Fp8Format.F143
    weight_fmt: Fp8Format = Fp8Format.F143
    rounding: str = "nearest"  # or "stochastic" (seeded per cast)

    @staticmethod
    def parse(spec: str) -> Fp8Policy:
        """'F143,F143' (activation format, weight format), as PopRT's fp8_params spells them."""
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if len(parts) != 2:
            raise TremulaError(f"FP8 formats {spec!r}: give two, activation and weight, e.g. F143,F143")
        return Fp8Policy(Fp8Format.parse(parts[0]), Fp8Format.parse(parts[1]))


def fp8_linear_casts(graph: Graph, policy: Fp8Policy = Fp8Policy()) -> Graph:
    """Every Linear of an activation and a constant weight reads both through Fp8Cast.

    Weight casts carry scale=None (taken from the weight's max-abs when its values exist, so lazy weights stay lazy);
    activation casts carry scale=None until `calibrate_fp8` fills them in. Linears that read the same activation (Q, K
    and V) share one cast, so the planner quantises it once.
    """
    g = graph.copy()
    nodes: list[Node] = []
    act_cast: dict[str, str] = {}
    for n in g.nodes:
        if n.op == "Linear" and n.inputs[1] in g.constants and n.inputs[0] not in g.constants:
            x, w = n.inputs[0], n.inputs[1]
            if x not in act_cast:
                act_cast[x] = xq = g.fresh_name(f"{x}.fp8")
                g.types[xq] = g.types[x]
                seed = len(act_cast)  # a distinct, stable stream per cast for stochastic rounding
                nodes.append(Node("Fp8Cast", [x], [xq], {"fmt": policy.act_fmt.value, "scale": None,
                                                         "rounding": policy.rounding, "seed": seed}, f"{n.name}.x_fp8"))
            wq = g.fresh_name(f"{w}.fp8")
            g.types[wq] = g.types[w]
            nodes.append(Node("Fp8Cast", [w], [wq], {"fmt": policy.weight_fmt.value, "scale": None,
                                                     "rounding": "nearest"}, f"{n.name}.w_fp8"))
            n = Node(n.op, [act_cast[x], wq] + n.inputs[2:], n.outputs, dict(n.attrs), n.name)
        nodes.append(n)
    g.nodes = nodes
    return infer_types(g)


def activation_casts(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "Fp8Cast" and n.inputs[0] not in graph.constants]


def calibration_scales(graph: Graph, feeds: dict[str, np.ndarray],
                       threads: Callable[[], int] | None = None) -> dict[str, int]:
    """Each activation cast's scale (by node name) from the max-abs its input reaches on the calibration inputs.

    The calibration runs the graph as it is (casts before this one already quantising), so each scale sees the
    values it will see at inference. Its matmuls give the same values on any number of threads (ir/blocked.py: BLAS
    held to one thread, row blocks spread over `threads()` threads, all usable cores when None), so the scales do not
    change with the machine's load or its cores.
    """
    casts = activation_casts(graph)
    if not casts:
        return {}
    top: dict[str, float] = {n.inputs[0]: 0.0 for n in casts}

    def seen(name: str, value: np.ndarray) -> None:  # each input's max-abs as it is made (not kept to the end)
        if name in top:
            top[name] = max(top[name], max_abs(value))

    matmuls = BlockedMatmuls(threads or usable_cores)
    weights = _Prefetch(graph, threads or usable_cores)
    try:
        with threadpool_limits(1, user_api="blas"):  # (only BLAS: the compiled element-wise kernels keep theirs)
            run(graph, feeds, override=matmuls, observe=seen)
    finally:
        weights.close()
        matmuls.close()
    return {n.name: scale_for_max_abs(top[n.inputs[0]], Fp8Format.parse(n.attrs["fmt"])) for n in casts}


class _Prefetch:
    """The graph's seeded weights made ahead of the calibration's interpreter, in the order it reads them, on a thread
    of their own while threads() allows two or more: drawing SigLIP so400m's 428 M seeded values takes 8.4 s on one
    core, and the interpreter's element-wise ops (its Gelus and FP8 casts, 4 s) leave the second core idle. Each
    constant's values are what the interpreter would make (seeded: the same bits on any thread); while threads()
    is 1 (the planner beside holds the other core), it waits, and the interpreter makes them as it reads them."""

    def __init__(self, graph: Graph, threads: Callable[[], int]):
        order: dict[str, Constant] = {}
        for node in graph.nodes:
            for i in node.inputs:
                c = graph.constants.get(i)
                if c is not None and isinstance(c.init, LazyInit):
                    order.setdefault(i, c)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(list(order.values()), threads),
                                        name="tremula-weights", daemon=True)
        self._thread.start()

    def _work(self, constants: list[Constant], threads: Callable[[], int]) -> None:
        for c in constants:
            while int(threads()) < 2:
                if self._stop.wait(0.05):
                    return
            if self._stop.is_set():
                return
            try:
                c.value()
            except Exception:  # (the interpreter meets the same error when it reads the constant, and reports it)
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def with_scales(graph: Graph, scales: dict[str, int]) -> Graph:
    """The graph with activation cast scales set by node name (a graph built at another batch has the same names)."""
    missing = [n.name for n in activation_casts(graph) if n.name not in scales]
    if missing:
        raise TremulaError(f"no calibrated FP8 scale for {len(missing)} cast(s), e.g. {missing[0]!r}")
    g = graph.copy()
    g.nodes = [Node(n.op, n.inputs, n.outputs, {**n.attrs, "scale": scales[n.name]}, n.name) if n.name in scales
               else n for n in g.nodes]
    return g


def calibrate_fp8(graph: Graph, feeds: dict[str, np.ndarray]) -> Graph:
    """Fix each activation cast's scale from the calibration inputs `feeds` (see calibration_scales)."""
    return with_scales(graph, calibration_scales(graph, feeds))


def _weight_scale_of(w: np.ndarray, fmt: Fp8Format) -> int:
    return scale_for_max_abs(max_abs(w), fmt)


def _weight_codes(fmt: Fp8Format) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: quantize(w, fmt, _weight_scale_of(w, fmt)).view(fmt.np_dtype)


def _weight_scale(fmt: Fp8Format) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: np.full((1, 1), _weight_scale_of(w, fmt), np.int8)


def fp8_storage(graph: Graph, group: int) -> Graph:
    """Linear(Fp8Cast(x), Fp8Cast(W)) -> LinearFp8(Fp8Quantize(x), W codes, W scale): the form the C600 runs.

    W in FP8 (its format's dtype) and its scale (an int8 [1, 1] tensor, the QUARTER metadata) become constants made
    from W when first needed, so weights stay lazy through planning. `group` is the AMP's input channels per conv
    unit: the quarter -> half AMP rounds its running sum to half after each group (numerics/fp8.amp_fp8_matmul).
    """
    g = graph.copy()
    producers = g.producers()
    quantized: dict[str, str] = {}  # Fp8Cast(x) output -> Fp8Quantize output
    stored: dict[str, tuple[str, str]] = {}  # weight -> (codes, scale) constants
    nodes: list[Node] = []
    for n in g.nodes:
        xc, wc = (producers.get(i) for i in n.inputs[:2]) if n.op == "Linear" else (None, None)
        if not (xc and wc and xc.op == "Fp8Cast" and wc.op == "Fp8Cast" and wc.inputs[0] in g.constants
                and xc.inputs[0] not in g.constants):
            nodes.append(n)
            continue
        if xc.attrs.get("scale") is None:
            raise TremulaError(f"FP8 cast {xc.name!r} has no scale: calibrate the graph first")
        xq = n.inputs[0]
        if xq not in quantized:
            quantized[xq] = q = g.fresh_name(f"{xc.inputs[0]}.q8")
            g.types[q] = TensorType(g.types[xc.inputs[0]].shape, Fp8Format.parse(xc.attrs["fmt"]).np_dtype.name)
            nodes.append(Node("Fp8Quantize", [xc.inputs[0]], [q], dict(xc.attrs), f"{xc.name}.quantize"))
        w = wc.inputs[0]
        wfmt = Fp8Format.parse(wc.attrs["fmt"])
        if w not in stored:
            src = g.constants[w]
            codes, scale = g.fresh_name(f"{w}.codes"), g.fresh_name(f"{w}.scale")
            for name, ttype, fn, what in ((codes, TensorType(src.type.shape, wfmt.np_dtype.name), _weight_codes(wfmt),
                                           "codes"),
                                          (scale, TensorType((1, 1), "int8"), _weight_scale(wfmt), "scale")):
                g.constants[name] = Constant(name, ttype, init=DerivedInit(src, fn, f"FP8 {wfmt.value} {what}"))
                g.types[name] = ttype
            stored[w] = (codes, scale)
        attrs = {"x_scale": int(xc.attrs["scale"]), "group": group}  # the formats are the operands' dtypes
        nodes.append(Node("LinearFp8", [quantized[xq], *stored[w], *n.inputs[2:]], n.outputs, attrs, n.name))
    g.nodes = nodes
    from tremula.passes.dce import eliminate_dead_code

    return infer_types(eliminate_dead_code(g))


@dataclass(frozen=True)
class LayerLoss:
    node: str
    cosine: float  # Linear output with FP8 operands vs the same Linear with the unrounded operands
    rel_err: float


def layer_losses(graph: Graph, feeds: dict[str, np.ndarray]) -> list[LayerLoss]:
    """For every FP8 Linear, the error its own operand rounding adds (on the inputs it sees), worst first."""
    from tremula.ir.ops import rule

    producers = graph.producers()
    casts = {o for n in graph.nodes if n.op == "Fp8Cast" for o in n.outputs}
    linears = [n for n in graph.nodes if n.op == "Linear" and n.inputs[0] in casts]
    keep = {o for n in linears for o in n.outputs} | {producers[n.inputs[0]].inputs[0] for n in linears}
    vals = run(graph, feeds, keep=keep)
    out = []
    for n in linears:
        x = vals[producers[n.inputs[0]].inputs[0]]
        wsrc = producers[n.inputs[1]].inputs[0] if n.inputs[1] in producers else n.inputs[1]
        w = graph.constants[wsrc].value() if wsrc in graph.constants else vals[wsrc]
        args = [x, w] + [graph.constants[b].value() if b in graph.constants else vals[b] for b in n.inputs[2:] if b]
        cos, err = _closeness(rule("Linear").ref(args, n.attrs)[0], vals[n.outputs[0]])
        out.append(LayerLoss(n.name, cos, err))
    return sorted(out, key=lambda r: r.cosine)


def _closeness(exact: np.ndarray, got: np.ndarray, chunk: int = 1 << 20) -> tuple[float, float]:
    """(cosine, max |got - exact| / max |exact|) in float64, over chunks of `chunk` elements (float64 copies of a
    whole activation are fresh arrays each layer: SigLIP so400m's fc1 output is 25 MB in float64); (-inf, inf) when
    either holds a NaN or an infinity (the worst, not a perfect match)."""
    e, g = exact.reshape(-1), got.reshape(-1)
    dot = ee = gg = top = diff = 0.0
    for i in range(0, e.size, chunk):
        ec, gc = e[i: i + chunk].astype(np.float64), g[i: i + chunk].astype(np.float64)
        dot, ee, gg = dot + float(ec @ gc), ee + float(ec @ ec), gg + float(gc @ gc)
        top = max(top, float(np.max(np.abs(ec), initial=0.0)))
        gc -= ec
        diff = max(diff, float(np.max(np.abs(gc), initial=0.0)))
    if not (np.isfinite(ee) and np.isfinite(gg)):  # (a NaN or an infinity anywhere reaches the sums of squares)
        return float("-inf"), float("inf")
    denom = np.sqrt(ee) * np.sqrt(gg)
    return (float(dot / denom) if denom > 0 else 1.0), (diff / top if top > 0 else 0.0)


PARTIALS = ("half", "float")  # what fp16 and fp8 matmuls accumulate in (compile's --partials)


def with_partials(graph: Graph, partials: str, group: int) -> Graph:
    """The graph with every matmul by a 2-D constant weight, and every half attention, marked to accumulate in
    `partials`: "half" sets partials="half" on them (a half Linear/MatMul then rounds its running sum to half after
    every `group` input channels, the AMP's weights per conv unit, numerics/amp.py; an FP8 LinearFp8, whose AMP writes
    half partials anyway, sums its split-K parts in half; an Attention runs QK and PV so and its softmax in half,
    numerics/attention.py); "float" leaves the graph as it is (float32 partials and sums). The
    reference rules (ir/ops.py), the planner and the codelets read the mark, so the matched reference computes what
    the Program computes. PopRT runs fp16 and fp8 matmuls with half partials (../shared/reference/ipu-stack-facts.md
    section 4.3)."""
    if partials not in PARTIALS:
        raise TremulaError(f"unknown partials {partials!r}: use half or float")
    if partials == "float":
        return graph
    g = graph.copy()
    for n in g.nodes:
        w = n.inputs[1] if len(n.inputs) > 1 else ""
        if n.op in ("Linear", "MatMul") and w in g.constants and len(g.types[w].shape) == 2 and \
                g.types[n.inputs[0]].dtype == "float16":
            n.attrs = {**n.attrs, "partials": "half", "group": int(group)}
        elif n.op == "LinearFp8":
            n.attrs = {**n.attrs, "partials": "half"}
        elif n.op == "Attention" and g.types[n.inputs[0]].dtype == "float16":
            n.attrs = {**n.attrs, "partials": "half", "group": int(group)}  # QK and PV, softmax in half
    return g
