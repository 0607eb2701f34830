"""More heads than tiles: whole heads run in rounds of whole samples, and the samples left over run in one more round
with their query rows cut finer to fill it (plan/lower_attention.py _attention_units); the Program still computes
the model, bit for bit against the matched reference in fp16."""

from pathlib import Path

import pytest

from tremula.check import check_model
from tremula.numerics import amp
from tremula.target.chip import load_chip

TINY16 = Path(__file__).resolve().parents[2] / "examples" / "chips" / "tiny16.toml"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_leftover_heads_run_with_finer_query_blocks(tmp_path, dtype, monkeypatch):
    # bert-tiny (2 heads) at batch 9 on 16 tiles: 18 heads; 8 samples a round, the ninth's 2 heads in 8 query blocks
    # each (a 128 KiB tile, so batch 9 fits; 16 tokens, so a head's keys fit one tile)
    # (each AMP group summed exactly, so the simulator's blocks and the reference's whole heads agree bit for bit on
    # every CPU: with BLAS's float32 sums the two shapes may add in different orders, numerics/amp.py)
    monkeypatch.setattr(amp, "EXACT_GROUP_SUMS", True)
    path = tmp_path / "tiny16-128k.toml"
    path.write_text(TINY16.read_text().replace("sram_bytes_per_tile = 65536", "sram_bytes_per_tile = 131072"))
    res = check_model("bert-tiny", load_chip(str(path)), 9, dtype, seq_len=16)
    assert res.passed, (res.outputs, res.matched)
    attn = [v for k, v in res.compile.strategies.items() if k.endswith(".attention")]
    assert attn and all(v == "attention, 18 heads x 1 query blocks (8 in the last round) over 16 tiles in 2 rounds"
                        for v in attn), attn
    if dtype == "fp16":
        assert all(m.rel_err == 0.0 for m in res.matched)
