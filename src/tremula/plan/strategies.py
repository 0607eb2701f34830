"""Strategy search: enumerate candidate partitions of an op over the tiles and keep the cheapest by the cost model.

The memory fractions below are the planner's budgets for one op's share of a tile (a search heuristic, not a chip fact);
whether the whole program fits is decided by the real memory plan afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tremula.numerics.fp8 import is_fp8
from tremula.target import cost_terms

WEIGHT_FRACTION = 0.5  # of a tile's SRAM that all resident matmul weights together may take
TEMP_FRACTION = 0.12  # of a tile's SRAM that one op's gathered operand block may take (serial splits beyond that)
# of a tile's SRAM that one op's temporaries (gathered operand, partials, received slices, output) may take; scaled
# down with temp_fraction when the compiler retries with smaller blocks
BUFFER_FRACTION = 0.2
# of what a tile has left after code and one copy of the weights, that one op's temporaries may take in the first,
# fastest plan (context.free_temp_fraction): the other half holds the live activations and the next op's operands.
# A planner heuristic, not a chip fact: plans that do not fit are retried with the fixed fractions above.
FREE_SHARE = 0.5
# of a tile's SRAM that one block of a row-layout activation may take (more row parts beyond that)
ROW_BLOCK_FRACTION = 0.02
# of a tile's SRAM that one matmul's weight block may take: weights are placed block by block on the least-loaded
# tiles, so the block size bounds how unevenly they end up (SigLIP so400m's fc2 on 48 tiles, 103 KB blocks, left two
# on one tile: 206 KB against a 291 KB mean of all weights); at the fixed operand budget, scaled with it
# (weight_block_budget)
WEIGHT_BLOCK_FRACTION = 0.05
# of a tile's SRAM that a lookup table copied to every tile of its output's rows may take (lower_gather._lookup_rows;
# BERT's token types, 2 x 768 halves, 3 KB); larger tables are spread by columns
SMALL_TABLE_FRACTION = 0.01
# of a tile's SRAM that one attention head's K and V may take on a tile; beyond it the keys are split over tiles
ATTENTION_KV_FRACTION = 0.08


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def weight_block_budget(chip, temp_fraction: float) -> float:
    """Bytes one matmul weight block may take on a tile: WEIGHT_BLOCK_FRACTION of its SRAM, scaled as the buffer
    budget is, by the operand budget against the fixed one (a plan from free bytes, context.free_temp_fraction,
    allows bigger blocks where the tiles have room for the unevenness they bring)."""
    return WEIGHT_BLOCK_FRACTION * temp_fraction / TEMP_FRACTION * chip.sram_bytes_per_tile


@dataclass(frozen=True)
class LinearStrategy:
    pm: int  # M (rows) split over tiles
    pn: int  # N (output columns) split over tiles
    pk: int  # K split over tiles: partial sums, then a reduce step on the owner of each row slice
    serial: int  # rounds over each tile's rows, so the gathered x block fits the temp budget
    cycles: int  # estimated cycles (compute + exchange + sync) of the whole op
    bytes_per_tile: int  # weights + gathered operands + partials + output on the busiest tile
    # The weights live once, on the pn * pk tiles of row group 0, and are multicast to the other pm - 1 row groups'
    # temporary buffers each time the op runs (instead of pm resident copies): row groups beyond what SRAM can hold
    # copies of, for a few KB of exchange per tile.
    stream: bool = False
    over: int = 0  # bytes by which the busiest tile passes the planner's budgets (0: within them)
    # Rounds over each tile's K slice within a round of rows: each gathers one chunk of the slice's columns and the
    # AMP adds its products into the same running partials (output-stationary), so a round's rows can be many while
    # its gathered block stays small. Half partials only (fp16 with half partials, FP8): chunks of whole AMP groups
    # continue the running half sum exactly as one vertex would. kchunk: the columns of each K round (0: one round).
    kchunk: int = 0

    def __str__(self) -> str:
        return (f"linear pm={self.pm} pn={self.pn} pk={self.pk} serial={self.serial}"
                f"{f' kchunk={self.kchunk}' if self.kchunk else ''}"
                f"{' streamed' if self.stream else ''} ~{self.cycles} cycles ~{self.bytes_per_tile} B/tile")


def _candidates(n: int, limit: int) -> list[int]:
    """Split counts worth trying: powers of two, and the counts that make equal blocks of power-of-two-ish sizes."""
    c = {1, min(n, limit)}
    p = 1
    while p <= min(n, limit):
        c.add(p)
        c.add(cdiv(n, cdiv(n, p)))  # the fewest parts with blocks of size ceil(n / p)
        p *= 2
    for d in (3, 6, 12, 24, 48, 96, 192, 384, 768):
        if d <= min(n, limit):
            c.add(d)
    return sorted(x for x in c if 1 <= x <= min(n, limit))


@dataclass(frozen=True)
class SourceShape:
    """What the planner knows of a Linear's surroundings when pricing its permanent bytes."""
    row_block: int  # rows per block of the operand's layout
    col_block: int  # columns per block of the operand's layout (== k when it holds whole rows)
    out_rows: bool  # the consumer needs whole rows of the output (a row op or a re-layout), not column blocks
    n_linear: int  # matmuls in the graph: they share the permanent budget
    col_parts: int = 0  # the operand's column blocks are even_cuts(k, col_parts) (0: they are not)


