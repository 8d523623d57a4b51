"""Runs z-lab's reference DFlash (PyPI `dflash` 0.1.0, imported as `zlab_dflash`) on our export.

    python tests/reference_runner.py REF_SITE EXPORT_DIR TARGET_DIR INPUTS.pt OUT.pt

Started in a subprocess by tests/integration/test_reference.py: the reference's import name is
`dflash`, like ours, so its package is copied under another name into REF_SITE. It
(a) loads the export with `DFlashDraftModel.from_pretrained`, (b) computes draft hidden states
for the given inputs, (c) runs its greedy speculative decoding (`dflash_generate`) with the
target on the given prompts and records the acceptance lengths.

About (c): the reference verifies with transformers' DynamicCache and rolls rejected tokens back
with `crop`, which for Gated-DeltaNet layers trims only the conv state, not the recurrent state
(transformers 5.24 `LinearAttentionCacheLayerMixin.crop`): on a hybrid target its verification
then drifts from greedy decoding. `RecomputingTarget` gives the reference an exact target: it
keeps the committed tokens and recomputes the whole sequence at every call (slow, fine for a toy).
"""

import sys
import time
from types import SimpleNamespace

import torch
from torch import nn


class RecomputingTarget(nn.Module):
    """A causal LM whose "cache" is the committed token list; the reference's DynamicCache only
    carries the committed length (dummy entries), which its `crop` cuts back after each step."""

    def __init__(self, lm):
        super().__init__()
        from transformers import Qwen3Config

        self.lm = lm
        self.config = Qwen3Config(num_hidden_layers=1)  # a plain one-layer cache to count tokens
        self.history = None

    @property
    def device(self):
        return self.lm.device

    def get_input_embeddings(self):
        return self.lm.get_input_embeddings()

    @property
    def lm_head(self):
        return self.lm.lm_head

    def forward(self, input_ids, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep=None, output_hidden_states=False, **kwargs):
        committed = past_key_values.get_seq_length()
        prefix = self.history[:, :committed] if committed else input_ids[:, :0]
        self.history = torch.cat([prefix, input_ids], dim=1)
        out = self.lm(self.history, use_cache=False, output_hidden_states=output_hidden_states)
        new = input_ids.shape[1]
        dummy = torch.zeros(1, 1, new, 1, device=input_ids.device)
        past_key_values.update(dummy, dummy, 0)
        keep = new if not logits_to_keep else logits_to_keep
        hidden = tuple(h[:, -new:] for h in out.hidden_states) if output_hidden_states else None
        return SimpleNamespace(logits=out.logits[:, -keep:], hidden_states=hidden)


def main(ref_site, export_dir, target_dir, inputs_path, out_path):
    sys.path.insert(0, ref_site)
    import zlab_dflash.model as reference
    from transformers import AutoModelForCausalLM

    reference._cuda_time = time.perf_counter  # its timing helper syncs CUDA; we run on the CPU
    inputs = torch.load(inputs_path)
    draft = reference.DFlashDraftModel.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = draft(position_ids=inputs["position_ids"], noise_embedding=inputs["noise_embedding"],
                       target_hidden=inputs["target_hidden"])
    target = RecomputingTarget(AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval())
    acceptance, outputs = [], []
    for prompt, max_new in zip(inputs["prompts"], inputs["max_new_tokens"]):
        result = reference.dflash_generate(draft, target, prompt[None], max_new_tokens=max_new,
                                           stop_token_ids=None, return_stats=True)
        acceptance.append(result.acceptance_lengths)
        outputs.append(result.output_ids[0])
    torch.save({"hidden": hidden, "acceptance_lengths": acceptance, "output_ids": outputs,
                "target_layer_ids": list(draft.target_layer_ids), "block_size": draft.block_size,
                "mask_token_id": draft.mask_token_id}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:6])
