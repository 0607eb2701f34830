"""Host I/O in the numbers: the Program's host streams priced over the host link, in latency, throughput and --json."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from tremula.compiler import compile_model
from tremula.target.chip import load_chip

MODEL, BATCH = "vit-tiny", "2"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tremula", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny():
    chip = load_chip("c600")
    return chip, compile_model(MODEL, chip, int(BATCH), "fp16")


def _link_cycles(chip, nbytes: int) -> int:
    """bytes / bandwidth in tile cycles, rounded up, computed here without the cost model."""
    return math.ceil(Fraction(nbytes) * Fraction(chip.clock_hz) / Fraction(chip.host_bytes_per_second))


def test_host_cycles_are_the_streams_bytes_over_the_link(tiny):
    chip, res = tiny
    p = res.program
    bytes_in = sum(s.rows * s.cols * np.dtype(s.dtype).itemsize for s in p.host_in)
    bytes_out = sum(s.rows * s.cols * np.dtype(s.dtype).itemsize for s in p.host_out)
    # vit-tiny streams each input and output element once, in half: the graph's own tensors
    io = {n: int(np.prod(shape)) * 2 for n, (shape, _) in p.io_types.items()}
    assert bytes_in == io["pixel_values"] > 0 and bytes_out == io["last_hidden_state"] + io["pooler_output"] > 0
    assert (res.host_in_bytes, res.host_out_bytes) == (bytes_in, bytes_out)
    assert res.host_in_cycles == _link_cycles(chip, bytes_in) > 0
    assert res.host_out_cycles == _link_cycles(chip, bytes_out) > 0
    assert abs(res.host_in_cycles - bytes_in * chip.clock_hz / chip.host_bytes_per_second) < 1
    # device cycles stay the forward's own; latency (and throughput, no overlap) add the host link in series
    assert res.cycles == res.compute_cycles + res.exchange_cycles + res.sync_cycles
    assert res.host_cycles == res.host_in_cycles + res.host_out_cycles
    assert res.latency_cycles == res.throughput_cycles == res.cycles + res.host_cycles
    assert res.program.meta["summary"]["host_cycles"] == res.host_cycles


def test_compile_json_carries_host_cycles_and_the_profile_agrees(tiny):
    chip, res = tiny
    p = _run("compile", MODEL, "--chip", "c600", "--dtype", "fp16", "--batch", BATCH, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    for key in ("host_in_cycles", "host_out_cycles", "host_cycles", "host_in_bytes", "host_out_bytes",
                "latency_cycles", "throughput_cycles"):
        assert doc[key] == getattr(res, key), key
    assert doc["host_overlaps_device"] is False and doc["cycles"] == res.cycles
    s = doc["profile"]["summary"]
    assert (s["host_in_cycles"], s["host_out_cycles"], s["cycles"]) == (
        res.host_in_cycles, res.host_out_cycles, res.cycles)
    assert s["latency_s"] == pytest.approx(res.latency_cycles / chip.clock_hz)
    assert s["throughput"] == pytest.approx(res.batch * chip.clock_hz / res.latency_cycles)
    assert s["mfu"] == pytest.approx(s["model_flops"] / s["latency_s"] / s["peak_flops"])


def test_printed_summary_charges_host_io(tiny):
    chip, res = tiny
    p = _run("compile", MODEL, "--chip", "c600", "--dtype", "fp16", "--batch", BATCH)
    assert p.returncode == 0, p.stderr
    host = re.search(r"^  host I/O +([\d,]+) cycles \(in ([\d,]+) .*, out ([\d,]+) ", p.stdout, re.MULTILINE)
    assert host, p.stdout
    assert [int(g.replace(",", "")) for g in host.groups()] == [res.host_cycles, res.host_in_cycles,
                                                                 res.host_out_cycles]
    thr = re.search(r"^  throughput +([\d,.]+) samples/s \(host I/O not overlapped", p.stdout, re.MULTILINE)
    assert thr, p.stdout
    with_host = f"{res.batch * chip.clock_hz / res.latency_cycles:,.1f}"
    device_only = f"{res.batch * chip.clock_hz / res.cycles:,.1f}"
    assert thr.group(1) == with_host != device_only
    lat = re.search(r"^  latency +([\d.]+) ms", p.stdout, re.MULTILINE)
    assert lat and lat.group(1) == f"{res.latency_cycles / chip.clock_hz * 1e3:.3f}"
