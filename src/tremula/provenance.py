"""What makes a saved Program stand alone: its chip's TOML text and hash, the hash of its weights, how to rebuild them.

A Program stores references to weights (program.ConstImage names a graph constant), not the weights themselves, so
a file stays small; `seal` records what `tremula run` needs to know it is given the right ones:

- the chip: the TOML text the Chip was loaded from (a built-in's packaged file or the user's file, checked to parse to
  the very Chip compiled for) and the sha256 of its UTF-8 bytes;
- the weights: WEIGHTS_HASH below, over the constants of the planned graph (the graph after canonicalisation and
  precision lowering, the one the Program was compiled from) that the Program reads;
- how to rebuild that graph without planning: the --seq-len, and the FP8 activation scales by cast node name (the
  weights' FP8 codes and scales are made from the weights themselves, so they need nothing else; an FP8 constant's
  format is its dtype).

WEIGHTS_HASH (version 1): sha256 over the constants named by the Program's weight images, each once, in ascending order
of name (Python string order, i.e. by code point); for each constant, in this order: its name in UTF-8, a NUL byte, its
dtype name (NumPy's, e.g. "float16", or an FP8 format's ml_dtypes name, "float8_e4m3fnuz"), a NUL byte, its shape as
decimal sizes joined by "," (empty for a scalar), a NUL byte, then its values in C order as little-endian bytes of that
dtype. The values are those of the planned graph's constant, before any cast the weight image applies when it is loaded.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import ConcatInit, Constant, DerivedInit, FoldInit, Graph
from tremula.program import Program
from tremula.target.chip import Chip, builtin_chip_names

WEIGHTS_HASH_VERSION = 1


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def short(digest: str) -> str:
    """The first 12 hex digits of a hash, as messages show it."""
    return digest[:12]


# ------------------------------------------------------------------------------------------------ the chip


def _parse_chip(text: str, where: str) -> Chip:
    from tremula.target.chip import _parse  # the loader's own parser, so an embedded chip is read exactly as a file is

    return _parse(text, where)


def chip_text(chip: Chip) -> str:
    """The TOML text `chip` was loaded from: the built-in's packaged file or the user's file, whichever parses to this
    very Chip (a user file may be named like a built-in). Refused when neither does: the file changed since."""
    where = chip.source_path
    candidates: list[str] = []
    path = Path(where)
    if path.is_file():
        try:
            candidates.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            pass
    key = where[: -len(".toml")] if where.endswith(".toml") else ""
    if key and "/" not in where and "\\" not in where and key in builtin_chip_names():
        candidates.append((resources.files("tremula") / "chips" / where).read_text(encoding="utf-8"))
    for text in candidates:
        try:
            if _parse_chip(text, where) == chip:
                return text
        except TremulaError:
            continue
    raise TremulaError(f"chip file {where} no longer describes chip {chip.name} as it was loaded (it changed "
                       "during the compile?); compile again")


def chip_hash(chip: Chip) -> str:
    return sha256_text(chip_text(chip))


def embedded_chip(program: Program, where: str) -> Chip:
    """The Chip a sealed Program embeds, refused when its text does not hash to the hash beside it (a damaged or
    edited file)."""
    prov = program.provenance
    if sha256_text(prov.chip_toml) != prov.chip_sha256:
        raise TremulaError(f"program file {where}: its embedded chip description does not match its sha256 "
                           f"{short(prov.chip_sha256)} (the file was edited or damaged); recompile it")
    try:
        chip = _parse_chip(prov.chip_toml, f"the chip embedded in {where}")
    except TremulaError as e:
        raise TremulaError(f"program file {where}: its embedded chip is not readable ({e}); recompile it") from None
    if chip.name != program.chip or chip.tiles != program.tiles \
            or chip.sram_bytes_per_tile != program.sram_bytes_per_tile:
        raise TremulaError(f"program file {where}: its embedded chip {chip.name} ({chip.tiles} tiles x "
                           f"{chip.sram_bytes_per_tile} bytes) is not the chip its steps were planned for "
                           f"({program.chip}, {program.tiles} x {program.sram_bytes_per_tile}); recompile it")
    return replace(chip, source_path=f"the chip embedded in {where}")


# ------------------------------------------------------------------------------------------------ the weights


def _value(c: Constant, cache: bool) -> np.ndarray:
    """A constant's values; with cache=False a lazy one is made and dropped, so hashing a model's weights holds
    one constant at a time (Constant.value keeps every one it makes)."""
    if cache or c.data is not None:
        return c.value()
    init = c.init
    if isinstance(init, DerivedInit):  # as DerivedInit.make, without caching its source either
        out = np.asarray(init.fn(_value(init.source, cache=False)))
        if tuple(out.shape) != c.type.shape:
            raise TremulaError(f"{init.what} of {init.source.name!r}: made {list(out.shape)}, expected {c.type}")
        return out.astype(c.type.dtype, copy=False)
    if isinstance(init, ConcatInit):
        return init.join([_value(p, cache=False) for p in init.sources], c.type)
    if isinstance(init, FoldInit):
        return init.compute([_value(p, cache=False) for p in init.sources], c.type)
    assert init is not None
    return init.make(c.type)


def weights_sha256(graph: Graph, names: list[str] | set[str], cache: bool = False) -> str:
    """WEIGHTS_HASH (module docstring) of `graph`'s constants `names`; a name the graph lacks is refused."""
    h = hashlib.sha256()
    for name in sorted(set(names)):
        c = graph.constants.get(name)
        if c is None:
            raise TremulaError(f"the model has no constant {name!r}, which the program reads: it was compiled for "
                               "another model")
        v = np.ascontiguousarray(_value(c, cache))
        v = v.astype(v.dtype.newbyteorder("<"), copy=False)  # little-endian on any host (a no-op on most)
        shape = ",".join(str(int(d)) for d in v.shape)
        h.update(f"{name}\0{v.dtype.name}\0{shape}\0".encode())
        h.update(memoryview(v.reshape(-1).view(np.uint8)) if v.size else b"")  # (bytes of any dtype, FP8 too)
    return h.hexdigest()


def program_weights_sha256(program: Program, graph: Graph, cache: bool = False) -> str:
    """WEIGHTS_HASH of the constants `program` reads, taken from the planned `graph`."""
    return weights_sha256(graph, {c.name for c in program.consts}, cache)


def fp8_scales(planned: Graph) -> dict[str, int]:
    """The activation casts' scales by cast node name, read back from the planned graph's Fp8Quantize nodes (named
    after their cast, passes/precision.fp8_storage)."""
    return {n.name.removesuffix(".quantize"): int(n.attrs["scale"]) for n in planned.nodes if n.op == "Fp8Quantize"}


def seal(program: Program, chip: Chip, planned: Graph, seq_len: int | None = None) -> Program:
    """Fill `program.provenance` from the chip it was compiled for and the planned graph it was compiled from (the
    weights are hashed one constant at a time, none kept); returns the Program."""
    if chip.name != program.chip or chip.tiles != program.tiles:
        raise TremulaError(f"sealing a program planned for {program.chip} with chip {chip.name}")
    prov = program.provenance
    prov.chip_toml = chip_text(chip)
    prov.chip_sha256 = sha256_text(prov.chip_toml)
    used = {c.name for c in program.consts}
    prov.weights_sha256 = weights_sha256(planned, used)
    prov.seq_len = seq_len
    prov.fp8_scales = fp8_scales(planned)
    return program