def permanent_bytes(chip, src: SourceShape, rows: int, serial: int, kl: int, pk: int, pn: int,
                    bias: bool = True) -> int:
    """Vertex state + exchange code one Linear candidate leaves on each of its tiles (the model of overheads.py).

    A transfer costs each side one set-up instruction plus one per row where that side's rows are not back to back
    (overheads.side_instructions). Gathering a K-slice of rows into the contiguous operand buffer: the receiver
    re-points per row only when the slice comes from several source blocks; the sender re-points per row when its
    blocks are wider than the slice, and that send is multicast to the pn tiles that share the slice.
    """
    from tremula.target.overheads import BYTES_PER_OPERAND, BYTES_PER_PARAM, VERTEX_HEADER_BYTES

    instr = getattr(chip, "exchange_instruction_bytes", 4)
    vs = VERTEX_HEADER_BYTES + BYTES_PER_OPERAND * (3 + bias) + BYTES_PER_PARAM
    nrb = cdiv(rows, max(src.row_block, 1)) + 1  # source row blocks a round's rows touch
    # each piece is a whole source block row range, contiguous on both sides: the K cuts are the operand's own
    whole = src.col_block == kl or (src.col_parts > 1 and pk == src.col_parts)
    ncb = 1 if whole else cdiv(kl, max(src.col_block, 1)) + 1
    pieces = nrb * ncb
    recv = pieces + (rows * ncb if ncb > 1 else 0)
    send = pieces if whole else cdiv(rows * ncb, pn)
    code = recv + send
    if pk > 1:
        vs += VERTEX_HEADER_BYTES + BYTES_PER_OPERAND * (3 + bias) + 2 * BYTES_PER_PARAM
        code += 4 * (pk - 1)  # reduce-scatter: contiguous slices sent and received
    if src.out_rows and pn > 1:  # each output row of this tile's block is a separate row of the re-layout
        code += 2 * (cdiv(rows, pk) + 1)
    return int(serial * (vs + instr * code))


def _gather_round_cycles(chip, m: int, k: int, isz: int, pm: int, pk: int, serial: int, kserial: int = 1,
                         kc: int = 0) -> int:
    """Cycles of one round's operand gather: each tile receives its rows' K slice of x (sent by the tiles that hold
    x, about evenly), or one chunk of kc of its columns when the slice is gathered in kserial rounds, and the sync
    that opens the exchange."""
    rows = cdiv(cdiv(m, pm), serial)
    recv = rows * (kc or cdiv(k, pk)) * isz
    sent = cdiv(m * k * isz, min(chip.tiles, m * pk)) // (serial * kserial)
    return cost_terms.exchange_cycles(chip, sent, recv) + cost_terms.sync_cycles(chip)


def k_chunk(kl: int, kserial: int, group: int) -> int:
    """Columns per K round when a K slice of kl is gathered in kserial rounds: whole AMP groups (the running half
    partial is rounded after each group, so a chunk of whole groups continues it as one vertex would)."""
    return kl if kserial <= 1 else cdiv(cdiv(kl, kserial), group) * group


