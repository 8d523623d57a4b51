"""The DFlash drafter: a small block-diffusion transformer conditioned on target hidden states.

Follows z-lab's `DFlashDraftModel` (dflash 0.1.0, `dflash/model.py`), tensor names included, so
that `export/model.safetensors` loads there, in vLLM and in SGLang. Shapes: b batch, S context
tokens, Q block queries (N blocks x block_size), H hidden size (= the target's), F number of
target layers captured, h_q / h_kv query / key-value heads, d head_dim.

    C = hidden_norm(fc(target_hidden))                   [b, S, F*H] -> [b, S, H]
    x = embeddings of the block tokens                   [b, Q, H]  (target embed_tokens, frozen)
    every layer: keys/values = [k_proj(C) | k_proj(x)]: the context is injected into every layer
                 through that layer's own k/v projections and k_norm; queries come from x only
    out = norm(x)                                        [b, Q, H]  -> target lm_head, frozen

Departures from Qwen3 are marked "(DFlash)". The embeddings and the lm_head are not part of this
module: they belong to the target and stay frozen (`dflash.target.embeddings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

try:  # flex attention: block-sparse masks for 512 anchors x 16 slots (GPU)
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - older torch
    BlockMask, flex_attention = None, None

AttentionMask = Union[torch.Tensor, "BlockMask", None]
"""Per layer type: a bool [b, 1, Q, S+Q] mask (True = may attend), a flex BlockMask, or None
(every query sees every key)."""


@dataclass(frozen=True)
class DrafterArch:
    """Everything that fixes the drafter's tensors and their meaning."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    sliding_window: int
    block_size: int
    rope_theta: float
    rms_norm_eps: float
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    max_position_embeddings: int


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE over the full head_dim (DFlash: the drafter's own theta, no mRoPE and no
    partial rotary, whatever the target uses)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, T] -> (cos, sin) [b, T, d]."""
        freqs = positions[..., None].float() * self.inv_freq  # [b, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, d]; cos/sin [b, T, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_proj = nn.Linear(arch.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, rope_q: tuple, rope_kv: tuple,
                mask: AttentionMask) -> torch.Tensor:
        """x [b, Q, H] block states; context [b, S, H] fused target features."""
        b, q_len, _ = x.shape
        s_len = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        # (DFlash) keys/values of the context and of the block through the same projections.
        kv_in = torch.cat([context, x], dim=1)  # [b, S+Q, H]
        k = self.k_norm(self.k_proj(kv_in).view(b, s_len + q_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, s_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_kv)  # q [b, h_q, Q, d]; k, v [b, h_kv, S+Q, d]
        if BlockMask is not None and isinstance(mask, BlockMask):
            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, arch: DrafterArch, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DFlashAttention(arch)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, context, rope_q, rope_kv, mask) -> torch.Tensor:
        # (DFlash) the context is not passed through input_layernorm; its norm is hidden_norm.
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_kv, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class DFlashDrafter(nn.Module):
    """The drafter. Parameter names equal z-lab's checkpoint names (see `dflash.drafter.export`)."""

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.arch = arch
        num_features = len(arch.target_layer_ids)
        self.fc = nn.Linear(num_features * arch.hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(arch, t) for t in arch.layer_types)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Qwen3's init: normal(0, 0.02) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, target_hidden: torch.Tensor, block_embeds: torch.Tensor,
                context_positions: torch.Tensor, block_positions: torch.Tensor,
                masks: dict[str, AttentionMask]) -> torch.Tensor:
        """Drafter states of the block tokens.

        target_hidden [b, S, F*H]: target states of the context, layers in `target_layer_ids`
        order; block_embeds [b, Q, H]: target embeddings of the block tokens (anchor, then mask
        tokens); context_positions [b, S], block_positions [b, Q]: absolute positions for RoPE;
        masks: per layer type, what each block query may see of the S+Q keys.
        Returns [b, Q, H], already through the final `norm` (apply the target lm_head next).
        """
        context = self.hidden_norm(self.fc(target_hidden))  # [b, S, H]
        x = block_embeds
        rope_q = self.rotary(block_positions, x.dtype)
        rope_kv = self.rotary(torch.cat([context_positions, block_positions], dim=1), x.dtype)
        for layer in self.layers:
            x = layer(x, context, rope_q, rope_kv, masks[layer.layer_type])
        return self.norm(x)

    def forward_block(self, target_hidden: torch.Tensor, block_embeds: torch.Tensor,
                      position_ids: torch.Tensor) -> torch.Tensor:
        """One block after its whole context, as z-lab's `DFlashDraftModel.forward` without a
        cache: target_hidden [b, S, F*H], block_embeds [b, B, H], position_ids [b, S+B].
        Full-attention layers see everything; sliding layers are causal in the block and see
        keys within the window. Returns [b, B, H]."""
        s_len, q_len = target_hidden.shape[1], block_embeds.shape[1]
        query_pos = s_len + torch.arange(q_len, device=block_embeds.device)[:, None]
        key_pos = torch.arange(s_len + q_len, device=block_embeds.device)[None, :]
        sliding = (key_pos <= query_pos) & (query_pos - key_pos < self.arch.sliding_window)
        masks = {"full_attention": None, "sliding_attention": sliding[None, None]}
        return self(target_hidden, block_embeds, position_ids[:, :s_len], position_ids[:, s_len:], masks)
