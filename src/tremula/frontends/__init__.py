"""Frontends: turn a model reference (ONNX file, Hugging Face checkpoint folder, or zoo name) into a Graph."""

from __future__ import annotations

from pathlib import Path

from tremula.errors import TremulaError
from tremula.ir.graph import Graph


def load_model(spec: str, batch: int = 1, seq_len: int | None = None) -> Graph:
    """Dispatch on what `spec` is: an .onnx file, a folder with config.json, or a built-in zoo name.

    `batch` (and `seq_len` for text models) fix the dimensions a model leaves dynamic.
    """
    path = Path(spec)
    if path.is_file():
        from tremula.frontends.onnx_import import import_onnx

        return import_onnx(path, batch=batch, seq_len=seq_len)
    if path.is_dir():
        from tremula.frontends.hf import load_hf_folder

        return load_hf_folder(path, batch=batch, seq_len=seq_len)
    if "/" in spec or "\\" in spec or path.suffix:
        raise TremulaError(f"no such file or folder: {spec}")
    from tremula.frontends.zoo import ZOO, build_zoo

    if spec in ZOO:
        return build_zoo(spec, batch=batch, seq_len=seq_len)
    raise TremulaError(f"unknown model {spec!r}: not a file, a folder, or a zoo name (see `tremula zoo`)")
