"""Mutation tests: the simulator really executes the Program, and `check` sees a 4-byte corruption at every precision.
Break one transfer, one address, one exchange or one weight block and the check must fail (poison check fires, or the
outputs no longer match the reference: the float32 one at fp32, the precision-matched one at fp16 and fp8)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from tremula.check import compare, compare_matched
from tremula.compiler import CompileResult, compile_model
from tremula.errors import TremulaError
from tremula.feeds import make_feeds
from tremula.frontends import load_model
from tremula.ir import run
from tremula.pipeline import canonical
from tremula.program import Program
from tremula.sim.functional import SimCheckError, simulate
from tremula.sim.reference import REORDERINGS, matched_reference

DTYPES = ["fp32", "fp16", "fp8"]


@dataclasses.dataclass
class Setup:
    res: CompileResult
    feeds: dict[str, np.ndarray]
    ref: dict[str, np.ndarray]  # float32 at fp32, else the precision-matched reference
    reordered: list[dict[str, np.ndarray]]  # the matched reference with its float sums in other orders (tolerance)


_CACHE: dict[tuple[str, str], Setup] = {}


def _setup(dtype: str, kind: str = "default", chip: str = "c600", batch: int = 2) -> Setup:
    if (kind, dtype) not in _CACHE:
        res = compile_model("bert-tiny", chip, batch, dtype)
        g = canonical(load_model("bert-tiny", batch))
        feeds = make_feeds(g, 1)
        if res.dtype == "float32":
            ref, alt = run(g, feeds), []
        else:
            assert res.graph is not None
            ref = matched_reference(res.graph, res.split_sums, feeds)
            alt = [matched_reference(res.graph, res.split_sums, feeds, reorder=r) for r in REORDERINGS]
        _CACHE[(kind, dtype)] = Setup(res, feeds, ref, alt)
    return _CACHE[(kind, dtype)]


@pytest.fixture(params=DTYPES)
def setup(request) -> Setup:
    return _setup(request.param)


def outcome(s: Setup, program: Program, check: bool) -> str:
    """poison (the simulator's check mode refused it), error, mismatch (the comparison failed) or pass."""
    assert s.res.graph is not None
    try:
        got = simulate(program, s.res.graph, s.feeds, check=check)
    except SimCheckError:
        return "poison"
    except TremulaError:  # e.g. a corrupted token id makes the embedding lookup go out of range
        return "error"
    if s.res.dtype == "float32":
        ok = all(compare(k, got[k], s.ref[k], "float32").passed for k in s.res.graph.outputs)
    else:
        ok = all(compare_matched(k, got[k], s.ref[k], [a[k] for a in s.reordered]).passed for k in s.res.graph.outputs)
    return "pass" if ok else "mismatch"


def first_exchange(program: Program) -> int:
    """The first step with transfers: its destinations hold no stale copy of the same data from an earlier step
    (a reused buffer can hold identical bytes, which would hide a corrupted transfer)."""
    return next(k for k, s in enumerate(program.steps) if len(s.exchange))


def first_activation_exchange(program: Program) -> int:
    """The first step with transfers after the embedding lookup: it moves float activations (the ones before move
    token ids, where a shift shows as an out-of-range id rather than as a number), and early enough that its
    destinations hold no stale copy of the same data."""
    e = next(k for k, s in enumerate(program.steps) if any(g.codelet == "embed" for g in s.compute))
    return next(k for k, s in enumerate(program.steps) if k > e and len(s.exchange))


def shift_transfer_destination(p: Program) -> None:
    ex = p.steps[first_activation_exchange(p)].exchange
    j = int(np.argmax(ex.rows * ex.row_bytes))  # the biggest transfer lands 4 bytes off
    ex.d_addr[ex.dst_start[j]] += 4


def shift_transfer_source(p: Program) -> None:
    ex = p.steps[first_activation_exchange(p)].exchange
    j = int(np.argmax(ex.rows * ex.row_bytes))  # the biggest transfer reads from 4 bytes further on
    ex.src_addr[j] += 4


def shift_operand_address(p: Program) -> None:
    # The last LayerNorm writes last_hidden_state directly: its first vertex reads its rows 4 bytes off.
    k = max(i for i, s in enumerate(p.steps) if any(gr.codelet.startswith("layernorm") for gr in s.compute))
    grp = next(gr for gr in p.steps[k].compute if gr.codelet.startswith("layernorm"))
    grp.addrs[0, 0] += 4


def drop_exchange(p: Program) -> None:
    k = first_exchange(p)
    p.steps[k].exchange = type(p.steps[k].exchange).empty()


def shift_weight_block(p: Program, shapes: dict[str, tuple[int, int]]) -> None:
    # The first block of layer 0's fc1 weight is loaded one row further down its matrix (one column across when the
    # block holds every row). (A query or key block moved so changes bert-tiny's outputs by ~1e-5 of their scale even
    # at fp32: its random-weight attention is near uniform, so no output tolerance can see that one; an MLP weight
    # feeds the outputs directly.)
    i = next(i for i, c in enumerate(p.consts) if "layer.0.intermediate.dense.weight" in c.name
             and c.r1 > c.r0 and c.c1 > c.c0)
    c = p.consts[i]
    rows, cols = shapes[c.name]
    if c.r1 < rows:
        p.consts[i] = dataclasses.replace(c, r0=c.r0 + 1, r1=c.r1 + 1)
    else:
        assert c.c1 < cols, "a block holding the whole matrix cannot move"
        p.consts[i] = dataclasses.replace(c, c0=c.c0 + 1, c1=c.c1 + 1)


def weight_shapes(s: Setup) -> dict[str, tuple[int, int]]:
    """Each constant viewed 2-D, as the Program's ConstImages see it."""
    assert s.res.graph is not None
    out = {}
    for n, c in s.res.graph.constants.items():
        shape = c.type.shape
        out[n] = (int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1]) if shape else 1)
    return out


