"""stage=eval: teacher-forced acceptance of the exported drafter on the held-out split.

    accelerate launch --config_file launch/cpu_2proc.yaml dflash/main.py stage=eval

Reads `${run_dir}/export/` (the servable export, so what is measured is what is served),
`${run_dir}/states` and the target's embed_tokens and lm_head. Writes `${run_dir}/eval.json`:
tau_sim (mean acceptance length per block, 1 + leading correct slots) and the accuracy of each
slot, also logged to W&B. Ranks split the held-out samples and add their sums. With no
held-out samples it warns and writes no eval.json.
"""

from __future__ import annotations

import logging

import torch
from accelerate.utils import reduce

from dflash.atomic import write_json_atomic
from dflash.config import Config
from dflash.drafter.data import StatesDataset, split_ids
from dflash.drafter.evaluate import AcceptanceTotals, evaluate_acceptance
from dflash.drafter.export import check_states_fit, load_export
from dflash.runtime import Runtime
from dflash.store import StateReader
from dflash.target.embeddings import load_embeddings
from dflash.telemetry import WandbRun

log = logging.getLogger(__name__)


def run(cfg: Config, rt: Runtime, wandb_run: WandbRun) -> None:
    export_dir = rt.run_dir / "export"
    if not (export_dir / "model.safetensors").exists():
        raise FileNotFoundError(f"{export_dir} holds no exported drafter: run stage=train first")
    reader = StateReader(rt.run_dir / "states")
    drafter = load_export(export_dir, rt.device).eval()
    check_states_fit(drafter.arch, reader.manifest)
    _, heldout_ids = split_ids(reader.sample_ids, cfg.train.eval_fraction, cfg.seed)
    if cfg.eval.max_samples is not None:
        heldout_ids = heldout_ids[: cfg.eval.max_samples]
    if not heldout_ids:  # a tau of NaN in eval.json would read like a measurement
        (rt.run_dir / "eval.json").unlink(missing_ok=True)
        log.warning("no held-out samples among the %d stored (train.eval_fraction=%g, eval.max_samples=%s): "
                    "nothing evaluated, no eval.json written", len(reader.sample_ids),
                    cfg.train.eval_fraction, cfg.eval.max_samples)
        return
    embed_tokens, lm_head = load_embeddings(cfg.model.path, torch.float32, rt.device)
    use_flex = cfg.train.uses_flex_attention(on_gpu=rt.device.type == "cuda")
    mine = StatesDataset(rt.run_dir / "states", heldout_ids[rt.rank::rt.world_size])
    local = evaluate_acceptance(drafter, embed_tokens, lm_head, (mine[i] for i in range(len(mine))),
                                cfg.eval.anchors_per_forward, cfg.train.ce_chunk_rows, use_flex)
    summed = local.as_tensor(rt.device)
    if rt.world_size > 1:
        summed = reduce(summed, reduction="sum")
    totals = AcceptanceTotals.from_tensor(summed.cpu(), drafter.arch.block_size)
    if not rt.is_main:
        return
    result = {"tau_sim": totals.tau_sim, "tau_per_position": totals.tau_per_position,
              "accuracy_per_slot": totals.accuracy_per_slot, "num_steps": totals.walk_steps,
              "num_blocks": totals.num_blocks, "num_sequences": totals.num_sequences,
              "num_skipped_no_response": totals.num_skipped, "num_heldout_samples": len(heldout_ids),
              "block_size": drafter.arch.block_size}
    write_json_atomic(rt.run_dir / "eval.json", result)
    wandb_run.summary({"eval/tau_sim": totals.tau_sim, "eval/tau_per_position": totals.tau_per_position,
                       "eval/num_steps": totals.walk_steps,
                       **{f"eval/accuracy/slot_{k:02d}": a for k, a in enumerate(totals.accuracy_per_slot, 1)}})
    log.info("held-out tau_sim %.3f (%d decoding steps of %d sequences; %.3f averaged over all %d "
             "positions); slot accuracy %s", totals.tau_sim, totals.walk_steps, totals.num_sequences,
             totals.tau_per_position, totals.num_blocks, [round(a, 3) for a in totals.accuracy_per_slot])
