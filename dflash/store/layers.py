"""The layer-id convention of the stored states (z-lab / DFlash), defined once here.

Layer id i is the output of decoder layer i (0-based), which is HF `hidden_states[i+1]`
(entry 0 is the embedding output). vLLM's `eagle_aux_hidden_state_layer_ids` and speculators'
`aux_hidden_state_layer_ids` are these ids + 1.
"""

from __future__ import annotations


def zlab_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab `build_target_layer_ids`: `num_draft_layers` ids spread evenly over layers
    1..num_target_layers-3 (Python rounding). 64 target layers, 5 draft layers: [1,16,31,46,61]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def check_layer_ids(layer_ids: list[int], num_target_layers: int) -> None:
    """Raise ValueError (naming `extract.layer_ids`) unless every id is a decoder layer of the target."""
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"config key `extract.layer_ids`: ids {bad} are outside the target's "
                         f"{num_target_layers} decoder layers (valid: 0..{num_target_layers - 1})")
