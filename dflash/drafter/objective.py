"""The DFlash training objective on one sequence: anchors, block masks, decayed cross-entropy,
and the teacher-forced acceptance metrics (research/dflash.md §3, §5).

A block anchored at position a holds [input_ids[a], MASK x (B-1)] at positions a..a+B-1; slot k
predicts input_ids[a+k]. Shapes: S sequence length, N anchors, B block size, Q = N*B queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

try:
    from torch.nn.attention.flex_attention import create_block_mask
except ImportError:  # pragma: no cover
    create_block_mask = None


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions p with loss_mask[p] = 1 and p <= S-2 (the block's first label exists): [M] int64."""
    return torch.nonzero(loss_mask[:-1].bool(), as_tuple=False).flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """min(num_anchors, M) distinct response positions drawn uniformly, sorted: [N] int64."""
    valid = valid_anchor_positions(loss_mask)
    if len(valid) <= num_anchors:
        return valid
    chosen = torch.randperm(len(valid), generator=generator)[:num_anchors]
    return valid[chosen].sort().values


@dataclass
class Blocks:
    """The blocks of one sequence. All [N, B] except where said."""

    anchors: torch.Tensor  # [N]
    input_ids: torch.Tensor  # block tokens: anchor token then mask tokens
    positions: torch.Tensor  # absolute positions a+k
    labels: torch.Tensor  # input_ids[a+k] (0 where past the end)
    label_valid: torch.Tensor  # bool: a+k < S, loss_mask[a+k] = 1 and k >= 1


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                block_size: int, mask_token_id: int) -> Blocks:
    """input_ids, loss_mask [S]; anchors [N] -> Blocks."""
    seq_len = input_ids.shape[0]
    k = torch.arange(block_size, device=input_ids.device)
    positions = anchors[:, None] + k  # [N, B]
    inside = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    labels = torch.where(inside, input_ids[clamped], 0)
    label_valid = inside & loss_mask[clamped].bool() & (k >= 1)
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids[anchors]
    return Blocks(anchors, block_ids, positions, labels, label_valid)


def visible(q_idx: torch.Tensor, kv_idx: torch.Tensor, anchors: torch.Tensor, seq_len: int,
            block_size: int, causal: bool, window: int | None) -> torch.Tensor:
    """May block query q_idx (in [0, Q)) see key kv_idx (in [0, S+Q))? Elementwise on
    broadcast index tensors; written once for the dense mask and the flex mask_mod.

    Context key t: only t < anchor (strictly: the anchor token's own states do not exist at
    inference), and within the window of the query's position on sliding layers. Block key:
    only the query's own block, and only slots <= its own on causal (sliding) layers."""
    block, slot = q_idx // block_size, q_idx % block_size
    anchor = anchors[block]
    is_context = kv_idx < seq_len
    ctx_ok = kv_idx < anchor
    if window is not None:
        ctx_ok = ctx_ok & (anchor + slot - kv_idx < window)
    kv_block_idx = kv_idx - seq_len
    block_ok = (kv_block_idx // block_size) == block
    if causal:
        block_ok = block_ok & (kv_block_idx % block_size <= slot)
    return torch.where(is_context, ctx_ok, block_ok)


def training_masks(anchors: torch.Tensor, seq_len: int, block_size: int, sliding_window: int,
                   use_flex: bool) -> dict:
    """Per layer type, the mask of N blocks over [context S | blocks Q]: dense bool
    [1, 1, Q, S+Q] (CPU) or a flex BlockMask (GPU: Q x (S+Q) never materialised)."""
    num_queries = anchors.shape[0] * block_size
    num_keys = seq_len + num_queries
    kinds = {"full_attention": (False, None), "sliding_attention": (True, sliding_window)}
    masks = {}
    for layer_type, (causal, window) in kinds.items():
        if use_flex:
            def mask_mod(b, h, q_idx, kv_idx, causal=causal, window=window):
                return visible(q_idx, kv_idx, anchors, seq_len, block_size, causal, window)

            masks[layer_type] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=num_queries,
                                                  KV_LEN=num_keys, device=anchors.device)
        else:
            q_idx = torch.arange(num_queries, device=anchors.device)[:, None]
            kv_idx = torch.arange(num_keys, device=anchors.device)[None, :]
            masks[layer_type] = visible(q_idx, kv_idx, anchors, seq_len, block_size, causal, window)[None, None]
    return masks


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B] loss weight per slot: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def _chunk_ce(hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ lm_head.T).float()  # [rows, V]
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1) == labels