MUTATIONS = {
    "transfer destination +4 B": lambda p, s: shift_transfer_destination(p),
    "transfer source +4 B": lambda p, s: shift_transfer_source(p),
    "operand address +4 B": lambda p, s: shift_operand_address(p),
    "dropped exchange": lambda p, s: drop_exchange(p),
    "weight block one row/column over": lambda p, s: shift_weight_block(p, weight_shapes(s)),
}


def test_unmutated_passes(setup):
    assert outcome(setup, setup.res.program, check=True) == "pass"
    assert outcome(setup, setup.res.program, check=False) == "pass"


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_is_caught(setup, mutation, check):
    p = copy.deepcopy(setup.res.program)
    MUTATIONS[mutation](p, setup)
    assert outcome(setup, p, check) != "pass", f"{mutation} at {setup.res.dtype} (check={check}) passed"


def test_dropped_exchange_fires_poison(setup):
    p = copy.deepcopy(setup.res.program)
    drop_exchange(p)
    assert outcome(setup, p, True) == "poison"


def test_overlapping_vertex_writes_fire(setup):
    p = copy.deepcopy(setup.res.program)
    k = next(i for i, s in enumerate(p.steps) if any(len(gr) > 1 for gr in s.compute))
    grp = next(gr for gr in p.steps[k].compute if len(gr) > 1)
    # Vertex 1 moves to vertex 0's tile and writes over vertex 0's output.
    grp.tiles[1] = grp.tiles[0]
    grp.addrs[1, -1] = grp.addrs[0, -1]
    assert outcome(setup, p, True) == "poison"


def merge_dependent_steps(p: Program) -> int:
    """Move the compute set of step k + 1 into step k, for the first k with no exchange between them whose next
    step reads bytes step k writes (a Sub merged into the step that produces its input). Returns k."""
    from tremula.codelets import codelet

    def ranges(step, written: bool) -> set[tuple[int, int, int]]:
        out = set()
        for g in step.compute:
            outs = codelet(g.codelet).written(len(g.dtypes))
            isz = np.array([np.dtype(d).itemsize for d in g.dtypes])
            for a in range(len(g.dtypes)):
                if (a in outs) == written:
                    nb = g.shapes[:, a, 0] * g.shapes[:, a, 1] * isz[a]
                    out |= {(int(t), int(s), int(s + n)) for t, s, n in zip(g.tiles, g.addrs[:, a], nb)}
        return out

    for k in range(len(p.steps) - 1):
        a, b = p.steps[k], p.steps[k + 1]
        if len(a.exchange) or not a.compute or not b.compute:
            continue
        w, r = ranges(a, True), ranges(b, False)
        if any(t == t2 and s < e2 and s2 < e for t, s, e in r for t2, s2, e2 in w):
            a.compute = a.compute + b.compute
            b.compute = []
            return k
    raise AssertionError("no two dependent steps without an exchange between them")


def test_read_after_write_race_in_a_compute_set_fires(setup):
    p = copy.deepcopy(setup.res.program)
    merge_dependent_steps(p)
    # Run in order, the merged step computes the same numbers: only the race check can see it.
    assert outcome(setup, p, check=False) == "pass"
    assert setup.res.graph is not None
    with pytest.raises(SimCheckError, match="read-after-write race"):
        simulate(p, setup.res.graph, setup.feeds, check=True)


def test_out_of_bounds_address_fires(setup):
    p = copy.deepcopy(setup.res.program)
    grp = p.steps[1].compute[0] if p.steps[1].compute else p.steps[2].compute[0]
    grp.addrs[0, 0] = p.sram_bytes_per_tile - 4
    assert setup.res.graph is not None
    with pytest.raises(SimCheckError, match="out of bounds|beyond"):
        simulate(p, setup.res.graph, setup.feeds, check=True)


# ------------------------------------------------------------------------------------- plans that change the program
# The plans the planner makes under pressure (forced as tests/models/test_check_tiny.py and test_shared_layers.py do):
# their Programs differ in kind (shared layer code, weights multicast from one copy, key-split attention in rounds),
# and a corruption of each must be caught as in the default plan.


