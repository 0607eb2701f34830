"""What a model is before it is planned: inputs, outputs, parameters, FLOPs and a per-op table (like onnx-tool's)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tremula.ir.graph import Graph, model_batch
from tremula.ir.ops import flops


@dataclass(frozen=True)
class OpRow:
    op: str
    count: int
    flops: int
    percent: float
    params: int  # elements of the constants this op reads (each constant counted once, at its first reader)
    in_shapes: list[str]
    out_shapes: list[str]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    inputs: list[tuple[str, str]]
    outputs: list[tuple[str, str]]
    params: int
    param_bytes: int
    lazy_params: bool  # True when no weight has been materialised (planning costs no memory)
    flops: int
    nodes: int
    ops: list[OpRow] = field(default_factory=list)
    batch: int | None = None  # the batch the graph really has (model_batch), whatever was asked

    def to_json(self) -> dict:
        return asdict(self)


MAX_SHAPES_SHOWN = 3  # distinct shapes listed per op; the rest are counted


def _shapes(shapes: list[str]) -> list[str]:
    distinct = list(dict.fromkeys(shapes))
    if len(distinct) > MAX_SHAPES_SHOWN:
        return distinct[:MAX_SHAPES_SHOWN] + [f"(+{len(distinct) - MAX_SHAPES_SHOWN} more)"]
    return distinct


def describe(graph: Graph) -> ModelInfo:
    per_op: dict[str, dict] = {}
    seen_consts: set[str] = set()
    total = 0
    for node in graph.nodes:
        ins = [graph.types[i] for i in node.inputs if i]
        outs = [graph.types[o] for o in node.outputs]
        f = flops(node.op, ins, outs, node.attrs)
        total += f
        row = per_op.setdefault(node.op, {"count": 0, "flops": 0, "params": 0, "in": [], "out": []})
        row["count"] += 1
        row["flops"] += f
        for i in node.inputs:
            if i in graph.constants and i not in seen_consts:
                seen_consts.add(i)
                row["params"] += graph.constants[i].type.size
        row["in"].append(" ".join(str(t) for t in ins))
        row["out"].append(" ".join(str(t) for t in outs))
    rows = [
        OpRow(op, r["count"], r["flops"], 100.0 * r["flops"] / total if total else 0.0, r["params"],
              _shapes(r["in"]), _shapes(r["out"]))
        for op, r in sorted(per_op.items(), key=lambda kv: (-kv[1]["flops"], kv[0]))
    ]
    return ModelInfo(
        name=graph.name,
        inputs=[(n, str(graph.types[n])) for n in graph.inputs],
        outputs=[(n, str(graph.types[n])) for n in graph.outputs],
        params=graph.param_count(),
        param_bytes=graph.param_bytes(),
        lazy_params=all(c.is_lazy for c in graph.constants.values() if c.type.size > 1024),
        flops=total,
        nodes=len(graph.nodes),
        ops=rows,
        batch=model_batch(graph),
    )
