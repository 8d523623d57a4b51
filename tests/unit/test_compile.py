"""Regional torch.compile of the target's decoder layers: the same states as eager, hooks still
fire, every layer and batch shape shares the compiled code, and `restore_eager` undoes it."""

import torch

from conftest import qwen35_architecture
from dflash.target.capture import HiddenStateCapture, pad_right
from dflash.target.compile import compile_decoder_layers, restore_eager, should_compile
from dflash.target.load import build_random_model

SMALL = qwen35_architecture(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            head_dim=16, linear_num_value_heads=4, rope_parameters={"mrope_section": [1, 1, 0]})
LAYER_IDS = [1, 3]  # a Gated-DeltaNet layer and the full-attention layer


def batches():
    gen = torch.Generator().manual_seed(0)
    for lengths in ([23, 17, 5], [40]):  # a padded batch, then batch size 1 (Dynamo guards on it)
        rows = [torch.randint(0, SMALL["vocab_size"], (n,), generator=gen).tolist() for n in lengths]
        yield pad_right(list(range(len(rows))), rows, [[1] * len(r) for r in rows])


def capture_all(base) -> list[torch.Tensor]:
    capture = HiddenStateCapture(base, LAYER_IDS, torch.float32)
    try:
        return [capture(batch).hidden_BSLH for batch in batches()]
    finally:
        capture.remove()


def test_compiled_layers_capture_the_eager_states():
    base = build_random_model(SMALL, 0, torch.float32, torch.device("cpu"))
    eager = capture_all(base)
    torch._dynamo.reset()
    # Dynamo's capture (graph breaks at the kernels, guards, hooks outside) without Inductor's
    # code generation, which takes minutes on a CPU; tests/gpu runs Inductor against eager.
    compile_decoder_layers(base.layers, backend="eager")
    try:
        compiled = capture_all(base)
        assert all("forward" in vars(layer) for layer in base.layers)
    finally:
        restore_eager(base.layers)
    assert not any("forward" in vars(layer) for layer in base.layers)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_compile_setting_defaults_to_cuda_only():
    assert should_compile(None, torch.device("cuda", 0)) and not should_compile(None, torch.device("cpu"))
    assert should_compile(True, torch.device("cpu")) and not should_compile(False, torch.device("cuda", 0))