def k_rounds_cycles(chip, rows: int, kl: int, kc: int, nj: int, dtype: str, partials: str) -> int:
    """AMP cycles of [rows, kl] x [kl, nj] in K rounds of kc columns (one vertex when kc >= kl): the first round
    zeroes the partials, the later ones add into them (cost.amp_matmul_cycles accumulate)."""
    if kc >= kl:
        return cost_terms.matmul_cycles(chip, rows, kl, nj, dtype, partials, weights=True)
    ks = cdiv(kl, kc)
    last = kl - (ks - 1) * kc
    return (cost_terms.matmul_cycles(chip, rows, kc, nj, dtype, partials, weights=True)
            + (ks - 2) * cost_terms.matmul_cycles(chip, rows, kc, nj, dtype, partials, True, True)
            + cost_terms.matmul_cycles(chip, rows, last, nj, dtype, partials, True, True))


def operand_gather_cycles(chip, m: int, k: int, dtype: str, st: LinearStrategy) -> int:
    """The part of st.cycles that gathers x: what a projection lowered apart saves on each part after the first
    when the parts share one gathered operand (plan/lower_linear.py _fused_apart)."""
    isz, kl = np.dtype(dtype).itemsize, cdiv(k, st.pk)
    ks = cdiv(kl, st.kchunk or kl)
    return st.serial * ks * _gather_round_cycles(chip, m, k, isz, st.pm, st.pk, st.serial, ks, st.kchunk)


def _rounds(mi: int, kl: int, isz: int, temp_budget: float, group: int) -> list[tuple[int, int, int]]:
    """(row rounds, K rounds, K chunk) worth pricing for a tile's mi rows and kl columns: the fewest row rounds whose
    gathered block fits the operand budget, and 2x and 4x that (more rounds shrink the partials; the permanent bytes
    grow with them); with `group` (half partials) also K in 2, 4 and 8 rounds of whole groups, which keep more rows
    per round (the AMP's per-pass overheads are paid per round, so few rows are slow: SigLIP so400m fp8 b8's fc1 at
    73 rows a round runs at 45 % of the AMP's peak; ViT-B fp16 b32's fc1 and fc2 in K rounds: 3,304 -> 3,413 img/s)."""
    out, seen = [], set()
    for ks in [1] + ([2, 4, 8] if group else []):
        kc = k_chunk(kl, ks, group)
        if kc in seen or (ks > 1 and kc >= kl):
            continue
        seen.add(kc)
        s0 = max(1, min(mi, cdiv(mi * kc * isz, int(temp_budget))))
        out += [(serial, cdiv(kl, kc), kc) for serial in sorted({s0, min(mi, 2 * s0), min(mi, 4 * s0)})]
    return out


@lru_cache(maxsize=4096)
def choose_linear(chip, m: int, k: int, n: int, dtype: str, pm_max: int,
                  temp_fraction: float = TEMP_FRACTION, src: SourceShape | None = None,
                  perm_fraction: float | None = None, pn_fix: int = 0, pk_fix: int = 0,
                  partials: str = "float", k_rounds: str = "free") -> LinearStrategy:
    """Pick (pm, pn, pk, serial) minimising estimated cycles, subject to the weight, temp and permanent budgets.
    partials "half": the AMP's half partials (passes/precision.with_partials), priced on their AMP path, and split-K
    partials exchanged and summed in half.

    perm_fraction (with src): the share of a tile's SRAM that the permanent bytes (vertex state + exchange code) of
    all matmuls together may take; None leaves them unbudgeted (the fastest plans, when they fit).

    pn_fix / pk_fix (when not 0): only that many output-column / K parts (see choose_linear_pair).

    k_rounds: "free" prices K rounds (LinearStrategy.kchunk) like every other candidate; "lean" takes them only where
    they need no more bytes on the tile than the best plan without them (pipeline.plan_graph's retry when a plan
    with free K rounds does not fit); "none" never.

    Cached on its arguments: identical layers (same shapes) are planned once.
    """
    best, rounds = _priced(chip, m, k, n, dtype, pm_max, temp_fraction, src, perm_fraction, pn_fix, pk_fix, partials,
                           k_rounds != "none")
    # Lean: K rounds only where they take no more of the tile than the best plan without them. The budgets (_priced)
    # are heuristics: a K-round plan that spends more of them on its larger rounds made BERT-base fp16 batch 128's
    # fastest plan 51 KB fuller, and it did not fit.
    if k_rounds == "lean":
        rounds = tuple(r for r in rounds if r.over <= best.over and r.bytes_per_tile <= best.bytes_per_tile)
    return min((best,) + rounds, key=lambda r: (r.over, r.cycles))  # (one round on a tie)


