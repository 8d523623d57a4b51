"""Captured states equal an independent HF forward; multimodal checkpoints; bad rows stop the run."""

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from conftest import compose_config, run_extract, small_overrides
from dflash.store import StateReader
from dflash.target.capture import BadHiddenStates, HiddenStateCapture, pad_right
from dflash.target.load import load_base_model, target_info

CPU = torch.device("cpu")


def assert_bf16_close(stored: torch.Tensor, reference: torch.Tensor) -> None:
    """Equal within bf16 rounding: the reference rounded to bf16 may differ by one bf16 ulp
    (float32 results of padded and unpadded forwards differ in the last bits)."""
    assert stored.dtype == torch.bfloat16
    ref = reference.to(torch.bfloat16).float()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-6)
    assert ((stored.float() - ref).abs() <= ulp + 1e-6).all(), (stored.float() - ref).abs().max()


@pytest.fixture(scope="module")
def extracted(prepared_root):
    cfg = run_extract(prepared_root, "parity")
    return cfg, StateReader(Path(cfg.run_dir) / "states")


def test_states_equal_independent_hf_forward(extracted):
    cfg, reader = extracted
    assert reader.manifest["complete"]
    assert reader.layer_ids == [1, 3, 5, 7, 9]  # z-lab rule, 12-layer target, 5 draft layers
    lengths = {s: reader.length(s) for s in reader.sample_ids}
    rng = np.random.default_rng(0)
    chosen = {min(lengths, key=lengths.get), max(lengths, key=lengths.get),
              *rng.choice(reader.sample_ids, 4, replace=False).tolist()}
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    for sample_id in chosen:
        sample = reader[sample_id]
        with torch.no_grad():
            out = model(input_ids=sample.input_ids[None].long(), output_hidden_states=True, use_cache=False)
        for k, layer_id in enumerate(reader.layer_ids):
            assert_bf16_close(sample.hidden_states[:, k], out.hidden_states[layer_id + 1][0])


def test_stored_tokens_equal_the_prepared_data(extracted):
    import datasets

    cfg, reader = extracted
    prepared = datasets.load_from_disk(cfg.data.prepared_dir)
    assert sorted(prepared["sample_id"]) == reader.sample_ids
    for row in prepared.select(range(5)):
        sample = reader[row["sample_id"]]
        assert sample.input_ids.tolist() == row["input_ids"]
        assert sample.loss_mask.tolist() == row["loss_mask"]
        assert sum(row["loss_mask"]) > 0 and row["loss_mask"][0] == 0  # prompt, then response


def test_multimodal_checkpoint_loads_only_the_language_model(tmp_path, prepared_root):
    """Qwen3.6-27B ships as Qwen3_5ForConditionalGeneration: a tiny one built from config gives
    the same states as the same language model saved alone."""
    cfg = compose_config(small_overrides(prepared_root))
    text = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=text.config.hidden_size, patch_size=16, spatial_merge_size=2)
    multimodal = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision))
    multimodal.model.language_model.load_state_dict(text.model.state_dict())
    multimodal.save_pretrained(tmp_path / "mm")
    info = target_info(tmp_path / "mm")
    assert (info.num_hidden_layers, info.hidden_size) == (12, text.config.hidden_size)

    base = load_base_model(tmp_path / "mm", 6, torch.float32, CPU)
    assert len(base.layers) == 6 and not hasattr(base, "lm_head")
    batch = pad_right([7, 8], [[5, 6, 7, 8, 9], [10, 11, 12]], [[0, 0, 1, 1, 1], [0, 1, 1]])
    capture = HiddenStateCapture(base, [1, 5], torch.float32)
    captured = capture(batch)
    with torch.no_grad():
        ref = text(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(captured.hidden_BSLH[0, :, 0], ref[2][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(captured.hidden_BSLH[0, :, 1], ref[6][0], rtol=1e-5, atol=1e-5)


def test_forward_stops_after_the_last_captured_layer(prepared_root):
    cfg = compose_config(small_overrides(prepared_root))
    base = load_base_model(cfg.model.path, 4, torch.float32, CPU)
    assert len(base.layers) == 4
    with pytest.raises(ValueError, match="cannot keep 13"):
        load_base_model(cfg.model.path, 13, torch.float32, CPU)


@pytest.mark.parametrize("poison, what", [("nan", "non-finite"), ("zero", "all-zero")])
def test_bad_rows_fail_with_the_sample_id(prepared_root, poison, what):
    cfg = compose_config(small_overrides(prepared_root))
    base = load_base_model(cfg.model.path, 4, torch.float32, CPU)
    with torch.no_grad():
        if poison == "nan":
            base.layers[3].mlp.down_proj.weight[0, 0] = float("nan")
        else:
            base.embed_tokens.weight.zero_()
    capture = HiddenStateCapture(base, [1, 3], torch.bfloat16)
    batch = pad_right([41, 42], [[1, 2, 3], [4, 5]], [[0, 1, 1], [0, 1]])
    with pytest.raises(BadHiddenStates, match=f"sample id 41: {what} hidden state at token 0 of layer id"):
        capture(batch).wait()


def test_fp8_storage_round_trip(extracted, prepared_root):
    """float8_e4m3fn with per-token, per-layer scales: about half the bytes, the reader
    dequantizes, and every value is within e4m3's relative step (2^-3) of the bf16 value."""
    cfg = run_extract(prepared_root, "fp8", ["extract.dtype=float8_e4m3fn"])
    fp8 = StateReader(Path(cfg.run_dir) / "states")
    _, bf16 = extracted
    assert fp8.manifest["dtype"] == "float8_e4m3fn" and fp8.sample_ids == bf16.sample_ids
    for sample_id in bf16.sample_ids[:8]:
        a, b = fp8[sample_id].hidden_states, bf16[sample_id].hidden_states
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        scale = b.float().abs().amax(-1, keepdim=True)
        assert ((a.float() - b.float()).abs() <= 2**-4 * b.float().abs() + scale * 2**-9 + 1e-6).all()
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 0.03
    sizes = [sum(m.manifest["shard_info"][s]["num_bytes"] for s in m.manifest["shards"]) for m in (fp8, bf16)]
    assert 0.45 < sizes[0] / sizes[1] < 0.6


def test_run_dir_of_another_dtype_is_refused(extracted, prepared_root):
    from dflash.store.manifest import ManifestMismatch

    with pytest.raises(ManifestMismatch, match="dtype='bfloat16', this run has dtype='float8_e4m3fn'"):
        run_extract(prepared_root, "parity", ["extract.dtype=float8_e4m3fn"])
