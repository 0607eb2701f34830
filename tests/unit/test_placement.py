"""Where the planner puts things: weights on the least-loaded tiles, element-wise re-layouts on rotating tiles, and
the exchange-code rule for each side of a transfer."""

import numpy as np

from tremula.frontends import load_model
from tremula.pipeline import lower_precision
from tremula.plan.lower_ops import Lowerer
from tremula.target.chip import load_chip
from tremula.target.overheads import side_instructions


def test_side_instructions_count_rows_only_where_a_side_is_strided():
    rows = np.array([1, 4, 4, 4])
    row_bytes = np.array([64, 64, 64, 64])
    stride = np.array([64, 64, 96, 128])
    assert side_instructions(rows, row_bytes, stride).tolist() == [1, 1, 5, 5]


def _lowerer(model="vit-tiny", chip="c600", batch=2):
    c = load_chip(chip)
    return Lowerer(lower_precision(load_model(model, batch=batch), "float16", c), c)


def test_weights_go_to_the_least_loaded_tiles():
    low = _lowerer()
    rng = np.random.default_rng(0)
    low.wload[:] = rng.integers(0, 1000, low.T)
    picked = low.take_tiles(100)
    assert len(set(picked.tolist())) == 100
    assert low.wload[picked].max() <= np.sort(low.wload)[99]  # no unpicked tile is lighter than a picked one


def test_equal_loads_give_consecutive_tiles_from_a_rotating_cursor():
    low = _lowerer()
    a, b = low.take_tiles(8), low.take_tiles(8)
    assert a.tolist() == list(range(8)) and b.tolist() == list(range(8, 16))


def test_residual_adds_do_not_stay_on_one_set_of_tiles():
    low = _lowerer("vit-tiny", "c600", 2)
    low.lower()
    adds = [n.outputs[0] for n in low.graph.nodes if n.op == "Add" and "residual" in n.name]
    assert len(adds) >= 4
    tile_sets = {tuple(np.unique(low.layouts[a].tiles).tolist()) for a in adds}
    assert len(tile_sets) == len(adds)  # each residual Add's blocks sit on tiles of their own


def test_does_not_fit_names_what_fills_the_tile():
    from pathlib import Path

    import pytest

    from tremula.compiler import DoesNotFit, compile_model
    from tremula.plan.diagnose import fold

    tiny16 = str(Path(__file__).resolve().parents[2] / "examples" / "chips" / "tiny16.toml")
    with pytest.raises(DoesNotFit) as e:
        compile_model("vit-tiny", tiny16, 64, "fp32")
    detail = e.value.detail
    assert "live there:" in detail and "exchange code there from" in detail and "weights there:" in detail
    assert str(e.value).endswith(detail) and "\n" not in str(e.value)
    assert fold("encoder.layers.5.attention.v_113@encoder.layers.5.attention_114") == \
        "encoder.layers.#.attention.v@encoder.layers.#.attention"
