"""stage=train: the DFlash drafter from the extracted states, then its servable export.

    accelerate launch --config_file launch/cpu_2proc.yaml dflash/main.py stage=train
    accelerate launch --config_file launch/gpu_n.yaml dflash/main.py experiment=qwen3_6_27b stage=train

Reads `${run_dir}/states` (complete manifest required; shard checksums verified, split over
ranks) and the target's embed_tokens and lm_head only. Writes `${run_dir}/checkpoints/step_*`
(accelerate state + trainer_state.json; a crashed or killed run resumes from the newest) and
`${run_dir}/export/` (z-lab format). DDP over the ranks through accelerate; one sequence per
micro-step, `train.grad_accum_steps` micro-steps per optimizer step; AdamW with warm-up then
cosine decay; gradient clipping; bf16 autocast on GPU.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

from dflash.atomic import read_json, write_json_atomic
from dflash.config import Config
from dflash.drafter.data import StatesDataset, first, split_ids
from dflash.drafter.export import drafter_arch, export_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.objective import acceptance_lengths, run_blocks, sample_anchors
from dflash.runtime import Runtime
from dflash.store import StateReader
from dflash.store.shards import verify_shard
from dflash.target.embeddings import load_embeddings
from dflash.telemetry import WandbRun, nvml_metrics

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"


def run(cfg: Config, rt: Runtime, wandb_run: WandbRun) -> None:
    # -- validate --------------------------------------------------------------------------
    states_dir = rt.run_dir / "states"
    reader = StateReader(states_dir)  # refuses an unfinished extraction
    manifest = reader.manifest
    for rel in manifest["shards"][rt.rank::rt.world_size]:  # every rank checks its share
        verify_shard(states_dir, rel, manifest["shard_info"][rel], check_hash=cfg.train.verify_checksums)
    arch = drafter_arch(cfg.drafter, manifest)
    train_ids, heldout_ids = split_ids(reader.sample_ids, cfg.train.eval_fraction, cfg.seed)
    if not train_ids:
        raise ValueError(f"no training samples: {len(reader.sample_ids)} stored, all held out "
                         f"(train.eval_fraction={cfg.train.eval_fraction})")
    if not heldout_ids:
        log.warning("no held-out samples among the %d stored (train.eval_fraction=%g): stage=eval will "
                    "have nothing to measure", len(reader.sample_ids), cfg.train.eval_fraction)

    on_gpu = rt.device.type == "cuda"
    precision = cfg.train.mixed_precision if cfg.train.mixed_precision != "auto" else ("bf16" if on_gpu else "no")
    use_flex = cfg.train.uses_flex_attention(on_gpu)
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.train.grad_accum_steps,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                              cpu=not on_gpu)
    device = accelerator.device
    frozen_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    embed_tokens, lm_head = load_embeddings(cfg.model.path, frozen_dtype, device)
    torch.manual_seed(cfg.seed)
    model = DFlashDrafter(arch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas),
                                  weight_decay=cfg.train.weight_decay)
    loader = DataLoader(StatesDataset(states_dir, train_ids), batch_size=1, shuffle=True, collate_fn=first,
                        num_workers=cfg.train.num_workers, generator=torch.Generator().manual_seed(cfg.seed),
                        persistent_workers=cfg.train.num_workers > 0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps_per_epoch = math.ceil(len(loader) / cfg.train.grad_accum_steps)
    total_steps = cfg.train.num_epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(cfg.train.warmup_fraction * total_steps),
                                                total_steps)
    accelerator.register_for_checkpointing(scheduler)

    # -- resume ----------------------------------------------------------------------------
    ckpt_root = rt.run_dir / "checkpoints"
    state = {"step": 0, "epoch": 0, "micro_in_epoch": 0}
    latest = latest_checkpoint(ckpt_root)
    if latest is not None:
        saved = read_json(latest / TRAINER_STATE)
        if saved["arch"] != json.loads(json.dumps(asdict(arch))):
            raise ValueError(f"{latest} holds a drafter of another architecture ({saved['arch']}); "
                             "delete the checkpoints dir or use another run_name")
        accelerator.load_state(str(latest))
        state = {k: saved[k] for k in state}
        log.info("resumed from %s: step %d, epoch %d", latest, state["step"], state["epoch"])
    num_params = sum(p.numel() for p in model.parameters())
    log.info("drafter %s: %s parameters, layers %s, block %d; %d train / %d held-out samples; %d steps "
             "(%d per epoch) of %d sequences per rank x %d ranks; %s precision, %s attention",
             cfg.drafter.name, f"{num_params:,}", list(arch.layer_types), arch.block_size, len(train_ids),
             len(heldout_ids), total_steps, steps_per_epoch, cfg.train.grad_accum_steps, rt.world_size,
             precision, "flex" if use_flex else "sdpa")
    wandb_run.define_step_axis("train")

    # -- loop ------------------------------------------------------------------------------
    meter = TrainMeter(arch.block_size)
    step, epoch = state["step"], state["epoch"]
    while step < total_steps and epoch < cfg.train.num_epochs:
        loader.set_epoch(epoch)
        skip = state["micro_in_epoch"] if epoch == state["epoch"] else 0
        micro = skip
        wait_start = time.monotonic()
        for sample in (accelerator.skip_first_batches(loader, skip) if skip else loader):
            meter.wait_s += time.monotonic() - wait_start
            micro += 1
            with accelerator.accumulate(model):
                # Anchors re-drawn every epoch, reproducibly (a resumed run draws the same ones).
                generator = torch.Generator().manual_seed(anchor_seed(cfg.seed, epoch, sample["sample_id"]))
                anchors = sample_anchors(sample["loss_mask"].cpu(), cfg.train.num_anchors, generator).to(device)
                if len(anchors) == 0:  # no response token: counted, and a zero loss keeps DDP in step
                    meter.num_skipped += 1
                    anchors = torch.zeros(1, dtype=torch.long, device=device)
                with accelerator.autocast():
                    scores = run_blocks(model, embed_tokens, lm_head, sample, anchors, cfg.drafter.decay_gamma,
                                        cfg.train.ce_chunk_rows, use_flex)
                loss = scores.weighted_ce_sum / scores.weight_sum.clamp_min(1e-6)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite loss at step {step}, sample id {sample['sample_id']}")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    meter.grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            meter.add(loss, scores, sample["input_ids"].shape[0])
            if accelerator.sync_gradients:
                step += 1
                if step % cfg.train.log_every_steps == 0 or step == total_steps:
                    metrics = meter.reduce_and_reset(accelerator)
                    wandb_run.log({"train/step": step, "train/epoch": epoch, "train/lr": scheduler.get_last_lr()[0],
                                   **metrics, **nvml_metrics()})
                    log.info("step %d/%d loss %.4f acceptance per block %.3f", step, total_steps,
                             metrics["train/loss"], metrics["train/acceptance_per_block"])
                done = step >= total_steps
                if step % cfg.train.checkpoint_every_steps == 0 or done:
                    save_checkpoint(accelerator, ckpt_root, step, epoch, micro, arch, cfg.train.keep_checkpoints)
                if done:
                    break
            wait_start = time.monotonic()
        else:
            epoch += 1
            continue
        break

    # -- export ----------------------------------------------------------------------------
    if rt.is_main:
        export_drafter(accelerator.unwrap_model(model), rt.run_dir / "export", getattr(torch, cfg.train.export_dtype))
        log.info("exported the drafter to %s", rt.run_dir / "export")
    skipped = (meter.reduce_and_reset(accelerator)["train/num_skipped_no_response"] if meter.num_micro
               else meter.total_skipped)
    log.info("training done at step %d; %d sequences without response tokens to anchor on were skipped "
             "(counted once per epoch)", step, skipped)
    wandb_run.summary({"train/final_step": step, "train/num_skipped_no_response": skipped})
    accelerator.wait_for_everyone()


def anchor_seed(seed: int, epoch: int, sample_id: int) -> int:
    """Seed of one sequence's anchors in one epoch: the same on every run and world size."""
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + sample_id) % 2**62


