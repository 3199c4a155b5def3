"""CPU: AL at T=1 on HumanEval prompts with argmax drafts vs drafts sampled with the target's own
position-keyed Gumbel noise (coupled)."""
import json, sys, time
import torch
import deepflash.spec as spec_module
from deepflash.config import EngineConfig
from deepflash.runtime import load_runtime
from deepflash.sampling import SamplingParams, choose
from deepflash.bench.prompts import humaneval_messages
from deepflash.drafter import propose as argmax_propose

torch.set_num_threads(2)
count, new, temperature = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
rt = load_runtime(EngineConfig(device="cpu", spec="on"))
tok = rt.tokenizer
prompts = [tok.chat(m) for m in humaneval_messages(count)]
engine = rt.engine
current = {}

def coupled_propose(drafter, target, context, last, q_pos, span=None):
    mask = torch.full((q_pos.shape[0] - 1,), drafter.cfg.mask_token_id, dtype=torch.long, device=q_pos.device)
    block = torch.cat([last.view(1), mask])[None]
    x = drafter.block_embeddings(target.model.embed_tokens, block)
    hidden = drafter(x, q_pos, context.kv(span), context.masks(q_pos, span))
    logits = drafter.logits(hidden[0, 1:], target.lm_head)
    return choose(logits, q_pos[1:], current["params"], engine.state.seed)

out = {}
for name, fn in (("argmax", argmax_propose), ("coupled", coupled_propose)):
    spec_module.propose = fn
    steps = committed = 0
    t = time.time()
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_new_tokens=new, seed=i)
        current["params"] = params
        r = engine.complete(ids, params)
        steps += r.spec.steps
        committed += r.spec.committed
    out[name] = round(committed / steps, 4)
    print(name, out[name], f"{time.time() - t:.0f}s", flush=True)
print(json.dumps({"prompts": count, "max_new_tokens": new, "temperature": temperature, "al": out}))
