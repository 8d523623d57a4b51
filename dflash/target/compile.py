"""Regional torch.compile of the target's decoder layers (the recipe PyTorch recommends for
repeated blocks): each layer's `forward` is compiled with dynamic shapes, and since all layers
share one code object, Dynamo traces each layer type (Gated-DeltaNet, full attention) once and
reuses the graph for every layer and batch shape.

What it buys: Inductor fuses the elementwise work around the matrix products (the float32
RMSNorms, SiLU x up, residual adds, sigmoid gates, rotary) that eager mode runs as dozens of
memory-bound kernels per layer. The matrix products stay on cuBLAS, the fla kernels run as
they are (`dflash.target.kernels.opaque_kernel`), and the capture hooks stay outside the
compiled code (only `forward` is compiled, not the module call with its hooks).
"""

from __future__ import annotations

import logging

import torch

from dflash.target.kernels import bind_opaque_kernels

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64
"""Compiled variants Dynamo may keep per code object: 2 layer types x the graph breaks around
the kernels x a few guards (batch size 1, contiguity). The default 8 would silently fall back
to eager after the eighth."""


def should_compile(setting: bool | None, device: torch.device) -> bool:
    """`extract.compile`: True/False as given; None compiles on CUDA only (on a CPU the compile
    time outweighs the gain for the small models that run there)."""
    return device.type == "cuda" if setting is None else bool(setting)


def compile_decoder_layers(layers: torch.nn.ModuleList, backend: str = "inductor") -> None:
    """Compile each layer's `forward` in place (dynamic shapes). `restore_eager` undoes it.
    Compilation happens at each new shape class's first call (tens of seconds for the first)."""
    bind_opaque_kernels()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in layers:
        if "forward" not in vars(layer):
            layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
    log.info("torch.compile (%s, dynamic shapes) on %d decoder layers", backend, len(layers))


def restore_eager(layers: torch.nn.ModuleList) -> None:
    """Undo `compile_decoder_layers`: the layers run their class's eager `forward` again."""
    for layer in layers:
        vars(layer).pop("forward", None)
