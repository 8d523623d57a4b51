"""The drafter's architecture from config + manifest, and its servable export (z-lab format).

`${run_dir}/export/` holds `config.json` (a Qwen3 config plus the DFlash keys that z-lab's
`DFlashDraftModel`, vLLM and SGLang read) and `model.safetensors` with exactly the reference
tensor names (fc, hidden_norm, norm, layers.{i}.*), no embed_tokens and no lm_head
(research/dflash.md §6.1). Written to a temporary dir and renamed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash.config import DrafterConfig
from dflash.drafter.model import DFlashDrafter, DrafterArch


class IncompatibleDrafter(ValueError):
    """The drafter config does not fit the extracted states or the target; names the key."""


def drafter_arch(cfg: DrafterConfig, manifest: dict[str, Any]) -> DrafterArch:
    """The architecture for states described by `manifest`: hidden size, vocabulary and layer ids
    come from the target. Raises IncompatibleDrafter naming the config key."""
    target = manifest["target"]
    layer_ids = tuple(manifest["layer_ids"])
    if cfg.target_layer_ids is not None and tuple(cfg.target_layer_ids) != layer_ids:
        raise IncompatibleDrafter(
            f"config key `drafter.target_layer_ids`={list(cfg.target_layer_ids)} but the states hold "
            f"layer ids {list(layer_ids)}: extract those layers, or set drafter.target_layer_ids=null")
    if not 0 <= cfg.mask_token_id < target["vocab_size"]:
        raise IncompatibleDrafter(
            f"config key `drafter.mask_token_id`={cfg.mask_token_id} is outside the target vocabulary "
            f"[0, {target['vocab_size']}): the mask token must be a row of the target's embedding")
    return DrafterArch(
        hidden_size=target["hidden_size"], vocab_size=target["vocab_size"],
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, layer_types=tuple(cfg.layer_types),
        sliding_window=cfg.sliding_window, block_size=cfg.block_size, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, mask_token_id=cfg.mask_token_id, target_layer_ids=layer_ids,
        num_target_layers=target["num_hidden_layers"], max_position_embeddings=cfg.max_position_embeddings)


def check_states_fit(arch: DrafterArch, manifest: dict[str, Any]) -> None:
    """A drafter (e.g. from a checkpoint) must fit the states it is trained or evaluated on."""
    target = manifest["target"]
    for key, ours, theirs in (("hidden_size", arch.hidden_size, target["hidden_size"]),
                              ("vocab_size", arch.vocab_size, target["vocab_size"]),
                              ("target_layer_ids", list(arch.target_layer_ids), manifest["layer_ids"])):
        if ours != theirs:
            raise IncompatibleDrafter(f"the drafter has {key}={ours} but the states have {theirs}")


def zlab_config(arch: DrafterArch, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of the export (z-lab/Qwen3.6-27B-DFlash's keys)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": arch.block_size,
        "dflash_config": {"mask_token_id": arch.mask_token_id, "target_layer_ids": list(arch.target_layer_ids)},
        "num_target_layers": arch.num_target_layers,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": list(arch.layer_types),
        "sliding_window": arch.sliding_window,
        "use_sliding_window": "sliding_attention" in arch.layer_types,
        "max_window_layers": arch.num_hidden_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "initializer_range": 0.02,
        "dflash_arch": asdict(arch),  # everything to rebuild it here (other readers ignore it)
    }


def export_drafter(model: DFlashDrafter, out_dir: Path, dtype: torch.dtype) -> None:
    """Write the servable export of `model` to `out_dir` (replacing an older one atomically)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: t.detach().to(dtype).contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(zlab_config(model.arch, dtype), indent=2) + "\n")
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_export(export_dir: Path, device: torch.device | str = "cpu") -> DFlashDrafter:
    """The drafter of an export dir, in float32."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    arch_fields = dict(config["dflash_arch"])
    arch = DrafterArch(**{**arch_fields, "layer_types": tuple(arch_fields["layer_types"]),
                          "target_layer_ids": tuple(arch_fields["target_layer_ids"])})
    model = DFlashDrafter(arch)
    model.load_state_dict({k: v.float() for k, v in load_file(str(Path(export_dir) / "model.safetensors")).items()})
    return model.to(device)
