"""Capture the target's hidden states at `layer_ids` with forward hooks (never
`output_hidden_states`, which keeps every layer and swaps the last one for the post-norm state).

One call = one right-padded batch: the hooks write each captured layer straight into one
preallocated [B, S, n_layers, H] buffer in the store dtype, the buffer is checked on the device
(finite, no all-zero row) and copied to the host once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.store.writer import CapturedBatch


class BadHiddenStates(RuntimeError):
    """A captured row is non-finite or all zero; the message names the sample, token and layer."""


@dataclass
class PaddedBatch:
    """Right-padded inputs of one batch, on the host.

    input_ids_BS: [B, S] int64, 0 past each length; loss_mask_BS: [B, S] uint8;
    attention_mask_BS: [B, S] int64, 1 on real tokens (None when no row is padded);
    lengths: [B] real lengths; sample_ids: [B].
    """

    input_ids_BS: torch.Tensor
    loss_mask_BS: torch.Tensor
    attention_mask_BS: torch.Tensor | None
    lengths: list[int]
    sample_ids: list[int]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_padded_tokens(self) -> int:
        return self.input_ids_BS.numel()


def pad_right(sample_ids: list[int], input_ids: list[list[int]], loss_masks: list[list[int]]) -> PaddedBatch:
    """Pack samples into right-padded tensors. Right padding only: for the hybrid Gated-DeltaNet
    target everything is causal, so pads after a sample cannot change its states, whereas left
    pads feed the conv window and recurrent state of the first real tokens."""
    lengths = [len(ids) for ids in input_ids]
    batch, seq = len(lengths), max(lengths)
    ids_BS = torch.zeros(batch, seq, dtype=torch.int64)
    mask_BS = torch.zeros(batch, seq, dtype=torch.uint8)
    attention_BS = torch.zeros(batch, seq, dtype=torch.int64)
    for b, (ids, loss_mask) in enumerate(zip(input_ids, loss_masks)):
        ids_BS[b, : lengths[b]] = torch.as_tensor(ids)
        mask_BS[b, : lengths[b]] = torch.as_tensor(loss_mask)
        attention_BS[b, : lengths[b]] = 1
    padded = any(length != seq for length in lengths)
    return PaddedBatch(ids_BS, mask_BS, attention_BS if padded else None, lengths, list(sample_ids))


class HiddenStateCapture:
    """Runs the truncated base model and returns the states of `layer_ids`.

    `model` is the base model holding decoder layers 0..max(layer_ids) (see
    `dflash.target.load.load_base_model`); `layer_ids` use the z-lab convention (i = output of
    decoder layer i). Layer k of the result is `layer_ids[k]`.
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], store_dtype: torch.dtype):
        self.model, self.layer_ids, self.store_dtype = model, list(layer_ids), store_dtype
        self.device = next(model.parameters()).device
        self._buffer: torch.Tensor | None = None
        self._handles = [model.layers[layer_id].register_forward_hook(self._hook(k))
                         for k, layer_id in enumerate(self.layer_ids)]

    def _hook(self, k: int):
        def hook(module, args, output):
            # Qwen3.5 decoder layers return the residual stream as a plain tensor [B, S, H].
            hidden_BSH = output[0] if isinstance(output, tuple) else output
            self._buffer[:, :, k].copy_(hidden_BSH)  # cast to the store dtype on the device
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @torch.inference_mode()
    def __call__(self, batch: PaddedBatch) -> CapturedBatch:
        """Forward one batch; returns its states on the host. Raises BadHiddenStates."""
        batch_size, seq = batch.input_ids_BS.shape
        hidden_size = self.model.config.hidden_size
        self._buffer = torch.empty(batch_size, seq, len(self.layer_ids), hidden_size,
                                   dtype=self.store_dtype, device=self.device)
        input_ids = batch.input_ids_BS.to(self.device, non_blocking=True)
        attention_mask = (batch.attention_mask_BS.to(self.device, non_blocking=True)
                          if batch.attention_mask_BS is not None else None)
        self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden_BSLH, self._buffer = self._buffer, None
        self._check(hidden_BSLH, batch)
        return CapturedBatch(hidden_BSLH=hidden_BSLH.cpu(), input_ids_BS=batch.input_ids_BS,
                             loss_mask_BS=batch.loss_mask_BS, lengths=batch.lengths,
                             sample_ids=batch.sample_ids)

    def _check(self, hidden_BSLH: torch.Tensor, batch: PaddedBatch) -> None:
        """Fail on any non-finite or all-zero row of a real token: peers' worst bugs were
        silently zero or NaN states that still trained to good-looking validation metrics."""
        seq = hidden_BSLH.shape[1]
        real_BS = (torch.arange(seq, device=hidden_BSLH.device)[None, :]
                   < torch.tensor(batch.lengths, device=hidden_BSLH.device)[:, None])
        bad_BSL = ~torch.isfinite(hidden_BSLH).all(-1) | (hidden_BSLH == 0).all(-1)
        bad_BSL &= real_BS[:, :, None]
        if bad_BSL.any():  # one device sync per batch
            b, s, k = (int(i) for i in bad_BSL.nonzero()[0])
            row = hidden_BSLH[b, s, k]
            what = "non-finite" if not torch.isfinite(row).all() else "all-zero"
            raise BadHiddenStates(
                f"sample id {batch.sample_ids[b]}: {what} hidden state at token {s} of layer id "
                f"{self.layer_ids[k]} ({int(bad_BSL.sum())} bad rows in its batch); nothing of "
                "this batch was stored")
