"""Capture the target's hidden states at `layer_ids` with forward hooks (never
`output_hidden_states`, which keeps every layer and swaps the last one for the post-norm state).

One call = one right-padded batch, run without an attention mask: everything in the target is
causal (attention, conv, recurrence), so the pads after a sample cannot reach its tokens, and
the full-attention layers take SDPA's causal flash kernel instead of a masked one (the pads'
own states are computed and dropped). The hooks write each captured layer straight into one
[B, S, n_layers, H] device buffer in the store dtype; the rows are checked on the device
(finite, not all zero) and the buffer goes to the host in one copy. On a GPU nothing in a call
waits for the GPU: inputs come from pinned memory, the device-to-host copy runs on a side stream
into a pinned buffer reused across batches, and the check's verdict travels with it, so the
next batch's forward overlaps this batch's copy, check and write. `CapturedBatch.wait` (called by
the shard writer's thread) is where the host finally waits.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from dflash.store.writer import BadHiddenStates, CapturedBatch

__all__ = ["BadHiddenStates", "CapturedBatch", "HiddenStateCapture", "PaddedBatch", "pad_right", "quantize_fp8",
           "stored_bytes_per_token"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class PaddedBatch:
    """Right-padded inputs of one batch, on the host (pinned when headed for a GPU).

    input_ids_BS: [B, S] int64, 0 past each length; loss_mask_BS: [B, S] uint8;
    attention_mask_BS: [B, S] int64, 1 on real tokens (None when no row is padded): which rows
    the bad-row check looks at (the forward itself runs unmasked);
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

    def pin(self) -> "PaddedBatch":
        pin = lambda t: t.pin_memory() if t is not None else None  # noqa: E731
        return PaddedBatch(pin(self.input_ids_BS), self.loss_mask_BS, pin(self.attention_mask_BS),
                           self.lengths, self.sample_ids)


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


