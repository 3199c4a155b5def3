"""deepflash train-drafter generate | train | export."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

from ..drafter.checkpoint import STORAGES
from ..errors import UserError
from .prompts import MAX_LONG_CHARS, PER_FILE, SHORT_TASKS, longest_opening

RECALL_LONGEST_OPENING = longest_opening(MAX_LONG_CHARS)


def register(sub) -> None:
    parser = sub.add_parser("train-drafter", help="train a DFlash drafter for a target")
    steps = parser.add_subparsers(dest="stage", required=True)

    gen = steps.add_parser("generate", help="chat prompts from local package sources, answered by the target")
    _common(gen)
    gen.add_argument("--out", required=True, help="folder for the token shards")
    gen.add_argument("--count", type=int, default=3000, help="number of prompts")
    gen.add_argument("--long-fraction", type=float, default=0.45, help="share of long-context prompts")
    gen.add_argument("--max-new-tokens", type=int, default=512)
    gen.add_argument("--max-len", type=int, help="longest prompt + response (default: the target's context)")
    gen.add_argument("--sampled-fraction", type=float, default=0.3, help="share answered at temperature 0.8")
    gen.add_argument("--batch-tokens", type=int, default=400_000, help="padded tokens per generation batch")
    gen.add_argument("--task-weights", metavar="KIND=W,...",
                     help="relative weights of the short tasks' kinds (unlisted: 1), e.g. tests=2,explain=0.5; "
                          f"kinds: {', '.join(SHORT_TASKS)}")
    gen.add_argument("--doctest-fraction", type=float, default=0.0,
                     help="share of 'complete' requests for functions with doctest examples in their docstrings "
                          "(HumanEval's form)")
    gen.add_argument("--write-fraction", type=float, default=0.0,
                     help="share of requests to write a library function from its signature and docstring summary "
                          "(answered as HumanEval is: code, then prose)")
    gen.add_argument("--recall-fraction", type=float, default=0.0,
                     help="share of raw prompts that repeat a module's opening after it, so that the target's "
                          "continuation copies from thousands of tokens back")
    gen.add_argument("--recall-min-opening", type=int, metavar="CHARS",
                     help=f"shortest opening a recall prompt repeats, in characters (default {MAX_LONG_CHARS // 4}, "
                          f"about 1.8K tokens; the longest is {RECALL_LONGEST_OPENING}): the continuation copies "
                          "from as far back as the opening is long, so 15000 (about 4.2K tokens) puts nearly every "
                          "source beyond 4096 tokens")
    gen.add_argument("--exercise-fraction", type=float, default=0.0,
                     help="share of --count made of exercises the target writes itself (a signature and docstring "
                          "per topic), asked back as 'complete' requests; the other shares apply to the rest")
    gen.add_argument("--function-offset", type=int, default=0, metavar="K",
                     help=f"the doctest and write requests skip each file's first K x {PER_FILE} qualifying functions: "
                          "another seed mostly repeats them, another offset gives new ones")
    gen.add_argument("--prompt-workers", type=int, default=0, metavar="N",
                     help="processes that build the prompts from the sources (default 0: one per CPU this process "
                          "may use); the prompts do not depend on it")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)

    train = steps.add_parser("train", help="train on generated shards; exports RUN/drafter at the end")
    _common(train)
    train.add_argument("--data", required=True)
    train.add_argument("--out", required=True, help="run folder (checkpoint, train.jsonl, drafter/)")
    train.add_argument("--layers", type=int, default=3)
    train.add_argument("--taps", type=int, default=5, help="number of target layers to read features from")
    train.add_argument("--block-size", type=int, default=16)
    train.add_argument("--layer-types", help="comma list of full|sliding per layer (default: all full)")
    train.add_argument("--sliding-window", type=int, default=2048)
    train.add_argument("--intermediate-size", type=int,
                       help="the MLPs' width (default: the target's); with --init-from, a larger one widens the "
                            "drafter's MLPs, the new units starting with zeroed down projections (they add "
                            "nothing until trained)")
    train.add_argument("--mask-token-id", type=int)
    train.add_argument("--anchors", type=int, default=256, help="anchor blocks per sequence")
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--gamma", type=float,
                       help="the loss weight of block position k is exp(-(k-1)/gamma) (default: the recipe's, 7 "
                            "for blocks of 16, 5 for 10, 4 for 8); smaller puts more of it on the first drafts")
    train.add_argument("--steps", type=int)
    train.add_argument("--max-minutes", type=float)
    train.add_argument("--batch-tokens", type=int, default=16384)
    train.add_argument("--attention", default="auto", choices=["auto", "flex", "sdpa"])
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--eval-every", type=int, default=400, help="steps between evaluations (and at the end)")
    train.add_argument("--ckpt-every", type=int, default=400, help="steps between checkpoints (and at the end)")
    train.add_argument("--resume", action="store_true")
    train.add_argument("--init-from", help="continue from an exported drafter (its architecture, mask token and "
                                           "taps; a fresh optimizer and schedule), e.g. the shipped one")
    train.add_argument("--grow-layers", type=int, default=0,
                       help="with --init-from: append this many full-attention layers, each starting as the "
                            "identity (zeroed output projections), to add capacity without starting over")
    train.add_argument("--pad-to", type=int, default=256,
                       help="round context lengths up to a multiple of this and pad anchors to --anchors, so that "
                            "the attention kernels see few shapes (0: off)")
    train.add_argument("--attention-chunk", type=int, default=16,
                       help="SDPA path: anchor blocks per query chunk; each chunk attends to the context and its own "
                            "blocks only, never scoring the other blocks' keys (0: all anchors in one chunk)")
    train.add_argument("--cudnn-attention", action="store_true",
                       help="let SDPA use cuDNN attention, which plans anew for every sequence length (9x slower "
                            "training steps on an H200)")
    train.add_argument("--distill", action="store_true",
                       help="train each block position on the KL divergence from the target's own next-token "
                            "distribution there (the frozen target computes it anyway) instead of CE on the "
                            "data's token; sampled responses then teach what the target would pick")
    train.add_argument("--repeat-anchors", action="store_true",
                       help="also anchor on a prompt's repeat of its own opening (the recall prompts' second copy, "
                            "whose source lies the opening's length back): thousands of far-copy blocks per such "
                            "sequence instead of its response's few; labels are the text's tokens, or with "
                            "--distill the target's distributions. Held-out evaluation still scores responses")
    train.add_argument("--long-share", type=float, default=None,
                       help="at most this share of an epoch's steps on batches of sequences longer than 4096 tokens "
                            "(a random subset of them each epoch; default: all, as the data's tokens fall): "
                            "batches are grouped by tokens, so a few thousand long recall prompts otherwise take "
                            "most steps, and the short chats' share, which HumanEval AL follows, shrinks")
    train.add_argument("--workers", type=int, default=1,
                       help="data-parallel training processes, averaging gradients every step; they take the GPUs "
                            "round-robin (several may share one, to overlap the steps' host work)")
    train.add_argument("--norm-lr-scale", type=float, default=1.0,
                       help="learning rate of the norm gains relative to --lr (they start O(1) from where they "
                            "end up, and AdamW moves them by about lr per step)")
    train.add_argument("--storage", choices=list(STORAGES),
                       help="the exported drafter's matrices: bf16 (the z-lab format), or int8 codes with a "
                            "scale per row, half the bytes (deepflash reads both); default: as the --init-from "
                            "drafter stores them, else bf16")
    train.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                       help="also keep a moving average of the weights (e.g. 0.998: over about the last 500 steps) "
                            "and export it as RUN/drafter-ema beside RUN/drafter (0: off)")
    train.set_defaults(func=cmd_train)

    export = steps.add_parser("export", help="export a run's latest checkpoint in the z-lab format")
    export.add_argument("--run", required=True)
    export.add_argument("--out", required=True)
    export.add_argument("--storage", default="bf16", choices=list(STORAGES),
                        help="the exported matrices: bf16, or int8 rows (see train --storage)")
    export.add_argument("--ema", action="store_true", help="export the weights' moving average (train --ema)")
    export.set_defaults(func=cmd_export)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target (default: the embedded SmolLM2-135M)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")


def _load(args):
    from ..engine.runtime import resolve_device

    device = resolve_device(args.device)
    return (*target_on(args.model, args.dtype, device), device)


def target_on(model: str | None, dtype: str, device):
    """The target and its tokenizer on one device (module-level: training workers call it by name)."""
    from ..engine.runtime import resolve_dtype
    from ..loading.targets import load_target
    from ..loading.tokenizer import load_tokenizer

    target, folder = load_target(model, device, resolve_dtype(dtype, device))
    return target, load_tokenizer(folder)


def cmd_generate(args) -> None:
    from .datagen import build_dataset
    from .exercises import ASKS_PER_EXERCISE, exercise_tasks
    from .prompts import parse_task_weights

    weights = parse_task_weights(args.task_weights)  # before loading the model: a typo fails at once
    for flag, share in (("--doctest-fraction", args.doctest_fraction), ("--write-fraction", args.write_fraction),
                        ("--recall-fraction", args.recall_fraction), ("--exercise-fraction", args.exercise_fraction)):
        if not 0 <= share <= 1:
            raise UserError(f"{flag} must be between 0 and 1, got {share}")
    if args.function_offset < 0:
        raise UserError(f"--function-offset must be 0 or more, got {args.function_offset}")
    if args.doctest_fraction + args.write_fraction + args.recall_fraction > 1:
        raise UserError(f"--doctest-fraction, --write-fraction and --recall-fraction add up to more than 1 "
                        f"({args.doctest_fraction} + {args.write_fraction} + {args.recall_fraction})")
    if args.recall_min_opening is not None and not 0 < args.recall_min_opening <= RECALL_LONGEST_OPENING:
        raise UserError(f"--recall-min-opening must be between 1 and {RECALL_LONGEST_OPENING} characters, "
                        f"got {args.recall_min_opening}")
    if args.prompt_workers < 0:
        raise UserError(f"--prompt-workers must be 0 (one per CPU) or more, got {args.prompt_workers}")
    exercises = round(args.count * args.exercise_fraction)
    started = time.perf_counter()  # the prompts before the model: a machine without sources fails at once
    tasks = _source_tasks(args, args.count - exercises, weights)
    prompt_seconds = time.perf_counter() - started
    started = time.perf_counter()
    target, tokenizer, _ = _load(args)
    load_seconds = time.perf_counter() - started
    written = exercise_tasks(target, tokenizer, exercises, args.seed) if exercises else []
    if len(written) < exercises:
        print(f"deepflash: warning: the target wrote {len(written)} usable exercises of {exercises} asked for "
              f"(from {ASKS_PER_EXERCISE} answers each)", file=sys.stderr)
    tasks += written
    if not tasks:
        raise UserError("no prompts to answer: the sources gave none and the target wrote no usable exercise")
    summary = build_dataset(target, tokenizer, tasks, Path(args.out), max_new_tokens=args.max_new_tokens,
                            max_len=args.max_len or target.cfg.max_position_embeddings,
                            batch_tokens=args.batch_tokens, sampled_fraction=args.sampled_fraction, seed=args.seed,
                            seconds={"prompts": prompt_seconds, "load": load_seconds,
                                     "exercises": time.perf_counter() - started - load_seconds})
    print(json.dumps(summary))


def _source_tasks(args, count: int, weights) -> list:
    """The prompts made from the installed sources (training_tasks), with a warning if they ran short."""
    from .prompts import training_tasks

    if count == 0:  # exercises alone need no sources
        return []
    tasks = training_tasks(count, args.long_fraction, args.seed, weights=weights,
                           doctest_fraction=args.doctest_fraction, write_fraction=args.write_fraction,
                           recall_fraction=args.recall_fraction, function_offset=args.function_offset,
                           workers=args.prompt_workers, recall_min_opening=args.recall_min_opening)
    if len(tasks) < count:  # said, not silent: the data is smaller than asked for
        print(f"deepflash: warning: {len(tasks)} prompts from the sources for {count} asked: the files ran out of "
              "functions for the doctest or write share (lower it, or --function-offset), or of modules long enough "
              "for the recall share", file=sys.stderr)
    return tasks


def cmd_train(args) -> None:
    from .trainer import TrainConfig, Trainer

    types = tuple(t.strip() for t in args.layer_types.split(",")) if args.layer_types else ()
    tc = TrainConfig(data=args.data, out=args.out, model=args.model, layers=args.layers, taps=args.taps,
                     block_size=args.block_size, layer_types=types, sliding_window=args.sliding_window,
                     intermediate_size=args.intermediate_size, mask_token_id=args.mask_token_id,
                     anchors=args.anchors, lr=args.lr, gamma=args.gamma, steps=args.steps,
                     max_minutes=args.max_minutes,
                     batch_tokens=args.batch_tokens, attention=args.attention, seed=args.seed, resume=args.resume,
                     init_from=args.init_from, norm_lr_scale=args.norm_lr_scale, grow_layers=args.grow_layers,
                     cudnn_attention=args.cudnn_attention, pad_to=args.pad_to, distill=args.distill,
                     repeat_anchors=args.repeat_anchors, long_share=args.long_share,
                     attention_chunk=args.attention_chunk, eval_every=args.eval_every, ckpt_every=args.ckpt_every,
                     storage=args.storage, ema=args.ema, device=args.device).validated()  # before the target loads
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    if args.workers > 1:
        from ..engine.runtime import resolve_device
        from .parallel import train

        load = functools.partial(target_on, args.model, args.dtype)
        folder = train(args.workers, tc, load, resolve_device(args.device))
    else:
        target, tokenizer, device = _load(args)
        folder = Trainer(tc, target, tokenizer, device).run()
    print(json.dumps({"drafter": str(folder)}))


def cmd_export(args) -> None:
    import torch

    from ..drafter.checkpoint import save_drafter
    from ..drafter.config import DrafterConfig
    from ..drafter.model import DFlashDrafter
    from .trainer import Progress, fold_feature_scale, saved_weights

    path = Path(args.run) / "checkpoint.pt"
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    drafter = DFlashDrafter(DrafterConfig.from_hf(state["config"]))
    weights = saved_weights(state, averaged=args.ema)
    if weights is None:
        raise UserError(f"--ema: the run in {args.run} keeps no weight average (train --ema)")
    drafter.load_state_dict(weights)
    drafter = fold_feature_scale(drafter, state["feature_scale"])
    folder = save_drafter(drafter, args.out, storage=args.storage)
    # which step this is and how the run was set up: an export made while the run trains (collect.sh arms,
    # which a session may ship by hand) cannot tell otherwise
    summary = {"checkpoint": str(path), "train_config": state["train_config"],
               **Progress(**state["progress"]).summary("ema" if args.ema else None)}
    (folder / "training.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({"drafter": str(folder)}))
