"""The target's token embedding and lm_head, read alone from its checkpoint.

The drafter reuses both, frozen: the block tokens are embedded with the target's
`embed_tokens` (the mask token's row included) and the drafter's states go through the target's
`lm_head`. Only these two tensors are read (safetensors slices), never the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dflash.target.load import text_config

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight",)


def _tensor_files(path: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of a (possibly sharded) checkpoint."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _read(files: dict[str, Path], names: tuple[str, ...]) -> torch.Tensor | None:
    for name in names:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as f:
                return f.get_tensor(name)
    return None


def load_embeddings(path: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) of the target at `path`, in `dtype` on `device`.
    A tied checkpoint gives the same tensor twice."""
    path = Path(path)
    files = _tensor_files(path)
    embed = _read(files, EMBED_NAMES)
    if embed is None:
        raise KeyError(f"{path}: no token embedding among {EMBED_NAMES}")
    lm_head = _read(files, LM_HEAD_NAMES)
    if lm_head is None:
        if not getattr(text_config(path), "tie_word_embeddings", False):
            raise KeyError(f"{path}: no lm_head.weight and the embeddings are not tied")
        lm_head = embed
    return embed.to(device=device, dtype=dtype), lm_head.to(device=device, dtype=dtype)
