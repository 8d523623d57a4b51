"""Synthetic conversations answered by the target itself.

Prompts are random token ids with log-normal lengths; each response is the target's own greedy
continuation (batched `generate`), cut to a log-normal length. DFlash trains on target-generated
responses, so this is the recipe's data at toy scale. `loss_mask` is 1 on the response tokens.
"""

from __future__ import annotations

import logging

import datasets
import numpy as np
import torch

from dflash.config import DataConfig

log = logging.getLogger(__name__)


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, maximum: int,
                      minimum: int = 1) -> np.ndarray:
    """[n] int64 lengths, log-normal with the given mean (tokens), clipped to [minimum, maximum]."""
    mu = np.log(mean) - sigma**2 / 2  # so that E[length] = mean before clipping
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), minimum, maximum).astype(np.int64)


def conversation_lengths(cfg: DataConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """([n] prompt, [n] response) lengths in tokens for `cfg.num_samples` conversations, drawn
    from `rng` in that order."""
    n = cfg.num_samples
    return (lognormal_lengths(rng, n, cfg.prompt_length_mean, cfg.length_sigma, cfg.max_prompt_length),
            lognormal_lengths(rng, n, cfg.response_length_mean, cfg.length_sigma, cfg.max_response_length))


@torch.inference_mode()
def generate_synthetic(cfg: DataConfig, model: torch.nn.Module, vocab_size: int) -> datasets.Dataset:
    """`cfg.num_samples` conversations: columns sample_id, input_ids, loss_mask.

    `model` is the target with its lm_head (a causal LM). Prompts are left-padded for batched
    generation (the only place dflash left-pads: generation needs the prompts' ends aligned; the
    states used for training come from a separate right-padded forward of the final sequences).
    """
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_samples
    prompt_lengths, response_lengths = conversation_lengths(cfg, rng)
    prompts = [rng.integers(0, vocab_size, size=int(length)) for length in prompt_lengths]
    device = next(model.parameters()).device

    input_ids: list[list[int]] = [[] for _ in range(n)]
    loss_masks: list[list[int]] = [[] for _ in range(n)]
    order = np.argsort(prompt_lengths, kind="stable")  # similar lengths share a batch: little padding
    for start in range(0, n, cfg.generation_batch_size):
        rows = order[start:start + cfg.generation_batch_size]
        width = int(prompt_lengths[rows].max())
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            length = int(prompt_lengths[row])
            ids[b, width - length:] = torch.from_numpy(prompts[row])
            attention[b, width - length:] = 1
        new_tokens = int(response_lengths[rows].max())
        out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             use_cache=True, pad_token_id=0, eos_token_id=None)
        responses = out[:, width:].cpu()
        for b, row in enumerate(rows):
            response = responses[b, : int(response_lengths[row])].tolist()
            input_ids[row] = prompts[row].tolist() + response
            loss_masks[row] = [0] * int(prompt_lengths[row]) + [1] * len(response)
        log.info("generated responses for %d/%d synthetic prompts", min(start + len(rows), n), n)
    return datasets.Dataset.from_dict(
        {"sample_id": list(range(n)), "input_ids": input_ids, "loss_mask": loss_masks})


def random_conversations(cfg: DataConfig, vocab_size: int) -> datasets.Dataset:
    """`cfg.num_samples` conversations of random token ids, prompt and response lengths
    log-normal as for synthetic data; no generation (throughput runs at scale)."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_samples
    prompt_lengths, response_lengths = conversation_lengths(cfg, rng)
    input_ids = [rng.integers(0, vocab_size, size=int(p + r)).tolist()
                 for p, r in zip(prompt_lengths, response_lengths)]
    loss_masks = [[0] * int(p) + [1] * int(r) for p, r in zip(prompt_lengths, response_lengths)]
    return datasets.Dataset.from_dict({"sample_id": list(range(n)), "input_ids": input_ids, "loss_mask": loss_masks})