def _force(monkeypatch, kind: str, dtype: str) -> tuple[str, int]:
    """Force plan `kind`; returns the chip and batch to compile for."""
    from tremula import compiler, pipeline
    from tremula.plan import lower_attention, lower_ops

    if kind == "shared layers":
        monkeypatch.setattr(pipeline, "PLAN_BUDGETS", ((0.12, None, True),))
    elif kind == "streamed weights":
        real = lower_ops.Lowerer.__init__

        def one_copy(self, *a, **k):
            real(self, *a, **k)
            self.pm_max = 1

        monkeypatch.setattr(lower_ops.Lowerer, "__init__", one_copy)
    elif kind == "attention in rounds":
        monkeypatch.setattr(lower_attention, "ATTENTION_KV_FRACTION", 1e-4)
        monkeypatch.setattr(lower_attention, "BUFFER_FRACTION", 1e-4)
        monkeypatch.setattr(compiler, "GROW_STEPS", 0)  # (a grown operand budget lifts the pressure: one round)
        # tiny16 has no FP8 unit: on the C600 it takes batch 8 for the query blocks to outnumber its tiles
        return ("c600", 8) if dtype == "fp8" else ("examples/chips/tiny16.toml", 2)
    return "c600", 2


def _is_kind(res: CompileResult, kind: str) -> bool:
    if kind == "shared layers":
        return res.shared_layers >= 1
    if kind == "streamed weights":
        return any(s.startswith("linear") and "streamed" in s for s in res.strategies.values())
    return any("partials (2/" in s.label for s in res.program.steps)


PLAN_KINDS = [("shared layers", "fp16"), ("shared layers", "fp8"), ("streamed weights", "fp16"),
              ("streamed weights", "fp8"), ("attention in rounds", "fp16"), ("attention in rounds", "fp8")]


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("kind,dtype", PLAN_KINDS)
def test_mutation_is_caught_in_plan_kind(monkeypatch, kind, dtype, mutation):
    s = _setup(dtype, kind, *_force(monkeypatch, kind, dtype))
    assert _is_kind(s.res, kind), f"the plan is not of kind {kind}"
    assert outcome(s, s.res.program, check=False) == "pass"
    p = copy.deepcopy(s.res.program)
    MUTATIONS[mutation](p, s)
    assert outcome(s, p, check=False) != "pass", f"{mutation} at {dtype} with {kind} passed"


# ----------------------------------------------------------------------------- the shared layers' calls are executed
# A shared layer's step holds no code: it calls its template step with a patch (its weight pointers and FP8 scales)
# and a weight base per tile. Corrupting either must show, as corrupting the code itself does.


def _first_call(p: Program, want) -> int:
    return next(k for k, s in enumerate(p.steps) if s.call is not None and want(s.call))


def _rewrites(c) -> bool:
    return any(f.words for f in c.fields)


def shift_call_field(p: Program) -> None:
    """A call rewrites its FP8 casts' scale (parameter 1 of fp8_cast) one power of two off: the simulator must run
    the template's code with the call's fields, not the template's. (The fields calls really rewrite here are the
    casts' seeds, which round-to-nearest ignores.)"""
    k = _first_call(p, _rewrites)
    tmpl = p.steps[p.steps[k].call.template]
    for f, g in zip(p.steps[k].call.fields, tmpl.compute):
        if g.codelet == "fp8_cast":
            f.param_cols = np.append(f.param_cols, 1)
            f.params = np.concatenate([f.params, g.params[:, 1:2] + 1], axis=1)
            return
    raise AssertionError("no FP8 cast in a called step")


def shift_call_base(p: Program) -> None:
    # The last call that sends weights (the first ones move query and key weights, which random-weight attention
    # hardly feels: see shift_weight_block).
    k = max(k for k, s in enumerate(p.steps) if s.call is not None and len(s.call.base))
    p.steps[k].call.base[:] += 4  # every tile sends this layer's weights from 4 bytes further on


def template_operand_shift(p: Program) -> None:
    """Shift an operand in a template step: every layer that calls it runs the shifted code."""
    t = next(s.call.template for s in p.steps if s.call is not None and p.steps[s.call.template].compute)
    grp = max(p.steps[t].compute, key=len)
    grp.addrs[:, -1] += 4  # its outputs land 4 bytes off


CALL_MUTATIONS = {"call's rewritten field": shift_call_field, "call's weight base +4 B": shift_call_base,
                  "template operand +4 B": template_operand_shift}


@pytest.mark.parametrize("mutation", list(CALL_MUTATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_call_mutation_is_caught(monkeypatch, dtype, mutation):
    s = _setup(dtype, "shared layers", *_force(monkeypatch, "shared layers", dtype))
    assert _is_kind(s.res, "shared layers") and len(s.res.program.shared_steps)
    p = copy.deepcopy(s.res.program)
    if mutation == "call's rewritten field" and not any(_rewrites(st.call) for st in p.steps if st.call is not None):
        pytest.skip(f"at {dtype} no call rewrites a vertex field (no FP8 scales; weights arrive by exchange)")
    CALL_MUTATIONS[mutation](p)
    assert outcome(s, p, check=False) != "pass", f"{mutation} at {dtype} passed"
