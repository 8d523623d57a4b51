"""The fast path of the Gated-DeltaNet layers: fla-core's Triton kernels on GPU.

transformers' Qwen3.5 code looks its kernels up as module globals at call time
(`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`). On CUDA we bind them to fla-core:
`chunk_gated_delta_rule` (the chunked delta rule, ~10x faster than the fp32 torch reference with
its Python loop over chunks) and `causal_conv1d` (Triton; it honours `cu_seqlens`, which the
torch conv fallback cannot, and fuses the SiLU). transformers itself would take the conv from
the `causal-conv1d` package, which needs a CUDA build. On CPU nothing is bound (fla's Triton
kernels do not run there) and the torch reference runs, which is correct but slow.

Every kernel bound here is opaque to torch.compile (`opaque_kernel`): the compiled decoder
layers (`dflash.target.compile`) call it as it is, and one wrapper per function keeps its
identity stable, so rebinding the same kernel never recompiles.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
"""transformers' module globals that hold the Gated-DeltaNet kernels."""

_REFERENCE: dict = {}  # transformers' own functions, kept at the first binding
_OPAQUE: dict = {}  # function -> its torch.compile-opaque wrapper
_FLA: dict = {}  # name -> the fla-backed function, built once


@dataclass(frozen=True)
class KernelStatus:
    """Which implementation runs the delta rule and the conv: `fla` or `torch`."""

    delta_rule: str
    conv: str

    @property
    def fast(self) -> bool:
        return self.delta_rule == "fla" and self.conv == "fla"


def _fla_chunk_rule(fla_chunk):
    def chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        # q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H: fla handles the grouping).
        return fla_chunk(q=query, k=key, v=value, g=g, beta=beta, initial_state=initial_state,
                         output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    return chunk_gated_delta_rule


def _fla_conv(fla_causal_conv1d):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        # transformers hands over [B, D, T] as a transposed view of a contiguous [B, T, D]
        # projection; fla wants [B, T, D], so both transposes are free.
        out, _ = fla_causal_conv1d(x=hidden_states.transpose(1, 2), weight=weight, bias=bias,
                                   activation=activation, cu_seqlens=kwargs.get("cu_seq_lens_q"))
        return out.transpose(1, 2)
    return causal_conv1d_fn


def bind_fast_kernels(device: torch.device) -> KernelStatus:
    """Bind fla's kernels into transformers' Qwen3.5 module when `device` is CUDA and fla-core
    is installed. Warns loudly when a GPU run stays on the torch reference. Idempotent."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    if device.type != "cuda":
        return KernelStatus("torch", "torch")
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        log.warning("fla-core is not importable (%s): the Gated-DeltaNet layers run on transformers' "
                    "torch reference, about 10x slower. Install it: pip install 'dflash[gpu]'", exc)
        return KernelStatus("torch", "torch")
    _keep_reference(modeling)
    if not _FLA:
        _FLA.update(torch_chunk_gated_delta_rule=_fla_chunk_rule(chunk_gated_delta_rule),
                    causal_conv1d_fn=_fla_conv(causal_conv1d))
    for name, function in _FLA.items():
        setattr(modeling, name, opaque_kernel(function))
    log.info("Gated-DeltaNet kernels: fla-core chunk_gated_delta_rule and Triton causal_conv1d")
    return KernelStatus("fla", "fla")


def bind_transformers_kernels() -> None:
    """Bind what transformers itself picked at import (fla's delta rule when fla is installed,
    the torch conv unless the `causal-conv1d` package is): a plain transformers run, as the
    predecessor's scripts ran (the benchmark's baseline)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    _keep_reference(modeling)
    for name, function in _REFERENCE.items():
        setattr(modeling, name, opaque_kernel(function))


def bind_reference_kernels() -> None:
    """Bind transformers' plain torch implementations, whatever packages are installed (parity
    tests compare the fast path against them). `bind_fast_kernels` binds fla again."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    _keep_reference(modeling)
    for name in KERNEL_NAMES:
        # transformers' decorator may have bound fla already; its wrapper keeps the torch function
        setattr(modeling, name, opaque_kernel(inspect.unwrap(_REFERENCE[name])))


def bind_opaque_kernels() -> None:
    """Make whatever kernels are bound now opaque to torch.compile (the CPU path binds none of
    its own: transformers' torch reference, whose Python loop over chunks must not be traced)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    _keep_reference(modeling)
    for name in KERNEL_NAMES:
        setattr(modeling, name, opaque_kernel(getattr(modeling, name)))


def opaque_kernel(function):
    """`function` behind `torch.compiler.disable`: compiled code calls it instead of tracing
    it. The same wrapper for the same function every time. Idempotent."""
    if function in _OPAQUE.values():
        return function
    if function not in _OPAQUE:
        _OPAQUE[function] = torch.compiler.disable(function)
    return _OPAQUE[function]


def _keep_reference(modeling) -> None:
    for name in KERNEL_NAMES:
        _REFERENCE.setdefault(name, getattr(modeling, name))
