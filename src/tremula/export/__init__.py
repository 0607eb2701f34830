"""Exporters: write a Graph out in other formats (ONNX, for checking against onnxruntime)."""

from tremula.export.onnx_export import export_onnx, save_onnx

__all__ = ["export_onnx", "save_onnx"]
