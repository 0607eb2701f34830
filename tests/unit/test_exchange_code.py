"""Exchange and control code bytes by the chip's encoding model (target/overheads.py, ipu-stack-facts §1.2), and the
code region that instructions must fit (ipu-stack-facts §3)."""

import dataclasses

import numpy as np
import pytest

from tremula.compiler import DoesNotFit, compile_model
from tremula.program import Step, TransferTable
from tremula.target.chip import load_chip
from tremula.target.overheads import reserved_bytes, transfer_code_bytes

I32, I64 = np.int32, np.int64


def table(src_tile, src_addr, rows, row_bytes, src_stride, dests) -> TransferTable:
    """dests: per transfer, a list of (tile, addr, stride)."""
    starts = np.cumsum([0] + [len(d) for d in dests])
    flat = [x for d in dests for x in d]
    return TransferTable(np.array(src_tile, I32), np.array(src_addr, I64), np.array(rows, I64),
                         np.array(row_bytes, I64), np.array(src_stride, I64), starts.astype(I64),
                         np.array([d[0] for d in flat], I32), np.array([d[1] for d in flat], I64),
                         np.array([d[2] for d in flat], I64))


@pytest.fixture(scope="module")
def c600():
    return load_chip("c600")


def test_sdk_receiver_row_of_four_back_to_back_messages(c600):
    # ipu-stack-facts §1.2: four back-to-back 52-word messages into one tile decode to a 40-byte receiver row.
    t = table([1, 2, 3, 4], [0] * 4, [1] * 4, [208] * 4, [208] * 4, [[(0, 208 * i, 208)] for i in range(4)])
    got = reserved_bytes(5, [Step([], t)], c600)["exchange_code"]
    assert got[0] == 40
    assert list(got[1:]) == [8 + 8] * 4  # one short send each, plus the phase entry/return


def test_sends_long_strided_and_multicast(c600):
    enc = c600.exchange_code
    t = table([0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 3, 1], [256, 260, 16, 4 * (64 + 4096 + 1)], [256, 260, 64, 0],
              [[(1, 0, 256)], [(2, 0, 260)], [(3, 0, 16)], [(4, 0, 0), (5, 0, 0), (6, 0, 0)]])
    send, _ = transfer_code_bytes(t, c600)
    assert send[0] == enc.send_bytes  # 64 words: one send
    assert send[1] == enc.send_bytes + enc.continue_bytes  # 65 words: a continuation
    assert send[2] == 3 * enc.send_bytes  # three strided rows: three sends (no constant-stride mode)
    assert send[3] == enc.send_bytes + 2 * enc.continue_bytes  # a multicast is sent once, whatever its receivers


def test_receive_pointer_resets(c600):
    enc = c600.exchange_code
    # Tile 9 receives two contiguous pieces, one with a gap before it, and one strided piece of 4 rows.
    t = table([1, 2, 3, 4], [0] * 4, [1, 1, 1, 4], [64, 64, 64, 16], [64, 64, 64, 16],
              [[(9, 0, 64)], [(9, 64, 64)], [(9, 1000, 64)], [(9, 4000, 64)]])
    _, recv = transfer_code_bytes(t, c600)
    r, p = enc.receive_bytes, enc.pointer_reset_bytes
    assert list(recv) == [r, r, r + p, r + p + 3 * p]


def test_control_code_grows_with_steps(c600):
    empty = Step([], TransferTable.empty())
    one = reserved_bytes(4, [empty], c600)["code"]
    ten = reserved_bytes(4, [empty] * 10, c600)["code"]
    assert list(ten - one) == [9 * c600.exchange_code.control_bytes_per_step] * 4


def test_instructions_must_fit_the_code_region():
    chip = load_chip("c600")
    res = compile_model("bert-tiny", chip, batch=2, dtype="fp16")
    instructions = res.memory_by_category["code"] + res.memory_by_category["exchange_code"]
    small = dataclasses.replace(chip, non_interleaved_bytes_per_tile=instructions // 2)
    with pytest.raises(DoesNotFit, match="code region"):
        compile_model("bert-tiny", small, batch=2, dtype="fp16")


@pytest.mark.parametrize("seed", range(4))
def test_a_table_priced_per_transfer_sums_per_tile_as_priced_per_piece_of_a_row(c600, seed):
    """The shortcuts (a send that is one run priced without its rows; receives that are all strided priced without
    sorting them by address) give each tile the code bytes of the model applied entry by entry: a sender sends each
    row of a strided source on its own, else the whole range; a receiver takes its receives in address order, one
    receive each, a pointer reset per further row of a strided destination and one per receive that does not start
    where its previous one ended."""
    from tremula.target.overheads import _run_bytes

    enc, rng = c600.exchange_code, np.random.default_rng(seed)
    n, tiles = 200, 7
    rows = rng.integers(1, 4, n)
    rb = 4 * rng.integers(1, 5, n)
    src_stride = np.where(rng.random(n) < 0.5, rb, rb + 8)
    all_strided = seed % 2 == 0  # every destination strided (the sort-free path), or a mix
    d_stride = np.where(all_strided | (rng.random(n) < 0.5), rb + 4, rb)
    rows = np.where(all_strided, np.maximum(rows, 2), rows)
    d_tile = rng.integers(0, tiles, n)
    d_addr = rng.permutation(n) * 64  # distinct, some back to back with the entry before (below)
    d_addr[1::3] = d_addr[0::3][: len(d_addr[1::3])] + rows[0::3][: len(d_addr[1::3])] * rb[0::3][: len(d_addr[1::3])]
    t = table(rng.integers(0, tiles, n), rng.integers(0, 1000, n), rows, rb, src_stride,
              [[(int(d_tile[i]), int(d_addr[i]), int(d_stride[i]))] for i in range(n)])
    send, recv = transfer_code_bytes(t, c600)
    want_send = np.zeros(tiles, I64)
    for i in range(n):
        strided = rows[i] > 1 and src_stride[i] != rb[i]
        want_send[t.src_tile[i]] += rows[i] * _run_bytes(enc, rb[i]) if strided else _run_bytes(enc, rows[i] * rb[i])
    want_recv = np.zeros(tiles, I64)
    for tile in range(tiles):
        end = None
        for i in sorted(np.flatnonzero(d_tile == tile), key=lambda i: d_addr[i]):
            strided = rows[i] > 1 and d_stride[i] != rb[i]
            want_recv[tile] += enc.receive_bytes + enc.pointer_reset_bytes * ((rows[i] - 1 if strided else 0)
                                                                              + (end is not None and end != d_addr[i]))
            end = -1 if strided else d_addr[i] + rows[i] * rb[i]
    np.testing.assert_array_equal(np.bincount(t.src_tile, weights=send, minlength=tiles).astype(I64), want_send)
    np.testing.assert_array_equal(np.bincount(t.d_tile, weights=recv, minlength=tiles).astype(I64), want_recv)
