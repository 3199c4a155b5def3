"""GPU smoke checks before the long stages: graphs vs eager, speculative vs plain (greedy and
sampled) on the real embedded model in bf16, quick step timings, and a flex_attention probe."""

import argparse
import json
import time

import torch

from deepflash.bench.common import embedded_pair
from deepflash.bench.prompts import humaneval_messages
from deepflash.bench.speed import never_matching_drafter
from deepflash.drafter.config import DrafterConfig
from deepflash.drafter.model import DFlashDrafter
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.train.datagen import generate_batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    target, tok = embedded_pair(args.device)
    dev, dtype = target.device, target.dtype
    prompts = [tok.chat(m) for m in humaneval_messages(args.prompts)]
    cfg = DrafterConfig.from_hf({
        "architectures": ["DFlashDraftModel"], "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "block_size": 16, "num_target_layers": 30, "vocab_size": 49152,
        "max_position_embeddings": 8192, "dflash_config": {"mask_token_id": 16, "target_layer_ids": [1, 8, 14, 20, 27]}})
    drafter = never_matching_drafter(DFlashDrafter(cfg).to(dev, dtype))
    out = {}
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens)
    eager = [Engine(target, tok, cuda_graphs=False).complete(p, greedy).token_ids for p in prompts]
    graphs = [Engine(target, tok).complete(p, greedy).token_ids for p in prompts]
    spec = [Engine(target, tok, drafter, spec="on").complete(p, greedy).token_ids for p in prompts]
    out["graphs_equal_eager"] = sum(a == b for a, b in zip(eager, graphs)) / len(prompts)
    out["spec_equal_plain_greedy"] = sum(a == b for a, b in zip(spec, graphs)) / len(prompts)
    sampled = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, seed=5)
    a = [Engine(target, tok).complete(p, sampled).token_ids for p in prompts]
    b = [Engine(target, tok, drafter, spec="on").complete(p, sampled).token_ids for p in prompts]
    out["spec_equal_plain_sampled"] = sum(x == y for x, y in zip(a, b)) / len(prompts)
    stops = tok.stop_ids(target.cfg.eos_token_ids)
    for name, params in [("greedy", greedy), ("sampled", sampled)]:
        seeds = list(range(len(prompts)))
        eager_batch = generate_batch(target, prompts, args.max_new_tokens, stops, params, seeds, cuda_graphs=False)
        graph_batch = generate_batch(target, prompts, args.max_new_tokens, stops, params, seeds)
        out[f"datagen_graphs_equal_eager_{name}"] = sum(
            x == y for x, y in zip(eager_batch, graph_batch)) / len(prompts)
    for name, engine in [("plain eager", Engine(target, tok, cuda_graphs=False)), ("plain graphs", Engine(target, tok)),
                         ("spec graphs, random drafter", Engine(target, tok, drafter, spec="on"))]:
        engine.complete(prompts[0], greedy)
        began = time.perf_counter()
        r = engine.complete(prompts[-1], SamplingParams(max_new_tokens=2 * args.max_new_tokens))
        out[f"{name} tok/s"] = r.generated_tokens / (time.perf_counter() - began)
    if dev.type == "cuda":
        out["flex_probe"] = flex_probe(dev)
    print(json.dumps(out, indent=2))
    if args.out:
        open(args.out, "w").write(json.dumps(out, indent=2))


def flex_probe(dev):
    from deepflash.train.flex import block_mask_for, flex_attend
    from deepflash.train.masks import training_mask, training_mask_mod

    try:
        anchors = torch.tensor([3, 40, 77, 200], device=dev)
        seq_len, block = 256, 16
        q = torch.randn(1, 8, 64, 64, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, 4, seq_len + 64, 64, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        bm = block_mask_for(training_mask_mod(anchors, seq_len, block, False, None), 64, seq_len + 64, dev)
        got = flex_attend(q, k, v, bm)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=training_mask(anchors, seq_len, block, False, None), enable_gqa=True)
        return {"ok": True, "max_abs_diff": float((got - ref).abs().max())}
    except Exception as err:  # noqa: BLE001 - recorded, the chain goes on
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}


if __name__ == "__main__":
    main()
