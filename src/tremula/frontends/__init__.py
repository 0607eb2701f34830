"""Frontends: turn a model reference (ONNX file, Hugging Face checkpoint folder, or zoo name) into a Graph."""

from __future__ import annotations

from pathlib import Path

from tremula.errors import TremulaError
from tremula.ir.graph import Graph


def load_model(spec: str, batch: int | None = None, seq_len: int | None = None) -> Graph:
    """Dispatch on what `spec` is: an .onnx file, a folder with config.json, or a built-in zoo name.

    `batch` (and `seq_len` for text models) fix the dimensions a model leaves dynamic; batch=None is the model's own
    batch (an ONNX file's fixed one), else 1. An ONNX file with a fixed batch is rebatched when it can be
    (frontends/rebatch.py), else refused. A zoo name shared with a path
    here follows frontends.zoo.zoo_choice; `zoo:NAME` is always the zoo model. Every Graph's concrete weights are
    checked for NaN / Inf here, once for all frontends.
    """
    from tremula.frontends.finite import refuse_nonfinite
    from tremula.frontends.zoo import build_zoo, zoo_choice

    zoo = zoo_choice(spec)
    graph = (build_zoo(zoo, batch=1 if batch is None else batch, seq_len=seq_len) if zoo is not None
             else _load_path(spec, batch, seq_len))
    refuse_nonfinite(graph, spec)
    return graph


def _load_path(spec: str, batch: int | None, seq_len: int | None) -> Graph:
    path = Path(spec)
    if path.is_file():
        from tremula.frontends.onnx_import import import_onnx

        return import_onnx(path, batch=batch, seq_len=seq_len)
    if path.is_dir():
        from tremula.frontends.hf import load_hf_folder

        # Without token_type_ids, as transformers runs BERT when it is not given (a notice says so).
        return load_hf_folder(path, batch=1 if batch is None else batch, seq_len=seq_len, token_type_ids=False)
    if "/" in spec or "\\" in spec or path.suffix:
        raise TremulaError(f"no such file or folder: {spec}")
    raise TremulaError(f"unknown model {spec!r}: not a file, a folder, or a zoo name (see `tremula zoo`)")
