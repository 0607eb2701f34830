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