class PinnedBufferPool:
    """Page-locked host buffers reused across batches (pinning memory costs more than the copy:
    ~0.2 s for a 600 MB batch). Buffers are made at least `min_bytes` large, the largest batch
    the plan allows, so that batches of varying shapes never re-pin. `get` blocks while all
    `count` buffers are in use: the writer returns them, so a slow disk holds compute back here
    instead of filling host memory."""

    def __init__(self, count: int, min_bytes: int = 0):
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._lock = threading.Lock()
        self._count, self._made, self._min_bytes = count, 0, min_bytes
        self.wait_s = 0.0
        """Seconds `get` blocked because the writer held every buffer (backpressure)."""

    def get(self, num_bytes: int) -> torch.Tensor:
        with self._lock:
            if self._free.empty() and self._made < self._count:
                self._made += 1
                return self._new(num_bytes)
        start = time.monotonic()
        buffer = self._free.get()
        self.wait_s += time.monotonic() - start
        return buffer if buffer.numel() >= num_bytes else self._new(num_bytes)  # beyond `min_bytes`

    def _new(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(max(num_bytes, self._min_bytes), dtype=torch.uint8, pin_memory=True)

    def put(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


def _host_view(buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    num_bytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return buffer[offset:offset + num_bytes].view(dtype).view(shape)


class HiddenStateCapture:
    """Runs the truncated base model and returns the states of `layer_ids`.

    `model` is the base model holding decoder layers 0..max(layer_ids) (see
    `dflash.target.load.load_base_model`); `layer_ids` use the z-lab convention (i = output of
    decoder layer i). Layer k of the result is `layer_ids[k]`. `store_dtype`: bfloat16 (or
    float32 for tests) or float8_e4m3fn (per-token, per-layer scales). `num_host_buffers`
    pinned buffers are cycled on a GPU, each sized for `max_batch_tokens` padded tokens (the
    plan's largest batch; 0: sized by the batches seen).
    """

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], store_dtype: torch.dtype,
                 num_host_buffers: int = 4, max_batch_tokens: int = 0):
        self.model, self.layer_ids, self.store_dtype = model, list(layer_ids), store_dtype
        self.device = next(model.parameters()).device
        self.fp8 = store_dtype == torch.float8_e4m3fn
        self.capture_dtype = torch.bfloat16 if self.fp8 else store_dtype
        self._buffer: torch.Tensor | None = None
        self._handles = [model.layers[layer_id].register_forward_hook(self._hook(k))
                         for k, layer_id in enumerate(self.layer_ids)]
        on_gpu = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if on_gpu else None
        bytes_per_token = stored_bytes_per_token(len(self.layer_ids), model.config.hidden_size, store_dtype)
        self._pool = PinnedBufferPool(num_host_buffers, max_batch_tokens * bytes_per_token + 64) if on_gpu else None

    def _hook(self, k: int):
        def hook(module, args, output):
            # Qwen3.5 decoder layers return the residual stream as a plain tensor [B, S, H].
            hidden_BSH = output[0] if isinstance(output, tuple) else output
            self._buffer[:, :, k].copy_(hidden_BSH)  # cast to the capture dtype on the device
        return hook

    @property
    def buffer_wait_s(self) -> float:
        """Seconds a call blocked on a free pinned host buffer (the writer holds them all)."""
        return self._pool.wait_s if self._pool is not None else 0.0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @torch.inference_mode()
    def __call__(self, batch: PaddedBatch) -> CapturedBatch:
        """Forward one batch. Returns at once on a GPU; `CapturedBatch.wait` waits for the copy."""
        batch_size, seq = batch.input_ids_BS.shape
        hidden_size = self.model.config.hidden_size
        self._buffer = torch.empty(batch_size, seq, len(self.layer_ids), hidden_size,
                                   dtype=self.capture_dtype, device=self.device)
        input_ids = batch.input_ids_BS.to(self.device, non_blocking=True)
        real_BS = (batch.attention_mask_BS.to(self.device, non_blocking=True).bool()
                   if batch.attention_mask_BS is not None else None)
        self.model(input_ids=input_ids, use_cache=False)  # right pads need no mask (see above)
        hidden_BSLH, self._buffer = self._buffer, None
        num_bad = self._count_bad_rows(hidden_BSLH, real_BS)
        scales_BSL = None
        if self.fp8:
            hidden_BSLH, scales_BSL = quantize_fp8(hidden_BSLH)
        return self._to_host(batch, hidden_BSLH, scales_BSL, num_bad)

    @staticmethod
    def _count_bad_rows(hidden_BSLH: torch.Tensor, real_BS: torch.Tensor | None) -> torch.Tensor:
        """Real-token rows (`real_BS`, None: all) that are non-finite or all zero: [1] int64 on
        the device, computed without waiting for the GPU. Peers' worst bugs were silently zero
        or NaN states that trained to good-looking validation metrics."""
        bad_BSL = ~torch.isfinite(hidden_BSLH).all(-1) | (hidden_BSLH == 0).all(-1)
        if real_BS is not None:
            bad_BSL &= real_BS[:, :, None]
        return bad_BSL.sum().reshape(1)

    def _to_host(self, batch, hidden_BSLH, scales_BSL, num_bad) -> CapturedBatch:
        common = dict(input_ids_BS=batch.input_ids_BS, loss_mask_BS=batch.loss_mask_BS,
                      lengths=batch.lengths, sample_ids=batch.sample_ids, layer_ids=self.layer_ids)
        if self._copy_stream is None:  # CPU: plain copies
            return CapturedBatch(hidden_BSLH.cpu(), scales_BSL.cpu() if scales_BSL is not None else None,
                                 num_bad_rows=num_bad.cpu(), **common)
        sizes = [hidden_BSLH.numel() * hidden_BSLH.element_size(),
                 scales_BSL.numel() * 4 if scales_BSL is not None else 0, 8]
        host = self._pool.get(sum(sizes) + 64)
        host_hidden = _host_view(host, tuple(hidden_BSLH.shape), hidden_BSLH.dtype)
        offset = (sizes[0] + 7) // 8 * 8
        host_scales = (_host_view(host, tuple(scales_BSL.shape), torch.float32, offset)
                       if scales_BSL is not None else None)
        offset = (offset + sizes[1] + 7) // 8 * 8
        host_bad = _host_view(host, (1,), torch.int64, offset)
        computed = torch.cuda.Event()
        computed.record()
        ready = torch.cuda.Event()
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(computed)
            pairs = ((hidden_BSLH, host_hidden), (scales_BSL, host_scales), (num_bad, host_bad))
            for device_tensor, host_tensor in pairs:
                if device_tensor is not None:
                    host_tensor.copy_(device_tensor, non_blocking=True)
                    # keep the allocator from reusing this memory before the copy is done
                    device_tensor.record_stream(self._copy_stream)
            ready.record(self._copy_stream)
        return CapturedBatch(host_hidden, host_scales, num_bad_rows=host_bad, ready=ready,
                             release=lambda: self._pool.put(host), **common)


def stored_bytes_per_token(num_layers: int, hidden_size: int, store_dtype: torch.dtype) -> int:
    """Bytes one token's captured states take in `store_dtype` (fp8: plus a float32 scale per layer)."""
    return num_layers * (hidden_size * store_dtype.itemsize + (4 if store_dtype == torch.float8_e4m3fn else 0))


def quantize_fp8(hidden_BSLH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn with one float32 scale per token and layer: scale = amax / 448, so each
    row uses the whole e4m3 range. Returns (fp8 [B, S, L, H], scales [B, S, L])."""
    amax_BSL = hidden_BSLH.abs().amax(dim=-1).float()
    scales_BSL = torch.where(amax_BSL > 0, amax_BSL / FP8_MAX, torch.ones_like(amax_BSL))
    fp8 = (hidden_BSLH.float() / scales_BSL[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8, scales_BSL
