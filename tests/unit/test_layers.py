import pytest

from dflash.store.layers import check_layer_ids, zlab_target_layer_ids


@pytest.mark.parametrize("num_target, expected", [
    (64, [1, 16, 31, 46, 61]),  # Qwen3.5/3.6-27B, the published drafters
    (36, [1, 9, 17, 25, 33]),
    (40, [1, 10, 19, 28, 37]),
    (32, [1, 8, 15, 22, 29]),
    (12, [1, 3, 5, 7, 9]),  # the embedded tiny target
])
def test_zlab_rule(num_target, expected):
    assert zlab_target_layer_ids(num_target, 5) == expected


def test_single_draft_layer():
    assert zlab_target_layer_ids(64, 1) == [32]


def test_layer_outside_target_names_the_key():
    with pytest.raises(ValueError, match=r"extract.layer_ids.*\[12\]"):
        check_layer_ids([1, 12], 12)
