"""Sampled (T=1) acceptance with drafts chosen three ways, embedded pair on the CPU, 10 HumanEval prompts,
128 tokens, seed 1 (BENCHMARKS.md, "Drafts sampled with the target's noise"). Ran on a working tree
(not committed) where Steps.draft passed the request's params and seed buffer to drafter.propose, whose
drafts were sampling.choose(drafter logits, q_pos[1:], params, seed) in place of their argmax, and the
engine keyed the draft graph by the sampling settings too. This script's propose samples the first draft so and takes the argmax of the others."""
import json, sys
import torch
from deepflash import drafter as dmod, spec as spec_module
from deepflash.argmax_kernel import argmax
from deepflash.bench.accept import measure
from deepflash.bench.common import embedded_pair
from deepflash.bench.prompts import humaneval_messages
from deepflash.drafter import load_drafter
from deepflash.engine import Engine
from deepflash.sampling import SamplingParams, choose

n = int(sys.argv[1])
target, tok = embedded_pair("cpu")
prompts = [tok.chat(m) for m in humaneval_messages(n)]
drafter = load_drafter("deepflash/drafters/smollm2-135m", target.device, target.dtype)

def hybrid(drafter, target, context, last, q_pos, span=None, params=None, seed=None):
    mask = torch.full((q_pos.shape[0] - 1,), drafter.cfg.mask_token_id, dtype=torch.long, device=q_pos.device)
    block = torch.cat([last.view(1), mask])[None]
    x = drafter.block_embeddings(target.model.embed_tokens, block)
    hidden = drafter(x, q_pos, context.kv(span), context.masks(q_pos, span))
    logits = drafter.logits(hidden[0, 1:], target.lm_head)
    return torch.cat([choose(logits[:1], q_pos[1:2], params, seed), argmax(logits[1:])])

spec_module.propose = hybrid
params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=1)
plain, plain_outputs = measure(Engine(target, tok), prompts, params, warm_up=False)
r, outputs = measure(Engine(target, tok, drafter, spec="on"), prompts, params, warm_up=False)
print("hybrid", json.dumps({"acceptance_length": r["acceptance_length"], "per_position": r["per_position_acceptance"][:4],
      "same_as_plain": sum(a == b for a, b in zip(outputs, plain_outputs))}), flush=True)