def chunked_cross_entropy(hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor,
                          chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE and argmax correctness of `hidden @ lm_head.T`, `chunk_rows` rows at a time.

    hidden [R, H]; lm_head [V, H] (frozen); labels [R]. Each chunk is checkpointed: its logits
    are recomputed in backward, so at most [chunk_rows, V] logits exist at once (512 anchors x 16
    slots x a 248K vocabulary would be 4 GB in bf16). Returns (ce [R] float32, correct [R] bool).
    """
    ces, corrects = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        if hidden.requires_grad:
            ce, correct = checkpoint(_chunk_ce, hidden[rows], lm_head, labels[rows], use_reentrant=False)
        else:
            ce, correct = _chunk_ce(hidden[rows], lm_head, labels[rows])
        ces.append(ce)
        corrects.append(correct)
    if not ces:
        return hidden.new_zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return torch.cat(ces), torch.cat(corrects)


@dataclass
class BlockScores:
    """Loss terms and metrics of one sequence's blocks."""

    weighted_ce_sum: torch.Tensor  # scalar, differentiable
    weight_sum: torch.Tensor  # scalar
    correct: torch.Tensor  # [N, B] bool: argmax == label (False where the label is invalid)
    label_valid: torch.Tensor  # [N, B] bool


def score_blocks(drafter_out: torch.Tensor, blocks: Blocks, lm_head: torch.Tensor, gamma: float,
                 chunk_rows: int) -> BlockScores:
    """drafter_out [Q, H] (before lm_head) -> decayed CE terms and correctness. Only rows with a
    valid label reach the lm_head."""
    num_blocks, block_size = blocks.labels.shape
    valid = blocks.label_valid.flatten()
    rows = valid.nonzero(as_tuple=False).flatten()
    ce, correct_rows = chunked_cross_entropy(drafter_out[rows], lm_head, blocks.labels.flatten()[rows], chunk_rows)
    weights = decay_weights(block_size, gamma, drafter_out.device).repeat(num_blocks)[rows]
    correct = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=drafter_out.device)
    correct[rows] = correct_rows
    weighted_ce_sum = (ce * weights).sum()
    if len(rows) == 0:  # nothing to learn here; a zero still reaching every parameter keeps DDP in step
        weighted_ce_sum = drafter_out.sum() * 0.0
    return BlockScores(weighted_ce_sum, weights.sum(), correct.view(num_blocks, block_size), blocks.label_valid)


def acceptance_lengths(correct: torch.Tensor, label_valid: torch.Tensor) -> torch.Tensor:
    """Teacher-forced acceptance length per block: 1 + leading slots k = 1.. whose argmax equals
    the label (stopping at the first wrong or invalid label). correct, label_valid [N, B] ->
    [N] float. Only meaningful for blocks whose slot 1 label is valid."""
    hits = (correct & label_valid)[:, 1:].int()
    return 1.0 + hits.cumprod(dim=1).sum(dim=1).float()


def run_blocks(drafter, embed_tokens: torch.Tensor, lm_head: torch.Tensor, sample: dict,
               anchors: torch.Tensor, gamma: float, chunk_rows: int, use_flex: bool) -> BlockScores:
    """The drafter on the blocks of one sequence, scored.

    sample: {hidden [S, F*H], input_ids [S], loss_mask [S]} on the drafter's device;
    anchors [N] (N >= 1); embed_tokens, lm_head [V, H] frozen target tensors.
    `drafter` may be wrapped (DDP); its `arch` is read from the unwrapped module."""
    arch = getattr(drafter, "module", drafter).arch
    input_ids, loss_mask, hidden = sample["input_ids"], sample["loss_mask"], sample["hidden"]
    seq_len = input_ids.shape[0]
    blocks = make_blocks(input_ids, loss_mask, anchors, arch.block_size, arch.mask_token_id)
    block_embeds = embed_tokens[blocks.input_ids.flatten()][None]  # [1, Q, H]
    masks = training_masks(anchors, seq_len, arch.block_size, arch.sliding_window, use_flex)
    out = drafter(hidden[None].to(block_embeds.dtype), block_embeds,
                  torch.arange(seq_len, device=input_ids.device)[None], blocks.positions.flatten()[None], masks)
    return score_blocks(out[0], blocks, lm_head, gamma, chunk_rows)
