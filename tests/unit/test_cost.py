"""The one cost model: reproduces the measured Bow AMP curve, is monotone, and takes every constant from the Chip."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tremula.errors import TremulaError
from tremula.target import cost
from tremula.target.chip import Chip, builtin_chip_names, load_chip

CHIPS = {n: load_chip(n) for n in builtin_chip_names()}
PAIRS = [("fp32", "fp32"), ("fp16", "fp16"), ("fp16", "fp32"), ("fp8", "fp16")]


def _pairs(chip: Chip) -> list[tuple[str, str]]:
    return [(p.in_dtype, p.acc_dtype) for p in chip.amp]


def _with_pair(chip: Chip, key: str, **changes) -> Chip:
    amp = tuple(dataclasses.replace(p, **changes) if p.key == key else p for p in chip.amp)
    return dataclasses.replace(chip, amp=amp)


# ---- AMP ----------------------------------------------------------------------------------------------------------

# ipu-hardware.md §3: every one of the Bow's 1472 tiles runs an FP16 [N,16]x[16,16] AMP vertex (tessellate-ipu).
BOW_MEASURED_TFLOPS = {16: 55.5, 128: 211.1, 2048: 334.9}


@pytest.mark.parametrize("n_rows,measured", sorted(BOW_MEASURED_TFLOPS.items()))
def test_bow_amp_curve_within_10_percent(n_rows, measured):
    bow = CHIPS["bow"]
    cycles = cost.amp_matmul_cycles(bow, n_rows, 16, 16, "fp16", "fp16")
    tflops = 2 * n_rows * 16 * 16 * bow.tiles * bow.clock_hz / cycles / 1e12
    assert abs(tflops - measured) / measured < 0.10, (n_rows, cycles, tflops)


def test_bow_curve_shape_is_overhead_then_stream():
    # The curve must come from a fixed per-vertex overhead plus the 64 MAC/cycle stream (ref §3), so the marginal
    # cost of 6 more rows (one per worker) is exactly the core loop: 4 worker cycles x 6 workers = 24 tile cycles.
    bow = CHIPS["bow"]
    c = [cost.amp_matmul_cycles(bow, m, 16, 16, "fp16", "fp16") for m in (1200, 1206, 1212)]
    assert c[1] - c[0] == c[2] - c[1] == 6 * 4
    assert 16 * 16 * 6 / (c[1] - c[0]) == bow.amp_pair("fp16", "fp16").macs_per_cycle_per_tile


@pytest.mark.parametrize("name", list(CHIPS))
def test_amp_never_beats_peak(name):
    chip = CHIPS[name]
    for pair in _pairs(chip):
        for m, k, n in [(1, 1, 1), (6, 16, 16), (16, 16, 16), (7, 33, 17), (128, 64, 64), (600, 256, 48), (3000, 9, 8)]:
            for weights in (False, True):
                cycles = cost.amp_matmul_cycles(chip, m, k, n, *pair, weights=weights)
                assert isinstance(cycles, int)
                assert cycles >= cost.amp_peak_cycles(chip, m, k, n, *pair), (name, pair, m, k, n, weights)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 3000),
    k=st.integers(1, 300),
    n=st.integers(1, 300),
    dim=st.sampled_from("mkn"),
    pair=st.sampled_from(PAIRS),
    name=st.sampled_from(["mk1", "c600"]),
)
def test_amp_monotone_in_each_dimension_beyond_small_rows(m, k, n, dim, pair, name):
    chip = CHIPS[name]
    if not chip.supports(pair[0]) or (pair[0], pair[1]) not in _pairs(chip):
        return
    # poplibs' 2-row worker path costs more than its 3-row one, so rows are compared from 3 per worker upwards.
    m = max(m, 18)
    grown = {"m": (m + 1, k, n), "k": (m, k + 1, n), "n": (m, k, n + 1)}[dim]
    for w in (False, True):
        assert cost.amp_matmul_cycles(chip, *grown, *pair, weights=w) >= cost.amp_matmul_cycles(chip, m, k, n, *pair,
                                                                                                weights=w)


# ../shared/reference/ipu-stack-facts.md 2.1 [M]: kernels timed on a C600, (dtype, R, K, C) -> cycles: the
# interleaved-weight F16 GEMM's five calibration points and the FP8 kernels timed in full SigLIP so400m.
C600_WEIGHT_KERNELS = {("fp16", 184, 288, 48): 48_654, ("fp16", 182, 288, 48): 48_180, ("fp16", 184, 288, 32): 32_538,
                       ("fp16", 146, 576, 32): 53_718, ("fp16", 120, 80, 272): 55_344, ("fp8", 244, 128, 64): 18_576,
                       ("fp8", 82, 192, 160): 29_508, ("fp8", 122, 160, 128): 26_232, ("fp8", 146, 96, 48): 7_122,
                       ("fp8", 57, 128, 80): 8_124}


def test_c600_weights_kernel_is_within_2_percent_of_the_measured_kernels():
    """A Linear's stored weights on the C600 are priced by the measured kernel's formula (chips/c600.toml
    weights_kernel), which is within 2 % of every point; the ConvPartial1x1 estimate, which still prices activations
    as coefficients, is 2-6 % slower than the F16 points and 17-51 % slower than the FP8 ones."""
    c600 = CHIPS["c600"]
    for (dt, r, k, c), measured in C600_WEIGHT_KERNELS.items():
        kernel = cost.amp_matmul_cycles(c600, r, k, c, dt, "fp16", weights=True)
        estimate = cost.amp_matmul_cycles(c600, r, k, c, dt, "fp16")
        assert abs(kernel / measured - 1) <= 0.02, (dt, r, k, c, kernel, measured)
        assert estimate > 1.02 * measured, (dt, r, k, c, estimate, measured)
        # a later K round is the same kernel (no zeroing pass to save)
        assert cost.amp_matmul_cycles(c600, r, k, c, dt, "fp16", True, True) == kernel
    # float partials and other chips have no such kernel: weights or not, the estimate
    for chip, pair in ((c600, ("fp16", "fp32")), (CHIPS["bow"], ("fp16", "fp16")), (CHIPS["mk2"], ("fp16", "fp16"))):
        assert cost.amp_matmul_cycles(chip, 184, 288, 48, *pair, weights=True) == \
            cost.amp_matmul_cycles(chip, 184, 288, 48, *pair)


def test_a_weights_kernel_table_needs_all_its_fields(tmp_path):
    from importlib import resources

    text = (resources.files("tremula") / "chips" / "c600.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("group_cycles = 160\n", "", 1))
    with pytest.raises(TremulaError, match="weights_kernel.group_cycles"):
        load_chip(str(bad))


def test_amp_big_matmul_efficiency_and_dtype_ratio():
    mk2 = CHIPS["mk2"]
    m, k, n = 4096, 64, 64
    half = cost.amp_matmul_cycles(mk2, m, k, n, "fp16", "fp16")
    single = cost.amp_matmul_cycles(mk2, m, k, n, "fp32", "fp32")
    assert cost.amp_peak_cycles(mk2, m, k, n, "fp16", "fp16") / half > 0.9
    assert 3.5 < single / half < 4.5  # 64 vs 16 MAC/cycle, plus float's per-row zeroing on the first pass


def test_amp_accepts_numpy_dtype_names_and_rejects_unknown_paths():
    c600 = CHIPS["c600"]
    assert cost.amp_matmul_cycles(c600, 64, 64, 64, "float16", "float32") == cost.amp_matmul_cycles(
        c600, 64, 64, 64, "fp16", "fp32"
    )
    with pytest.raises(TremulaError, match="no AMP path fp8->fp32"):
        cost.amp_matmul_cycles(c600, 64, 64, 64, "fp8", "fp32")
    with pytest.raises(TremulaError, match="no AMP path fp8->fp16"):
        cost.amp_matmul_cycles(CHIPS["mk2"], 64, 64, 64, "fp8", "fp16")
    assert cost.amp_matmul_cycles(c600, 0, 64, 64, "fp16", "fp16") == 0
    with pytest.raises(TremulaError, match="non-negative integer"):
        cost.amp_matmul_cycles(c600, -1, 64, 64, "fp16", "fp16")


def test_amp_with_every_overhead_zeroed_is_the_pure_mac_stream():
    # If the code hid a constant of its own, zeroing every overhead in the Chip would leave it visible.
    mk2 = CHIPS["mk2"]
    pair = mk2.amp_pair("fp16", "fp16")
    core = pair.core_loop_worker_cycles
    bare = _with_pair(
        mk2, "fp16_fp16", supervisor_cycles=0, out_group_cycles=0, in_group_cycles=0, pass_cycles=0,
        worker_base_cycles=3 * core, worker_cycles_1_row=core, worker_cycles_2_rows=2 * core,
        zero_worker_cycles_per_row=0, worker_delta_cycles_without_zeroing=0, retention_worker_savings_cycles=0,
        retention_supervisor_cycles_per_input_group=0,
    )  # fmt: skip
    bare = dataclasses.replace(bare, amp_worker_tag_cycles=0, amp_coeff_load_bytes_per_cycle=10**9)
    m, k, n = 600, 3 * pair.weights_per_conv_unit, 2 * pair.conv_units
    passes = (k // pair.weights_per_conv_unit) * (n // pair.conv_units)
    weight_load = 1  # ceil(weight bytes / a huge load rate)
    assert cost.amp_matmul_cycles(bare, m, k, n, "fp16", "fp16") == passes * weight_load + round(
        cost.amp_peak_cycles(bare, m, k, n, "fp16", "fp16")
    )


@pytest.mark.parametrize(
    "field,delta,expected_change",
    [
        ("supervisor_cycles", 100, lambda p, ig, og: 100),
        ("pass_cycles", 10, lambda p, ig, og: 10 * ig * og),
        ("out_group_cycles", 7, lambda p, ig, og: 7 * og),
        ("in_group_cycles", 5, lambda p, ig, og: 5 * (ig - 1)),
    ],
)
def test_amp_overheads_come_from_the_chip(field, delta, expected_change):
    bow = CHIPS["bow"]
    pair = bow.amp_pair("fp16", "fp16")
    m, k, n = 96, 64, 48
    ig, og = 64 // pair.weights_per_conv_unit, 48 // pair.conv_units
    changed = _with_pair(bow, "fp16_fp16", **{field: getattr(pair, field) + delta})
    before = cost.amp_matmul_cycles(bow, m, k, n, "fp16", "fp16")
    diff = cost.amp_matmul_cycles(changed, m, k, n, "fp16", "fp16") - before
    assert diff == expected_change(pair, ig, og)


def test_amp_weight_load_rate_and_workers_come_from_the_chip():
    bow = CHIPS["bow"]
    base = cost.amp_matmul_cycles(bow, 96, 16, 16, "fp16", "fp16")
    faster_loads = dataclasses.replace(bow, amp_coeff_load_bytes_per_cycle=2 * bow.amp_coeff_load_bytes_per_cycle)
    # One pass: the weight load (16 units x 16 weights x 2 B / 16 B per cycle = 32 cycles) halves.
    assert base - cost.amp_matmul_cycles(faster_loads, 96, 16, 16, "fp16", "fp16") == 16
    assert cost.amp_matmul_cycles(dataclasses.replace(bow, workers_per_tile=12), 96, 16, 16, "fp16", "fp16") != base


# ---- vector, reduce, composites -----------------------------------------------------------------------------------


def test_vector_formula_matches_popops_binary_op():
    # ref §3: BinaryOp1D ~ 6 x (26 half + ceil(ceil(n/6)/4) x 1) + 11 for ADD.
    mk2 = CHIPS["mk2"]
    for n in (1, 6, 24, 1000, 4097):
        assert cost.vector_cycles(mk2, "add", n, "fp16") == 6 * (26 + -(-(-(-n // 6)) // 4)) + 11
        assert cost.vector_cycles(mk2, "add", n, "float32") == 6 * (29 + -(-(-(-n // 6)) // 2)) + 11
    assert cost.vector_cycles(mk2, "add", 0, "fp16") == 0


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 100_000), op=st.sampled_from(["add", "mul", "exp", "tanh", "rsqrt", "divide", "cast"]))
def test_vector_monotone(n, op):
    for chip in (CHIPS["mk1"], CHIPS["c600"]):
        for dtype in ("fp16", "fp32", "fp8"):
            assert cost.vector_cycles(chip, op, n + 1, dtype) >= cost.vector_cycles(chip, op, n, dtype)


def test_vector_costs_come_from_the_chip():
    mk2 = CHIPS["mk2"]
    zero = dataclasses.replace(mk2, vector_supervisor_cycles=0, vector_fp16_worker_cycles=0)
    exp = mk2.vector_op("exp")
    n = 6 * exp.fp16_elems_per_loop * 10
    assert cost.vector_cycles(zero, "exp", n, "fp16") == 6 * 10 * exp.fp16_cycles_per_loop
    assert cost.vector_cycles(mk2, "exp", n, "fp16") - cost.vector_cycles(zero, "exp", n, "fp16") == 11 + 6 * 26
    # FP8 element-wise work runs in half (ref §5).
    assert cost.vector_cycles(mk2, "exp", n, "fp8") == cost.vector_cycles(mk2, "exp", n, "fp16")
    with pytest.raises(TremulaError, match="no vector cost for op 'erf'"):
        cost.vector_cycles(mk2, "erf", 10, "fp16")


def test_reduce_formula_and_monotonicity():
    mk2 = CHIPS["mk2"]
    # ref §3: (20 + (1 x partials + 10) x ceil(outputs / 6)) x 6 + 33, partials = ceil(len / 4) for float.
    assert cost.reduce_cycles(mk2, 12, 768, "fp32") == (20 + (192 + 10) * 2) * 6 + 33
    assert cost.reduce_cycles(mk2, 12, 768, "fp16") == (20 + (96 + 10) * 2) * 6 + 33
    prev = 0
    for rows in range(0, 40):
        cur = cost.reduce_cycles(mk2, rows, 197, "fp32")
        assert cur >= prev
        prev = cur


@pytest.mark.parametrize("fn", [cost.softmax_cycles, cost.layernorm_cycles])
def test_row_ops_monotone_and_above_their_parts(fn):
    c600 = CHIPS["c600"]
    prev = 0
    for rows in (0, 1, 6, 7, 50, 197):
        cur = fn(c600, rows, 768, "fp16")
        assert cur >= prev
        prev = cur
    assert fn(c600, 16, 768, "fp16") > cost.reduce_cycles(c600, 16, 768, "fp32") + cost.vector_cycles(
        c600, "mul", 16 * 768, "fp16"
    )


def test_gelu_is_its_elementwise_steps():
    bow = CHIPS["bow"]
    n = 3072
    steps = 5 * cost.vector_cycles(bow, "mul", n, "fp16") + 2 * cost.vector_cycles(bow, "add", n, "fp16")
    assert cost.gelu_cycles(bow, n, "fp16") == steps + cost.vector_cycles(bow, "tanh", n, "fp16")
    assert cost.gelu_cycles(bow, 0, "fp16") == 0


def test_c600_half_gelu_is_the_fastest_kernel_measured_there():
    """../shared/reference/ipu-stack-facts.md 2.2: the f16v4mix Bias+GeLU kernel took 8,550 cycles for one row of
    2,152 half elements and 25,206 for three (the plain GeLU kernel: 12,060 for 2,208, slower)."""
    c600 = CHIPS["c600"]
    for n, measured in ((2152, 8_550), (3 * 2152, 25_206)):
        assert abs(cost.gelu_cycles(c600, n, "fp16") / measured - 1) <= 0.005
    assert cost.gelu_cycles(c600, 2208, "fp16") < 330 + 510 * 23  # the plain kernel's 12,060
    assert cost.gelu_cycles(c600, 16 * 7 + 1, "float16") == 222 + 62 * 8
    assert cost.gelu_cycles(c600, 0, "fp16") == 0
    # float32 has no measured kernel: its elementwise steps, as on a chip without the table
    plain = dataclasses.replace(c600, gelu_fp16=None)
    assert cost.gelu_cycles(c600, 2208, "fp32") == cost.gelu_cycles(plain, 2208, "fp32")
    assert cost.gelu_cycles(plain, 2208, "fp16") == 7_408 != cost.gelu_cycles(c600, 2208, "fp16")


def test_a_measured_gelu_table_needs_all_its_fields(tmp_path):
    from importlib import resources

    text = (resources.files("tremula") / "chips" / "c600.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("block_elems = 16\n", ""))
    with pytest.raises(TremulaError, match="gelu_fp16.block_elems"):
        load_chip(str(bad))


# ---- copy, exchange, sync, host -----------------------------------------------------------------------------------


def test_copy_at_local_load_bandwidth():
    mk2 = CHIPS["mk2"]
    assert cost.copy_cycles(mk2, 1600) == 1600 // mk2.local_load_bytes_per_cycle
    assert cost.copy_cycles(mk2, 1) == 1
    wide = dataclasses.replace(mk2, local_load_bytes_per_cycle=2 * mk2.local_load_bytes_per_cycle)
    assert cost.copy_cycles(wide, 1600) * 2 == cost.copy_cycles(mk2, 1600)


def test_exchange_is_fixed_plus_busiest_tile_stream():
    mk2 = CHIPS["mk2"]
    fixed = mk2.exchange_fixed_cycles
    assert cost.exchange_cycles(mk2, 4000, 1000) == fixed + 1000
    assert cost.exchange_cycles(mk2, 1000, 4000) == fixed + 1000
    assert cost.exchange_cycles(mk2, 0, 0) == 0
    assert cost.exchange_cycles(mk2, 1, 0) == fixed + 1


def test_doubling_exchange_bandwidth_halves_the_streaming_part():
    mk2 = CHIPS["mk2"]
    fast = dataclasses.replace(
        mk2,
        exchange_send_bytes_per_cycle_per_tile=2 * mk2.exchange_send_bytes_per_cycle_per_tile,
        exchange_recv_bytes_per_cycle_per_tile=2 * mk2.exchange_recv_bytes_per_cycle_per_tile,
    )
    for sent, recv in [(8000, 0), (800, 16000), (64, 64)]:
        slow_stream = cost.exchange_cycles(mk2, sent, recv) - mk2.exchange_fixed_cycles
        fast_stream = cost.exchange_cycles(fast, sent, recv) - fast.exchange_fixed_cycles
        assert slow_stream == 2 * fast_stream
    later = dataclasses.replace(mk2, exchange_fixed_cycles=mk2.exchange_fixed_cycles + 50)
    assert cost.exchange_cycles(later, 800, 800) == cost.exchange_cycles(mk2, 800, 800) + 50


@settings(max_examples=50, deadline=None)
@given(s=st.integers(0, 10**7), r=st.integers(0, 10**7), ds=st.integers(0, 1000), dr=st.integers(0, 1000))
def test_exchange_monotone(s, r, ds, dr):
    bow = CHIPS["bow"]
    assert cost.exchange_cycles(bow, s + ds, r + dr) >= cost.exchange_cycles(bow, s, r)


def test_sync_and_host_come_from_the_chip():
    for chip in CHIPS.values():
        assert cost.sync_cycles(chip) == chip.sync_cycles
    mk2 = CHIPS["mk2"]
    assert cost.sync_cycles(dataclasses.replace(mk2, sync_cycles=7)) == 7
    nbytes = 12_500_000  # 1 ms at 12.5 GB/s
    assert cost.host_transfer_cycles(mk2, nbytes) == round(1e-3 * mk2.clock_hz)
    fast = dataclasses.replace(mk2, host_bytes_per_second=2 * mk2.host_bytes_per_second)
    assert cost.host_transfer_cycles(fast, nbytes) * 2 == cost.host_transfer_cycles(mk2, nbytes)
    assert cost.host_transfer_cycles(mk2, 0) == 0
    assert cost.cycles_to_seconds(mk2, mk2.clock_hz) == 1.0
