"""The System: several chips of one kind, the IPU-Links between neighbours and the host's memory, loaded from a TOML
file with a source per value (src/tremula/systems/, beside the chip files)."""

from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tremula.errors import TremulaError
from tremula.target.chip import Chip, _Reader, load_chip

MAX_CHIPS = 64  # far beyond any system (a C600 links to at most 8 cards, an IPU-POD256 has 256 IPUs in pods of 64)


@dataclass(frozen=True)
class System:
    """`chips` identical chips in a line: chip i links to chip i + 1. A pipeline's stages sit on consecutive chips,
    so a value crossing from stage a to stage b travels |b - a| links. Each chip keeps its own host link (the chip
    file's host_bytes_per_second)."""

    name: str
    description: str
    source_path: str
    chip: Chip
    chips: int
    link_bytes_per_second: float  # each way, between neighbouring chips
    link_efficiency: float  # the fraction of it a transfer gets
    link_latency_seconds: float  # per link crossed
    streaming_memory_bytes: float  # host DRAM the chips can stream from (0: none)

    def link_cycles(self, nbytes: int, hops: int = 1) -> int:
        """Chip cycles to move `nbytes` over `hops` links (store and forward would cost more; cut-through assumed:
        the bytes pass each link once at its rate, the latency is paid per link)."""
        if nbytes <= 0 or hops <= 0:
            return 0
        seconds = nbytes / (self.link_bytes_per_second * self.link_efficiency) + hops * self.link_latency_seconds
        return math.ceil(seconds * self.chip.clock_hz)


def builtin_system_names() -> list[str]:
    folder = resources.files("tremula") / "systems"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_system(name_or_path: str) -> System:
    """A built-in system by name (1xc600, 2xc600, 4xc600, bow2000) or a system TOML file."""
    spec = str(name_or_path)
    if not (spec.endswith(".toml") or "/" in spec or "\\" in spec):
        names = builtin_system_names()
        if spec.lower() in names:
            return _load_builtin(spec.lower())
        raise TremulaError(f"unknown system {spec!r} (built-in systems: {', '.join(names)}; or give a path to a "
                           ".toml)")
    path = Path(spec)
    if not path.is_file():
        raise TremulaError(f"system file {spec} does not exist")
    try:
        return _parse(path.read_text(encoding="utf-8"), spec, path.parent)
    except (OSError, UnicodeDecodeError) as e:
        raise TremulaError(f"system file {spec} cannot be read: {e}") from None


@functools.lru_cache(maxsize=None)
def _load_builtin(key: str) -> System:
    res = resources.files("tremula") / "systems" / f"{key}.toml"
    return _parse(res.read_text(encoding="utf-8"), f"{key}.toml", None)


def _parse(text: str, where: str, folder: Path | None) -> System:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TremulaError(f"system file {where} is not valid TOML: {e}") from None
    r = _Reader(data, where, kind="system file")
    chip_spec = r.string("chip")
    # A user's system may name a chip file beside it; a built-in name is looked up as `--chip` would.
    if folder is not None and chip_spec.endswith(".toml") and not Path(chip_spec).is_absolute():
        chip_spec = str(folder / chip_spec)
    chips = r.pos_int("chips", MAX_CHIPS)
    system = System(
        name=r.string("name"),
        description=r.string("description"),
        source_path=where,
        chip=load_chip(chip_spec),
        chips=chips,
        link_bytes_per_second=r.pos_float("link_bytes_per_second"),
        link_efficiency=r.fraction("link_efficiency"),
        link_latency_seconds=r.nonneg_float("link_latency_seconds"),
        streaming_memory_bytes=r.nonneg_float("streaming_memory_bytes"),
    )
    r.check_no_unknown_keys()
    return system
