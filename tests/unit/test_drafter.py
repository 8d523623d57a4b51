"""The drafter model and objective: masks, block semantics, training/inference consistency,
decayed chunked CE, acceptance, export names."""

import json

import pytest
import torch

from dflash.config import DrafterConfig
from dflash.drafter.export import IncompatibleDrafter, check_states_fit, drafter_arch, export_drafter, load_export
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.objective import (acceptance_lengths, chunked_cross_entropy, decay_weights, make_blocks,
                                      run_blocks, sample_anchors, training_masks, visible)

H, V, F = 64, 300, 3


def manifest(hidden=H, vocab=V, layer_ids=(1, 3, 5)):
    return {"target": {"hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": 8},
            "layer_ids": list(layer_ids)}


def small_cfg(**kw):
    cfg = DrafterConfig(name="t", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=96, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                        block_size=4, decay_gamma=4.0, rope_theta=10000.0, mask_token_id=V - 1,
                        max_position_embeddings=512)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture
def drafter():
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_arch(small_cfg(), manifest())).double()
    with torch.no_grad():  # larger weights than the init, so that every dependency shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def sample(seq_len=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(seq_len, dtype=torch.bool)
    loss_mask[8:] = True
    return {"hidden": torch.randn(seq_len, F * H, generator=g, dtype=torch.float64),
            "input_ids": torch.randint(0, V - 1, (seq_len,), generator=g), "loss_mask": loss_mask}


def test_visible_matches_the_definition():
    anchors, seq_len, block, window = torch.tensor([3, 7, 12]), 16, 4, 5
    for causal, win in ((False, None), (True, window)):
        dense = visible(torch.arange(12)[:, None], torch.arange(28)[None], anchors, seq_len, block, causal, win)
        for q in range(12):
            j, k = divmod(q, block)
            a = int(anchors[j])
            for kv in range(28):
                if kv < seq_len:
                    want = kv < a and (win is None or a + k - kv < win)
                else:
                    j2, k2 = divmod(kv - seq_len, block)
                    want = j2 == j and (not causal or k2 <= k)
                assert bool(dense[q, kv]) == want, (causal, q, kv)


def block_outputs(drafter, s, anchors):
    arch = drafter.arch
    blocks = make_blocks(s["input_ids"], s["loss_mask"], anchors, arch.block_size, arch.mask_token_id)
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    masks = training_masks(anchors, len(s["input_ids"]), arch.block_size, arch.sliding_window, use_flex=False)
    out = drafter(s["hidden"][None], embed[blocks.input_ids.flatten()][None],
                  torch.arange(len(s["input_ids"]))[None], blocks.positions.flatten()[None], masks)
    return out[0].view(len(anchors), arch.block_size, H), embed, blocks


def test_training_forward_equals_one_block_at_a_time(drafter):
    """Each block of the multi-block training forward equals z-lab-style inference of that
    block after its own context (positions 0..a-1), for both layer types."""
    s = sample()
    anchors = torch.tensor([8, 11, 15, 20])
    out, embed, blocks = block_outputs(drafter, s, anchors)
    for j, a in enumerate(anchors.tolist()):
        alone = drafter.forward_block(s["hidden"][None, :a], embed[blocks.input_ids[j]][None],
                                      torch.arange(a + drafter.arch.block_size)[None])
        torch.testing.assert_close(out[j], alone[0], rtol=1e-10, atol=1e-10)


def test_block_sees_only_the_context_before_its_anchor(drafter):
    s = sample()
    anchors = torch.tensor([10, 16])
    out, _, _ = block_outputs(drafter, s, anchors)
    changed = dict(s, hidden=s["hidden"].clone())
    changed["hidden"][10:] += 1.0  # states at and after the first anchor
    out2, _, _ = block_outputs(drafter, changed, anchors)
    torch.testing.assert_close(out2[0], out[0])  # block at 10 cannot see position 10 onwards
    assert not torch.allclose(out2[1], out[1])  # block at 16 sees 10..15


def test_blocks_do_not_see_each_other_and_slots_follow_layer_types(drafter):
    s = sample()
    anchors = torch.tensor([9, 14])
    out, _, _ = block_outputs(drafter, s, anchors)
    changed = dict(s, input_ids=s["input_ids"].clone())
    changed["input_ids"][14] = (changed["input_ids"][14] + 1) % (V - 1)  # the second block's anchor token
    out2, _, _ = block_outputs(drafter, changed, anchors)
    torch.testing.assert_close(out2[0], out[0])
    assert not torch.allclose(out2[1], out[1])
    # The full-attention layer makes slot 0 depend on later slots; a drafter of sliding layers
    # alone is causal inside the block.
    causal = DFlashDrafter(drafter_arch(small_cfg(layer_types=["sliding_attention"] * 2), manifest())).double()
    for model, depends in ((drafter, True), (causal, False)):
        emb = torch.randn(1, 4, H, dtype=torch.float64)
        a = model.forward_block(s["hidden"][None, :9], emb, torch.arange(13)[None])
        emb2 = emb.clone()
        emb2[0, 3] += 1.0
        b = model.forward_block(s["hidden"][None, :9], emb2, torch.arange(13)[None])
        assert (not torch.allclose(a[0, 0], b[0, 0])) == depends


