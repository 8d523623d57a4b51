"""Load the target model: the embedded tiny checkpoint or a real Qwen3.5/3.6 checkpoint.

Only the decoder layers up to the last captured one are built and loaded (the forward stops
there), and never the lm_head. A multimodal `Qwen3_5ForConditionalGeneration` checkpoint
(Qwen3.6-27B ships as one) is read through its `text_config`: only `model.language_model.*`
is loaded; `model.visual.*`, `mtp.*` and `lm_head` stay on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModel, PretrainedConfig

from dflash.atomic import read_json, write_json_atomic
from dflash.config import ModelConfig

log = logging.getLogger(__name__)

EMBEDDED_RECORD = "dflash_embedded.json"


@dataclass(frozen=True)
class TargetInfo:
    """What the manifest records about the target (design.md §3 `target`)."""

    path: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    config_sha256: str
    """sha256 of the checkpoint's config.json bytes."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@contextlib.contextmanager
def _quiet_transformers():
    """transformers prints a table of the unused checkpoint tensors (the layers past the last
    captured one, lm_head, the vision tower): expected here, so keep it out of the logs."""
    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(previous)


def text_config(path: str | Path) -> PretrainedConfig:
    """The language-model config of a checkpoint (its `text_config` when multimodal)."""
    config = AutoConfig.from_pretrained(str(path))
    return getattr(config, "text_config", None) or config


def target_info(path: str | Path) -> TargetInfo:
    config = text_config(path)
    config_bytes = (Path(path) / "config.json").read_bytes()
    return TargetInfo(path=str(path), num_hidden_layers=config.num_hidden_layers,
                      hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                      config_sha256=hashlib.sha256(config_bytes).hexdigest())


def build_embedded(path: str | Path, architecture: dict[str, Any], seed: int, embedding_init_std: float) -> None:
    """Build a `Qwen3_5ForCausalLM` of `architecture` with weights drawn from `seed` (token
    embeddings with std `embedding_init_std`) and save it at `path` (config.json +
    model.safetensors) unless it is already there. The checkpoint is written to a temporary dir
    and renamed, so a killed build leaves nothing that looks valid. Rank 0 only."""
    path = Path(path)
    record = {"architecture": architecture, "seed": seed, "embedding_init_std": embedding_init_std}
    if (path / "config.json").exists():
        _check_embedded(path, record)
        return
    model = build_random_model(architecture, seed, torch.float32, torch.device("cpu"), with_lm_head=True)
    with torch.no_grad():
        torch.nn.init.normal_(model.model.embed_tokens.weight, std=embedding_init_std)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    write_json_atomic(tmp / EMBEDDED_RECORD, record)
    tmp.rename(path)
    log.info("built the embedded target (%s parameters, seed %d) at %s",
             f"{sum(p.numel() for p in model.parameters()):,}", seed, path)


def _check_embedded(path: Path, wanted: dict[str, Any]) -> None:
    """An embedded checkpoint already at `path` must have been built from the same settings
    (recorded in `dflash_embedded.json` beside its config)."""
    built = read_json(path / EMBEDDED_RECORD)
    for key in wanted:
        if built.get(key) == wanted[key]:
            continue
        if key == "architecture":
            key += "." + next(k for k in built[key].keys() | wanted[key].keys()
                              if built[key].get(k) != wanted[key].get(k))
        raise ValueError(f"the embedded target at {path} was built with another model.{key} than "
                         "this run's: set model.path to another dir")


def load_base_model(path: str | Path, num_layers: int, dtype: torch.dtype, device: torch.device,
                    attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The target's base model (embeddings + decoder layers 0..num_layers-1 + final norm, no
    lm_head) in `dtype` on `device`, in eval mode with `use_cache=False`. The layers past
    `num_layers` are neither built nor read."""
    config = text_config(path)
    if not 0 < num_layers <= config.num_hidden_layers:
        raise ValueError(f"cannot keep {num_layers} of the target's {config.num_hidden_layers} layers")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    # A DynamicCache would be created (and packing detection disabled) if use_cache were left on.
    config.use_cache = False
    with _quiet_transformers():
        model = AutoModel.from_pretrained(str(path), config=config, dtype=dtype, device_map=device,
                                          attn_implementation=attn_implementation)
    model.eval().requires_grad_(False)
    return model


def build_random_model(architecture: dict[str, Any], seed: int, dtype: torch.dtype, device: torch.device,
                       attn_implementation: str = "sdpa", num_layers: int | None = None,
                       with_lm_head: bool = False) -> torch.nn.Module:
    """A Qwen3.5 text model of `architecture` (layers 0..num_layers-1 when given) with random
    weights drawn from `seed`, built directly on `device` in `dtype`: `Qwen3_5TextModel`, or
    `Qwen3_5ForCausalLM` when `with_lm_head` (`model.init=random`: benchmarks at the real shape
    without a checkpoint; a 27B-shaped model builds in seconds on a GPU)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3_5TextModel

    config = Qwen3_5TextConfig(**architecture)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        config.layer_types = config.layer_types[:num_layers]
    config.use_cache = False
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (Qwen3_5ForCausalLM if with_lm_head else Qwen3_5TextModel)(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def random_target_info(name: str, architecture: dict[str, Any], seed: int) -> TargetInfo:
    """TargetInfo of a `model.init=random` target: no checkpoint, the identity is the
    architecture and seed."""
    record = json.dumps({"architecture": architecture, "seed": seed}, sort_keys=True).encode()
    return TargetInfo(path=f"random:{name}:seed{seed}", num_hidden_layers=architecture["num_hidden_layers"],
                      hidden_size=architecture["hidden_size"], vocab_size=architecture["vocab_size"],
                      config_sha256=hashlib.sha256(record).hexdigest())


def load_causal_lm(path: str | Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The whole target with its lm_head, for generating synthetic responses."""
    from transformers import AutoModelForCausalLM

    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map=device)
    return model.eval().requires_grad_(False)


def ensure_target(cfg: ModelConfig) -> None:
    """Make sure a loadable checkpoint is at `cfg.path`: build the embedded model there
    (`init=embedded`) or check that the given checkpoint exists. Nothing for `init=random`.
    Rank 0 only."""
    path = cfg.path
    if cfg.init == "random":
        return
    if cfg.init == "embedded":
        build_embedded(path, cfg.architecture or {}, cfg.seed, cfg.embedding_init_std)
    elif not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"config key `model.path`: {path} is not a Hugging Face checkpoint dir "
                                "(no config.json); point model.path at the downloaded checkpoint")


def target_info_of(cfg: ModelConfig) -> TargetInfo:
    """What the manifest records about the configured target."""
    if cfg.init == "random":
        return random_target_info(cfg.name, cfg.architecture or {}, cfg.seed)
    return target_info(cfg.path)


def causal_lm_of(cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    """The configured target with its lm_head, on `device`: random (`init=random`) or loaded."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.init == "random":
        return build_random_model(cfg.architecture or {}, cfg.seed, dtype, device, cfg.attn_implementation,
                                  with_lm_head=True)
    return load_causal_lm(cfg.path, dtype, device)


def base_model_of(cfg: ModelConfig, num_layers: int, device: torch.device) -> torch.nn.Module:
    """The configured target's base model, truncated to `num_layers` layers, on `device`."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.init == "random":
        return build_random_model(cfg.architecture or {}, cfg.seed, dtype, device, cfg.attn_implementation,
                                  num_layers=num_layers)
    return load_base_model(cfg.path, num_layers, dtype, device, cfg.attn_implementation)
