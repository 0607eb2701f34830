"""Output paths checked before any work: never onto an input file, never twice, and writable now, not after the compile.

A compile can take minutes; an output that would destroy the model it reads, or that cannot be written, is refused
first with one line naming the path, so the user loses neither files nor time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from tremula.errors import TremulaError

if TYPE_CHECKING:
    import onnx


def check_outputs(outputs: Mapping[str, str | None], model: str | None = None, chip: str | None = None,
                  calibration: str | None = None) -> None:
    """Refuse (TremulaError) an output that is empty, a folder, unwritable, the same file as another output, or one
    of the files the command reads: the model and its external data, any file in a checkpoint folder (the folder is
    the model: a file added there can change it), the chip file, the calibration file.

    `outputs` maps a flag (for the message) to the path given, None when the flag is absent; `model`, `chip` and
    `calibration` are as given on the command line."""
    given = {flag: path for flag, path in outputs.items() if path is not None}
    resolved = {flag: _resolve(flag, path) for flag, path in given.items()}
    _refuse_shared_outputs(given, resolved)
    folder = model_folder(model) if model is not None else None
    inputs = input_files(model, chip, calibration, near=list(resolved.values()))
    for flag, target in resolved.items():
        if folder is not None and target.is_relative_to(folder.resolve()):
            raise TremulaError(f"{flag} {given[flag]} is inside the model folder {folder}; "
                               "write outputs outside the checkpoint")
        for path, what in inputs.items():
            if _same_file(target, path):
                raise TremulaError(f"{flag} {given[flag]} would overwrite {what} {path}; choose another output path")
    for flag, target in resolved.items():
        _probe_writable(flag, given[flag], target)


def _resolve(flag: str, path: str) -> Path:
    if not path.strip():
        raise TremulaError(f"{flag} needs a file name (got an empty path)")
    try:
        return Path(path).resolve()
    except (OSError, ValueError, RuntimeError) as e:  # NUL bytes, symlink loops
        raise TremulaError(f"{flag} {path!r} is not a usable path: {e}") from None


def _refuse_shared_outputs(given: Mapping[str, str], resolved: Mapping[str, Path]) -> None:
    flags = list(resolved)
    for i, a in enumerate(flags):
        for b in flags[i + 1:]:
            if _same_file(resolved[a], resolved[b]):
                raise TremulaError(f"{a} {given[a]} and {b} {given[b]} name the same file; give each its own path")


def _same_file(a: Path, b: Path) -> bool:
    """The same resolved path, or two names (hard links) of one existing file."""
    try:
        return a == b.resolve() or os.path.samefile(a, b)
    except (OSError, ValueError):  # one of them does not exist yet (or cannot): different files
        return False


def _probe_writable(flag: str, given: str, target: Path) -> None:
    """Open the output as the writer will, without changing it: an existing file is opened for appending (its bytes
    and times stay), a new one is created and removed again, so no stray file is left behind."""
    if target.is_dir():
        raise TremulaError(f"{flag} {given} is a folder; give a file path")
    parent = target.parent
    if not parent.exists():
        raise TremulaError(f"{flag} {given}: folder {parent} does not exist")
    if not parent.is_dir():
        raise TremulaError(f"{flag} {given}: {parent} is not a folder")
    existed = target.exists()
    # O_NONBLOCK: a named pipe without a reader fails at once instead of hanging the probe.
    flags = os.O_WRONLY | os.O_NONBLOCK | (os.O_APPEND if existed else os.O_CREAT | os.O_EXCL)
    try:
        fd = os.open(target, flags, 0o644)
    except OSError as e:
        raise TremulaError(f"{flag} {given} cannot be written: {e.strerror or e}") from None
    os.close(fd)
    if not existed:
        os.unlink(target)


# ------------------------------------------------------------------------------------------------ what is read


def input_files(model: str | None, chip: str | None = None, calibration: str | None = None,
                near: list[Path] | None = None) -> dict[Path, str]:
    """Every file the command reads, with what it is: the model file and its external data, the chip file (a
    built-in's packaged file too) and the calibration file. (A checkpoint folder's files: see model_folder.)

    With `near` (resolved output paths), an ONNX file's external data is looked up only when an output lies in the
    model's folder, where the importer requires that data to be: parsing a large model costs seconds."""
    files: dict[Path, str] = {}
    path = Path(model) if model else None
    if path is not None and path.is_file():
        files[path] = "the model"
        home = path.resolve().parent
        if near is None or any(p.is_relative_to(home) for p in near):
            for data in onnx_external_data(path):
                files.setdefault(data, "the model's external data")
    chip_file = _chip_file(chip) if chip else None
    if chip_file is not None:
        files.setdefault(chip_file, "the chip file")
    if calibration:
        files.setdefault(Path(calibration), "the calibration file")
    return files


def model_folder(model: str) -> Path | None:
    """The checkpoint folder when the model is one (load_model reads a folder as a Hugging Face checkpoint)."""
    path = Path(model)
    return path if path.is_dir() else None


def onnx_external_data(path: Path) -> list[Path]:
    """The external data files an ONNX model names, relative to its folder; none when it is not readable ONNX (the
    importer reports that). Reads the protobuf only, not the tensors' data."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # a stranger's bytes: any failure here is the importer's to report, with its own message
        return []
    locations: dict[Path, None] = {}
    for tensor in _tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value:
                    locations[path.parent / entry.value] = None
    return list(locations)


def _tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of a model: initializers, sparse ones, and node attributes at any depth of subgraphs and
    functions (the places onnx's external-data loader looks)."""
    graphs = [model.graph]
    nodes = [n for f in model.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            g = graphs.pop()
            yield from g.initializer
            for s in g.sparse_initializer:
                yield s.values
                yield s.indices
            nodes.extend(g.node)
            continue
        for attr in nodes.pop().attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                graphs.append(attr.g)
            graphs.extend(attr.graphs)


def _chip_file(spec: str) -> Path | None:
    """The file load_chip reads for `spec`: a built-in's packaged TOML (when installed as files) or the user's."""
    from tremula.target.chip import builtin_chip_names

    looks_like_path = spec.endswith(".toml") or "/" in spec or "\\" in spec
    if not looks_like_path and spec.lower() in builtin_chip_names():
        packaged = resources.files("tremula") / "chips" / f"{spec.lower()}.toml"
        return Path(str(packaged)) if isinstance(packaged, Path) else None
    return Path(spec)
