"""`tremula run`: load a saved Program, make sure it is given its own chip and weights, and simulate it on inputs.

A Program file holds references to weights, not the weights (program.py), and its provenance (provenance.py): the
chip's TOML text and hash, and the hash of the weights it was compiled for. `run` rebuilds the planned graph from the
model the way compile did, without planning (load at the Program's batch and --seq-len, canonicalise, lower the
precision with the recorded FP8 activation scales), and refuses in one line a Program made for another chip (when
--chip is given), for other weights, or for a model whose inputs and outputs differ. The simulator then runs the
Program's own steps on the embedded chip's geometry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Graph
from tremula.program import Program, load_program
from tremula.provenance import chip_hash, embedded_chip, program_weights_sha256, short
from tremula.target.chip import Chip


@dataclass
class Prepared:
    """A loaded Program with everything it runs against: its chip and the model's graphs, checked to be its own."""

    program: Program
    chip: Chip  # the chip the Program embeds
    planned: Graph  # the model as the Program was compiled from it (its weights are the Program's)
    reference: Graph  # the canonical float32 model at the Program's batch (the user's inputs are checked on it)


@dataclass
class RunResult:
    prepared: Prepared
    outputs: dict[str, np.ndarray]
    seconds: float  # wall time of the simulation


def prepare(path: str, model: str, chip: str | None = None) -> Prepared:
    """Load the Program at `path` and rebuild `model`'s planned graph for it; refuse another chip or other weights."""
    from tremula.target.chip import load_chip
    from tremula.pipeline import canonical, lower_precision
    from tremula.frontends import load_model

    program = load_program(path)
    prov = program.provenance
    if not prov.sealed:
        raise TremulaError(f"program file {path} carries no chip description or weights hash (it was saved without "
                           f"provenance.seal); recompile it with `tremula compile MODEL -o {path}`")
    own = embedded_chip(program, path)
    if chip is not None:
        asked = load_chip(chip)
        digest = chip_hash(asked)
        if digest != prov.chip_sha256:
            raise TremulaError(f"{path} was compiled for chip {program.chip} (sha256 {short(prov.chip_sha256)}), not "
                               f"for {chip} ({asked.name}, sha256 {short(digest)}): recompile it with --chip {chip}")
    raw = load_model(model, batch=program.batch, seq_len=prov.seq_len)
    try:
        planned = lower_precision(raw, program.dtype, own, prov.fp8_scales or None)
    except TremulaError as e:
        raise TremulaError(f"{model} does not lower as the model of {path} did ({e}): it was compiled for another "
                           "model") from None
    for name, (shape, dtype) in sorted(program.io_types.items()):
        t = planned.types.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            have = f"{t.dtype}{list(t.shape)}" if t is not None else "nothing"
            raise TremulaError(f"{model} has {have} as {name!r}, the program {path} has {dtype}{list(shape)}: it was "
                               "compiled for another model (or another --seq-len)")
    digest = program_weights_sha256(program, planned, cache=True)  # the simulator reuses the values made here
    if digest != prov.weights_sha256:
        raise TremulaError(f"{path} was compiled for other weights (sha256 {short(prov.weights_sha256)}) than "
                           f"{model}'s (sha256 {short(digest)}): recompile it with `tremula compile {model} -o "
                           f"{path}`")
    return Prepared(program, own, planned, canonical(raw))


def run_saved(prepared: Prepared, inputs: dict[str, np.ndarray], progress=None) -> RunResult:
    """Simulate the Program on the user's inputs (checked against the model first, user_inputs.py)."""
    from tremula.sim.functional import simulate
    from tremula.user_inputs import input_feeds

    feeds = input_feeds(prepared.reference, inputs)
    t0 = time.perf_counter()
    outs = simulate(prepared.program, prepared.planned, feeds, check=True, progress=progress)
    return RunResult(prepared, outs, time.perf_counter() - t0)