@lru_cache(maxsize=4096)
def _priced(chip, m: int, k: int, n: int, dtype: str, pm_max: int, temp_fraction: float, src: SourceShape | None,
            perm_fraction: float | None, pn_fix: int, pk_fix: int, partials: str,
            with_rounds: bool) -> tuple[LinearStrategy, tuple[LinearStrategy, ...]]:
    """choose_linear's candidates: (the cheapest without K rounds, every candidate in K rounds), by (bytes over the
    budgets, cycles); a plan and its lean retry price them once."""
    tiles, sram = chip.tiles, chip.sram_bytes_per_tile
    # A fixed cut is a preference (whole source blocks, contiguous gathers), not a need: on a chip with fewer tiles
    # than the cut has parts (12 heads on a 3-tile chip) it is dropped, else no candidate would be left.
    pn_fix, pk_fix = (pn_fix if pn_fix <= tiles else 0), (pk_fix if pk_fix <= tiles else 0)
    if pn_fix * pk_fix > tiles:  # both fixed but not on one chip: keep the K cut (it decides the gathers' shape)
        pn_fix = 0
    isz = np.dtype(dtype).itemsize
    fp8 = is_fp8(dtype)
    osz = 2 if fp8 else isz  # FP8 in, half out
    half = partials == "half" and (dtype == "float16" or fp8)
    psz = 2 if fp8 or half else 4  # split-K partials: the FP8 AMP's are half, and half partials
    temp_budget = max(temp_fraction * sram, 1)
    # K rounds need half partials (their running sum is continued exactly); their chunks are whole AMP groups
    group = chip.amp_pair("fp8" if fp8 else "fp16", "fp16").weights_per_conv_unit if (fp8 or half) and \
        with_rounds else 0
    block_budget = weight_block_budget(chip, temp_fraction)
    sync = cost_terms.sync_cycles(chip)
    best: LinearStrategy | None = None  # the cheapest without K rounds
    rounds: list[LinearStrategy] = []  # candidates in K rounds
    for pn in [pn_fix] if pn_fix else _candidates(n, tiles):
        nj = cdiv(n, pn)
        for pk in [pk_fix] if pk_fix else _candidates(k, tiles // pn):
            if pn * pk > tiles:
                continue
            kl = cdiv(k, pk)
            wbytes = k * n * isz // (pn * pk)
            rep = max(1, min(m, tiles // (pn * pk), pm_max))
            full = max(1, min(m, tiles // (pn * pk)))
            for pm, stream in [(rep, False)] + ([(full, True)] if full > rep else []):
                mi = cdiv(m, pm)
                for serial, ks, kc in _rounds(mi, kl, isz, temp_budget, group):
                    rows = cdiv(mi, serial)
                    comp = k_rounds_cycles(chip, rows, kl, kc, nj, dtype, partials)
                    ex = ks * _gather_round_cycles(chip, m, k, isz, pm, pk, serial, ks, kc)
                    mem = wbytes + rows * kc * isz + mi * nj * osz // pk
                    if pk > 1:
                        sub = cdiv(rows, pk)
                        part = rows * nj * psz
                        comp += cost_terms.vector_cycles(chip, "add", sub * nj * pk, "float16" if half else "float32")
                        ex += cost_terms.exchange_cycles(chip, part - sub * nj * psz, (pk - 1) * sub * nj * psz) + sync
                        mem += part + (pk - 1) * sub * nj * psz
                    total = serial * (comp + ex)
                    if stream:  # one multicast of each weight block to its pm - 1 temporary copies
                        total += cost_terms.exchange_cycles(chip, wbytes, wbytes) + sync
                    over = max(0, mem - (WEIGHT_FRACTION + temp_fraction) * sram)
                    temps = mem - (0 if stream else wbytes)  # streamed weights are temporaries on pm - 1 groups
                    over += max(0, temps - BUFFER_FRACTION * temp_fraction / TEMP_FRACTION * sram)
                    over += max(0, wbytes - block_budget)
                    if src is not None and perm_fraction is not None:
                        # The permanent budget is shared by the matmuls that land on a tile: fewer when this one uses
                        # fewer tiles (weights rotate over all tiles), but at most half as many: a matmul on few tiles
                        # is not free (SigLIP so400m at batch 2 put fc2 on 192 tiles in 12 rounds, 6x the cycles of
                        # 7 row groups, to fit the budget share it had inflated that way).
                        used = max(pm * pn * pk, tiles // 2)
                        share = max(1.0, src.n_linear * used / tiles)
                        perm = permanent_bytes(chip, src, rows, serial * ks, kc, pk, pn)
                        over += max(0, perm - perm_fraction * sram / share)
                    cand = LinearStrategy(pm, pn, pk, serial, int(total), int(mem), stream, int(over),
                                          kc if ks > 1 else 0)
                    if ks > 1:
                        rounds.append(cand)
                    elif best is None or (over, total) < (best.over, best.cycles):
                        best = cand
    assert best is not None
    return best, tuple(rounds)


@lru_cache(maxsize=1024)
def choose_linear_pair(chip, m: int, k: int, n: int, n2: int, dtype: str, dtype2: str, pm_max: int,
                       temp_fraction: float = TEMP_FRACTION, src: SourceShape | None = None,
                       perm_fraction: float | None = None, pk_fix: int = 0,
                       pn2_fix: int = 0, partials: str = "float",
                       partials2: str = "float", k_rounds: str = "free",
                       temp_fraction2: float | None = None) -> tuple[LinearStrategy, LinearStrategy]:
    """Strategies for x[m, k] @ W1[k, n] followed (through element-wise ops) by h[m, n] @ W2[n, n2], such that the
    second's K parts are exactly the first's output-column blocks: every tile of the second then gathers whole
    source blocks, contiguous on both sides, and its exchange code does not grow with the rows (mismatched cuts
    cost one instruction per row and block on both sides: SigLIP so400m's fc2 took 140 of its 190 KB of exchange
    code per tile at batch 1). Minimises the two ops' cycles, over the first's column splits that the second can
    use as K splits. pk_fix: the first's K parts, pn2_fix: the second's output-column parts, when fixed. k_rounds: as
    in choose_linear, for both. temp_fraction2: the second's operand budget, when not the first's."""
    # As in choose_linear: a fixed cut with more parts than the chip has tiles is dropped (pn = 1 then always fits).
    pk_fix, pn2_fix = (pk_fix if pk_fix <= chip.tiles else 0), (pn2_fix if pn2_fix <= chip.tiles else 0)
    best: tuple | None = None
    for pn in _candidates(n, chip.tiles // max(pk_fix, 1)):
        first = choose_linear(chip, m, k, n, dtype, pm_max, temp_fraction, src, perm_fraction, pn_fix=pn,
                              pk_fix=pk_fix, partials=partials, k_rounds=k_rounds)
        src2 = None if src is None else SourceShape(cdiv(m, first.pm), cdiv(n, pn), src.out_rows, src.n_linear, pn)
        if pn * max(pn2_fix, 1) > chip.tiles:
            continue
        second = choose_linear(chip, m, n, n2, dtype2, pm_max, temp_fraction if temp_fraction2 is None else
                               temp_fraction2, src2, perm_fraction, pn_fix=pn2_fix,
                               pk_fix=pn, partials=partials2, k_rounds=k_rounds)
        key = (first.over + second.over, first.cycles + second.cycles, pn)
        if best is None or key < best[0]:
            best = (key, (first, second))
    assert best is not None
    return best[1]
