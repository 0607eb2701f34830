"""The IR: Graph types, the op rule table, the reference interpreter and a builder."""

from tremula.ir.builder import GraphBuilder
from tremula.ir.graph import Constant, Graph, LazyInit, Node, TensorType
from tremula.ir.interp import infer_types, run
from tremula.ir.ops import OPS, OpDef

__all__ = ["Constant", "Graph", "GraphBuilder", "LazyInit", "Node", "OPS", "OpDef", "TensorType", "infer_types", "run"]