class TrainMeter:
    """Sums since the last log: loss, per-slot accuracy, acceptance length per training block,
    throughput, data-loader wait."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.total_skipped = 0
        self.grad_norm = float("nan")
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.num_micro, self.tokens, self.wait_s = 0.0, 0, 0, 0.0
        self.tau_sum, self.num_blocks, self.num_skipped = 0.0, 0, 0
        self.correct = torch.zeros(self.block_size)
        self.valid = torch.zeros(self.block_size)
        self.start = time.monotonic()

    def add(self, loss: torch.Tensor, scores, num_tokens: int) -> None:
        self.loss_sum += float(loss.detach())
        self.num_micro += 1
        self.tokens += num_tokens
        scored = scores.label_valid[:, 1]
        self.tau_sum += float(acceptance_lengths(scores.correct, scores.label_valid)[scored].sum())
        self.num_blocks += int(scored.sum())
        self.correct += (scores.correct & scores.label_valid).sum(0).float().cpu()
        self.valid += scores.label_valid.sum(0).float().cpu()

    def reduce_and_reset(self, accelerator: Accelerator) -> dict[str, float]:
        """Metrics summed over ranks (a collective: every rank calls it at the same step)."""
        elapsed = time.monotonic() - self.start
        local = torch.tensor([self.loss_sum, self.num_micro, self.tokens, self.wait_s, self.tau_sum,
                              self.num_blocks, self.num_skipped, elapsed, *self.correct, *self.valid],
                             dtype=torch.float64, device=accelerator.device)
        total = accelerator.reduce(local, reduction="sum").cpu()
        world = accelerator.num_processes
        loss_sum, num_micro, tokens, wait_s, tau_sum, num_blocks, num_skipped, elapsed_sum = total[:8].tolist()
        correct, valid = total[8:8 + self.block_size], total[8 + self.block_size:]
        self.total_skipped += int(num_skipped)
        elapsed_mean = elapsed_sum / world
        metrics = {
            "train/loss": loss_sum / max(num_micro, 1),
            "train/grad_norm": self.grad_norm,
            "train/acceptance_per_block": tau_sum / num_blocks if num_blocks else float("nan"),
            "train/throughput(tokens/s)": tokens / elapsed_mean if elapsed_mean else 0.0,
            "train/throughput(samples/s)": num_micro / elapsed_mean if elapsed_mean else 0.0,
            "train/dataloader_wait(fraction)": wait_s / elapsed_sum if elapsed_sum else 0.0,
            "train/num_skipped_no_response": self.total_skipped,
        }
        for k in range(1, self.block_size):
            metrics[f"train/accuracy/slot_{k:02d}"] = float(correct[k] / valid[k]) if valid[k] else float("nan")
        self._reset()
        return metrics


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint (`step_*` with its trainer_state.json), or None."""
    done = [p for p in ckpt_root.glob("step_*") if (p / TRAINER_STATE).exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None


def save_checkpoint(accelerator: Accelerator, ckpt_root: Path, step: int, epoch: int, micro_in_epoch: int,
                    arch, keep: int) -> None:
    """All ranks: accelerate state (model, optimizer, scheduler, RNGs) into a temporary dir;
    rank 0 then adds trainer_state.json and renames it `step_<n>`: a checkpoint without its
    trainer_state.json is incomplete and never resumed from."""
    tmp = ckpt_root / f"step_{step:08d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json_atomic(tmp / TRAINER_STATE, {"step": step, "epoch": epoch, "micro_in_epoch": micro_in_epoch,
                                                "arch": asdict(arch)})
        final = ckpt_root / f"step_{step:08d}"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in sorted(ckpt_root.glob("step_*"), key=lambda p: p.name)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", final)
    accelerator.wait_for_everyone()
