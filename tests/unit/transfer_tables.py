"""Hand-made TransferTables for the timetable tests (scheduling and verification share one builder)."""

import numpy as np

from tremula.program import TransferTable


def make_table(src, nbytes, dests, rows=None, src_gap: float = 0.0) -> TransferTable:
    """Transfers src[i] -> dests[i] of nbytes[i] bytes, in rows[i] rows of nbytes/rows bytes.

    Source rows lie (1 + src_gap) row lengths apart (a strided 2-D pattern); destination rows are contiguous.
    """
    n = len(src)
    rows = np.ones(n, np.int64) if rows is None else np.asarray(rows, np.int64)
    rb = np.asarray(nbytes, np.int64) // rows
    starts = np.concatenate([[0], np.cumsum([len(d) for d in dests])]).astype(np.int64)
    dt = np.concatenate([np.asarray(d, np.int64) for d in dests]) if n else np.zeros(0, np.int64)
    d_stride = np.repeat(rb, np.diff(starts))
    src_stride = rb + (rb * src_gap).astype(np.int64)
    return TransferTable(np.asarray(src, np.int32), np.zeros(n, np.int64), rows, rb, src_stride, starts,
                         dt.astype(np.int32), np.zeros(len(dt), np.int64), d_stride)