def test_sliding_window_limits_the_context(drafter):
    s = sample(seq_len=40)
    out, _, _ = block_outputs(drafter, s, torch.tensor([30]))
    changed = dict(s, hidden=s["hidden"].clone())
    changed["hidden"][:20] += 1.0  # far outside the window of 6, seen only by the full layer
    only_sliding = DFlashDrafter(drafter_arch(small_cfg(layer_types=["sliding_attention"] * 2), manifest())).double()
    a, _, _ = block_outputs(only_sliding, s, torch.tensor([30]))
    b, _, _ = block_outputs(only_sliding, changed, torch.tensor([30]))
    torch.testing.assert_close(a, b)
    out2, _, _ = block_outputs(drafter, changed, torch.tensor([30]))
    assert not torch.allclose(out, out2)


def test_labels_are_the_tokens_at_anchor_plus_k():
    ids = torch.arange(100, 120)
    loss_mask = torch.tensor([0] * 5 + [1] * 13 + [0] * 2, dtype=torch.bool)
    blocks = make_blocks(ids, loss_mask, torch.tensor([5, 15]), 4, mask_token_id=7)
    assert blocks.input_ids.tolist() == [[105, 7, 7, 7], [115, 7, 7, 7]]
    assert blocks.labels.tolist() == [[105, 106, 107, 108], [115, 116, 117, 118]]
    assert blocks.positions.tolist() == [[5, 6, 7, 8], [15, 16, 17, 18]]
    # slot 0 never counts; 18 is not a response token
    assert blocks.label_valid.tolist() == [[False, True, True, True], [False, True, True, False]]


def test_anchors_come_from_response_positions_and_are_redrawn():
    loss_mask = torch.zeros(200, dtype=torch.bool)
    loss_mask[50:150] = True
    a = sample_anchors(loss_mask, 30, torch.Generator().manual_seed(0))
    b = sample_anchors(loss_mask, 30, torch.Generator().manual_seed(1))
    assert len(a) == 30 and a.tolist() == sorted(set(a.tolist()))
    assert all(loss_mask[p] for p in a.tolist()) and not torch.equal(a, b)
    assert sample_anchors(loss_mask, 500, torch.Generator()).tolist() == list(range(50, 150))
    assert len(sample_anchors(torch.zeros(10, dtype=torch.bool), 5, torch.Generator())) == 0


def test_decay_weights():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[8], torch.exp(torch.tensor(-1.0)))


def test_chunked_ce_equals_full_ce_values_and_grads():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(30, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 30, (50,), generator=g)
    ce, correct = chunked_cross_entropy(hidden, head, labels, chunk_rows=7)
    full = torch.nn.functional.cross_entropy((hidden @ head.T).float(), labels, reduction="none")
    torch.testing.assert_close(ce, full)
    assert torch.equal(correct, (hidden @ head.T).argmax(-1) == labels)
    (grad,) = torch.autograd.grad((ce * torch.arange(50)).sum(), hidden)
    (grad_full,) = torch.autograd.grad((full * torch.arange(50)).sum(), hidden)
    torch.testing.assert_close(grad, grad_full)


def test_acceptance_lengths():
    correct = torch.tensor([[False, True, True, False, True], [False, False, True, True, True],
                            [False, True, True, True, True]])
    valid = torch.tensor([[False, True, True, True, True]] * 2 + [[False, True, True, False, False]])
    assert acceptance_lengths(correct, valid).tolist() == [3.0, 1.0, 3.0]


def test_run_blocks_loss_is_decayed_ce(drafter):
    s = sample()
    embed = torch.randn(V, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64)
    scores = run_blocks(drafter, embed, head, s, torch.tensor([8, 12]), gamma=4.0, chunk_rows=3, use_flex=False)
    assert scores.weight_sum == pytest.approx(2 * float(decay_weights(4, 4.0).sum()))
    assert scores.weighted_ce_sum.requires_grad and torch.isfinite(scores.weighted_ce_sum)


def test_export_has_exactly_the_reference_tensors(drafter, tmp_path):
    export_drafter(drafter, tmp_path / "export", torch.float32)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"]
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight",
                     *(f"layers.{i}.{n}" for i in range(2) for n in per_layer)}
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [1, 3, 5]}
    assert config["block_size"] == 4 and config["num_target_layers"] == 8
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 6
    loaded = load_export(tmp_path / "export").double()
    s = sample()
    emb = torch.randn(1, 4, H, dtype=torch.float64)
    torch.testing.assert_close(loaded.forward_block(s["hidden"][None, :9], emb, torch.arange(13)[None]),
                               drafter.forward_block(s["hidden"][None, :9], emb, torch.arange(13)[None]),
                               rtol=1e-6, atol=1e-6)


def test_incompatible_drafter_configs_name_the_key():
    with pytest.raises(IncompatibleDrafter, match="drafter.mask_token_id.*outside the target vocabulary"):
        drafter_arch(small_cfg(mask_token_id=V), manifest())
    with pytest.raises(IncompatibleDrafter, match="drafter.target_layer_ids"):
        drafter_arch(small_cfg(target_layer_ids=[1, 16, 31]), manifest())
    arch = drafter_arch(small_cfg(), manifest())
    with pytest.raises(IncompatibleDrafter, match="hidden_size=64 but the states have 128"):
        check_states_fit(arch, manifest(hidden=128))
    with pytest.raises(IncompatibleDrafter, match="target_layer_ids"):
        check_states_fit(arch, manifest(layer_ids=(2, 4, 6)))


def test_decoding_walk_visits_what_speculative_decoding_visits():
    from dflash.drafter.evaluate import decoding_walk

    lengths = {10: 3, 11: 8, 12: 1, 13: 2, 14: 1, 15: 5, 16: 1, 30: 2, 31: 1}
    # 10 -> 13 -> 15 -> (20: past the turn) next response position 30 -> 32: done
    assert decoding_walk(lengths) == [3, 2, 5, 2]
