"""Chip files load, carry a tagged source for every number, reproduce vendor peaks, and reject bad input in one line."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from tremula.errors import TremulaError
from tremula.target.chip import Chip, builtin_chip_names, chip_rows, load_chip, normalize_dtype

REPO = Path(__file__).resolve().parents[2]
TINY64 = REPO / "examples" / "chips" / "tiny64.toml"
TAGS = ("[V]", "[M]", "[C]", "[RE]", "[I]", "[E]", "[C->I]", "[V->I]")  # [E]: an estimate a stack measured against hardware (ipu-stack-facts)


def _builtin_text(name: str) -> str:
    return (resources.files("tremula") / "chips" / f"{name}.toml").read_text(encoding="utf-8")


def _all_chip_files() -> list[tuple[str, str]]:
    return [(n, _builtin_text(n)) for n in builtin_chip_names()] + [("tiny64", TINY64.read_text(encoding="utf-8"))]


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _unsourced(table: dict, path: str = "", inherited: bool = False) -> list[str]:
    """Numeric leaves with no *_source string beside them or beside an enclosing inline-table key."""
    missing = []
    for key, value in table.items():
        if key.endswith("_source"):
            continue
        src = table.get(f"{key}_source")
        sourced = inherited or (isinstance(src, str) and src.strip() != "")
        if isinstance(value, dict):
            # A [table] header has no sibling; an inline row `op = {...}` is sourced by `op_source`.
            missing += _unsourced(value, f"{path}{key}.", inherited=sourced)
        elif _is_number(value) and not sourced:
            missing.append(path + key)
    return missing


def _sources(table: dict) -> list[str]:
    out = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += _sources(value)
        elif key.endswith("_source"):
            out.append(value)
    return out


def test_builtin_names():
    assert builtin_chip_names() == ["mk1", "mk2", "bow", "c600"]


@pytest.mark.parametrize("name,text", _all_chip_files(), ids=lambda x: x if len(x) < 20 else "")
def test_every_number_has_a_source(name, text):
    data = tomllib.loads(text)
    assert _unsourced(data) == []
    # A sibling source of a key that does not exist is a typo that would leave the real key unsourced.
    for path in _orphan_sources(data):
        pytest.fail(f"{name}: {path} has no field to describe")


def _orphan_sources(table: dict, path: str = "") -> list[str]:
    out = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += _orphan_sources(value, f"{path}{key}.")
        elif key.endswith("_source") and key[: -len("_source")] not in table:
            out.append(path + key)
    return out


@pytest.mark.parametrize("name", ["mk1", "mk2", "bow", "c600"])
def test_every_source_is_tagged(name):
    for src in _sources(tomllib.loads(_builtin_text(name))):
        assert any(t in src for t in TAGS), f"{name}: source without a reference tag: {src!r}"
        cites = ("ref §" in src or "ipu-stack-facts" in src and "§" in src or "PerformanceEstimation.hpp" in src)
        assert cites, f"{name}: source cites no reference: {src!r}"


def test_inferred_values_say_so():
    # The reference marks these as inferences ([I]); the chip files must not present them as vendor facts.
    for name in builtin_chip_names():
        data = tomllib.loads(_builtin_text(name))
        for pair, row in data["amp"].items():
            if isinstance(row, dict):
                assert "I]" in row["macs_per_cycle_per_tile_source"], (name, pair)
    assert "[I]" in tomllib.loads(_builtin_text("mk2"))["clock_hz_source"]
    assert "[I]" in tomllib.loads(_builtin_text("mk2"))["memory_element_bytes_source"]


@pytest.mark.parametrize(
    "name,dtype,vendor_tflops",
    [
        ("c600", "fp16", 280.0),
        ("c600", "fp8", 560.0),
        ("c600", "fp32", 70.0),
        ("bow", "fp16", 348.6),
        ("bow", "fp16", 350.0),
        ("mk2", "fp16", 250.0),
        ("mk2", "fp32", 62.4),
        ("mk1", "fp16", 124.5),
    ],
)
def test_peak_flops_match_vendor_within_1_percent(name, dtype, vendor_tflops):
    peak = load_chip(name).peak_flops(dtype) / 1e12
    assert abs(peak - vendor_tflops) / vendor_tflops < 0.01, peak


def test_peak_is_the_documented_product():
    c = load_chip("c600")
    assert c.peak_flops("float16") == 2 * 64 * 1472 * 1.5e9
    assert c.peak_flops("fp8") == 2 * c.peak_flops("fp16")


def test_names_are_case_insensitive_and_paths_work():
    assert load_chip("C600") == load_chip("c600")
    assert load_chip("Mk2").name == "mk2"
    tiny = load_chip(str(TINY64))
    assert (tiny.tiles, tiny.sram_bytes_per_tile, tiny.arch) == (64, 65536, "ipu2")
    assert tiny.total_sram_bytes == 64 * 64 * 1024


def test_derived_properties():
    mk1, mk2, c600 = load_chip("mk1"), load_chip("mk2"), load_chip("c600")
    assert mk1.total_sram_bytes == 304 * 2**20
    assert mk2.total_sram_bytes == 1472 * 638976
    assert mk2.exchange_bytes_per_second_per_tile == pytest.approx(4 * 1.325e9)
    assert c600.supports("fp8") and c600.supports("float16")
    assert not mk2.supports("fp8")
    with pytest.raises(TremulaError, match="no fp8"):
        mk2.peak_flops("fp8")
    assert mk1.memory_elements_per_tile == 16


def test_chip_is_frozen_and_hashable():
    c = load_chip("bow")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tiles = 1  # type: ignore[misc]
    assert hash(c) == hash(load_chip("bow"))


def test_normalize_dtype():
    assert normalize_dtype("float16") == normalize_dtype("HALF") == "fp16"
    assert normalize_dtype("float8_e4m3fnuz") == "fp8"
    with pytest.raises(TremulaError, match="unknown element type"):
        normalize_dtype("int8")


def test_chip_rows():
    rows = chip_rows([load_chip(n) for n in builtin_chip_names()])
    by_name = {r["name"]: r for r in rows}
    assert list(by_name) == ["mk1", "mk2", "bow", "c600"]
    assert by_name["mk2"]["FP8 TFLOP/s"] is None  # numbers for JSON; the CLI's table shows None as '-'
    assert by_name["c600"]["FP8 TFLOP/s"] == pytest.approx(565.2, abs=0.1)
    assert by_name["bow"]["FP16 TFLOP/s"] == pytest.approx(348.6, abs=0.1)
    assert by_name["mk2"]["SRAM/tile KiB"] == 624
    assert by_name["mk2"]["SRAM MiB"] == pytest.approx(897.0, abs=0.05)
    assert by_name["c600"]["clock GHz"] == 1.5
    assert by_name["mk2"]["exchange GB/s/tile"] == pytest.approx(5.3)
    assert all(isinstance(v, (int, float)) for r in rows for k, v in r.items() if k not in ("name", "arch")
               and v is not None)


# ---- bad input: one line, naming the file and the field -----------------------------------------------------------


def _write_variant(tmp_path: Path, pattern: str, replacement: str) -> str:
    text = _builtin_text("mk2")
    new, n = re.subn(pattern, replacement, text, count=1, flags=re.M)
    assert n == 1, pattern
    path = tmp_path / "chip.toml"
    path.write_text(new, encoding="utf-8")
    return str(path)


def _one_line_error(spec: str) -> str:
    with pytest.raises(TremulaError) as info:
        load_chip(spec)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    "pattern,replacement,expect",
    [
        (r"^tiles = .*$", "", "field 'tiles' is missing"),
        (r"^tiles = .*$", "tiles = 0", "field 'tiles' must be a positive integer"),
        (r"^tiles = .*$", 'tiles = "many"', "field 'tiles' must be an integer"),
        (r"^tiles = .*$", "tiles = 1472.5", "field 'tiles' must be an integer"),
        (r"^tiles = .*$", "tiles = true", "field 'tiles' must be an integer"),
        (r"^clock_hz = .*$", "clock_hz = -1.0", "field 'clock_hz' must be a positive number"),
        (r"^clock_hz = .*$", "clock_hz = nan", "field 'clock_hz' must be a positive number"),
        (r"^sram_bytes_per_tile = .*$", "sram_bytes_per_tile = 0", "field 'sram_bytes_per_tile'"),
        (r"^arch = .*$", 'arch = "gpu"', "field 'arch' must be one of ipu1, ipu2, ipu21"),
        (r"^sync_cycles = .*$", "sync_cycles = -5", "field 'sync_cycles' must be a non-negative integer"),
        (r"^conv_units = 16$", "conv_units = 15", "field 'amp.fp32_fp32.macs_per_cycle_per_tile' (16) must equal"),
        (
            r"^worker_tag_cycles = .*$",
            "worker_tag_cycles = 14\nworker_tag_cycle = 3",
            "unknown field 'amp.worker_tag_cycle'",
        ),
        (r"^\[amp.fp16_fp32\]$", "[amp.fp16_int8]", "amp table 'fp16_int8'"),
        (r"^tiles = .*$", "tiles = [1472", "is not valid TOML"),
    ],
)
def test_bad_chip_file_is_one_line_naming_file_and_field(tmp_path, pattern, replacement, expect):
    path = _write_variant(tmp_path, pattern, replacement)
    msg = _one_line_error(path)
    assert expect in msg
    assert path in msg


def test_missing_nested_field(tmp_path):
    path = _write_variant(tmp_path, r"^exp = .*$", "exp = { fp16_cycles_per_loop = 4 }")
    assert "field 'vector.ops.exp.fp16_elems_per_loop' is missing" in _one_line_error(path)


def test_unknown_name_lists_known_ones():
    msg = _one_line_error("mk3")
    for name in ("mk1", "mk2", "bow", "c600"):
        assert name in msg


def test_missing_path_and_unreadable_file(tmp_path):
    assert "does not exist" in _one_line_error(str(tmp_path / "nope.toml"))
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert str(binary) in _one_line_error(str(binary))


def test_user_chip_can_change_any_constant(tmp_path):
    # A hypothetical chip is one data file: twice the SRAM and another clock, no code change.
    path = _write_variant(tmp_path, r"^sram_bytes_per_tile = .*$", "sram_bytes_per_tile = 1277952")
    c = load_chip(path)
    assert c.sram_bytes_per_tile == 2 * load_chip("mk2").sram_bytes_per_tile
    assert isinstance(c, Chip) and c.source_path == path


def test_bare_file_name_without_extension_loads_as_a_path(tmp_path, monkeypatch):
    (tmp_path / "mychip").write_text(_builtin_text("bow"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert load_chip("mychip").clock_hz == 1.85e9
