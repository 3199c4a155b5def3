"""Drafter training (REFERENCE 4): frozen target features, packed anchor blocks, decay-weighted CE.

Per sequence: the frozen target computes the tap-layer features of every position; A anchors are
drawn on response tokens; anchor a gets the block [token_a, MASK x (B-1)] at positions a..a+B-1,
context = features strictly before a, blocks isolated from each other, all in one packed forward
(loss.py, masks.py) that serves a whole batch of right-padded sequences (in parts, Trainer._parts).
Block position k is trained against the token at a + k (same-position labels) with weight exp(-(k-1)/gamma);
a step's loss is the batch's weighted mean, so that the gradient clip of 1.0 only trims outliers.
--distill replaces the CE on the data's token with the KL divergence from the target's own distribution
for that token (computed at the position before it, from the final normed states the feature pass
produces anyway): sampled responses then teach what the target would pick, and every label carries
the whole distribution rather than one token.
AdamW, warmup then cosine over the step or time budget, gradient clipping, bf16 autocast,
checkpoint/resume, JSON-lines log, export in the z-lab format.

Feature preconditioning: target residual streams carry a few channels whose values are hundreds of
times larger than the rest (massive activations, near-constant over positions). Fed raw to a randomly
initialised `fc`, they dominate its output, `hidden_norm` then maps every context row to nearly the
same vector, and the drafter learns almost nothing for hundreds of steps (measured: acc@1 ~0.1 after
230 steps). Training therefore feeds `features * scale` with scale = 1 / per-channel RMS, and export
folds the scale into `fc.weight` (fc(x * s) == (W diag(s)) x), so the checkpoint format is unchanged.

Norm gains: AdamW moves every parameter by about lr per step, which is slow for the gains, whose useful
values are O(1) away from their start (the shipped drafter's q/k-norm gains moved from 1.0 to ~1.1 in
768 steps; its output norm sits at 0.93 where the target's own averages 1.8). A fresh drafter
therefore starts its output norm at the target's final-norm gain, the gains never decay, and
--norm-lr-scale lets them move faster than the matrices.

Weight average (--ema DECAY): the trainer also keeps an exponential moving average of the weights,
updated after every step (torch's AveragedModel), evaluates it at the end and exports it as
RUN/drafter-ema beside RUN/drafter, so that a pick can weigh one against the other. A short run continued
from a shipped drafter ends on its last steps' noise; the average over the last ~1 / (1 - DECAY) steps
may accept more.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..drafter.checkpoint import STORAGES, load_drafter, save_drafter, stored_as, validate_pair
from ..drafter.config import DrafterConfig, default_target_layer_ids
from ..drafter.model import DFlashDrafter
from ..drafter.reach import copied_from_beyond
from ..errors import UserError
from ..models import init_random_
from ..progress import bar, stderr
from .loss import acceptance_by_position, block_loss, labelled, walked_acceptance
from .masks import default_gamma, loss_weights
from .parallel import Group
from .repeats import MIN_REPEAT, with_repeat_anchors
from .shards import Sequence, iter_batches, length_batches, long_batches_kept, read_all, split_held_out, split_long


MASK_ELEMENTS = 1 << 28  # per training forward (Trainer._parts): 0.25 GiB as booleans
# block queries per training forward (Trainer._parts). Activations grow with the queries (--anchors
# blocks for every sequence, however short), not with the batch's tokens: a part of 48 short sequences
# (196,608 queries) had 54 GiB allocated when it ran out of memory beside a second training run on an
# H200. On batches of ~22 short sequences this bound took the peak from 14.5 to 9.4 GiB for 1% more
# time per step (scripts/gpu/profile_train.py)
PART_QUERIES = 1 << 16
# Trainer.deep_eval: held-out sequences that copy from beyond this many tokens back, read with the whole context
# and with the drafter's window capped here (the sliding window of existing engines that lost acceptance on
# deep prompts); --long-share counts the sequences longer than this as long
DEEP_WINDOW = 4096


@dataclass
class TrainConfig:
    data: str
    out: str
    model: str | None = None
    layers: int = 3
    taps: int = 5
    block_size: int = 16
    layer_types: tuple[str, ...] = ()  # empty: all full_attention
    sliding_window: int = 2048
    intermediate_size: int | None = None  # default: the target's; with init_from, wider than its MLPs widens them
    mask_token_id: int | None = None  # default: picked from the tokenizer's special tokens
    anchors: int = 256
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    steps: int | None = None
    max_minutes: float | None = None
    batch_tokens: int = 16384
    grad_clip: float = 1.0
    gamma: float | None = None
    seed: int = 0
    log_every: int = 10
    # an evaluation (a block at every response position of the held-out sequences) and a checkpoint take
    # ~4 s together on an H200, next to ~0.15 s per step
    eval_every: int = 400
    ckpt_every: int = 400
    eval_fraction: float = 0.02  # held out by content (shards.split_held_out), the same in every run
    attention: str = "auto"  # auto | flex | sdpa
    device: str = "auto"
    resume: bool = False
    init_from: str | None = None  # an exported drafter to continue from (fresh optimizer and schedule)
    norm_lr_scale: float = 1.0  # learning rate of the norm gains relative to --lr (module doc)
    grow_layers: int = 0  # with init_from: full-attention layers appended as identities (zeroed output projections)
    cudnn_attention: bool = False  # True: SDPA may use cuDNN attention, which plans per shape (9x slower steps)
    pad_to: int = 256  # > 0: context lengths rounded up to a multiple and anchors padded to --anchors (few shapes)
    distill: bool = False  # True: KL to the target's next-token distribution instead of CE on the data's tokens
    repeat_anchors: bool = False  # True: anchors also on a prompt's repeat of its own opening (repeats.py)
    long_share: float | None = None  # at most this share of an epoch's batches hold sequences over deep_window
    attention_chunk: int = 16  # SDPA path: anchor blocks per query chunk (chunks.py); 0: all in one chunk
    storage: str | None = None  # the exported drafter's matrices: bf16 or int8 rows (drafter.save_drafter);
    # None: as the init_from drafter stores them, else bf16
    ema: float = 0.0  # > 0: also keep the weights' moving average at this decay per step (module doc)
    deep_window: int = DEEP_WINDOW  # deep_eval's cap, and what --long-share counts as long
    mask_elements: int = MASK_ELEMENTS  # a training forward's attention mask at most (Trainer._parts)
    part_queries: int = PART_QUERIES  # a training forward's block queries at most (Trainer._parts)
    min_repeat: int = MIN_REPEAT  # --repeat-anchors: the shortest repeat of a prompt's opening (repeats.py)

    def validated(self) -> TrainConfig:
        if self.steps is None and self.max_minutes is None:
            raise UserError("give a budget: --steps N and/or --max-minutes M")
        if self.attention not in ("auto", "flex", "sdpa"):
            raise UserError(f"--attention must be auto, flex or sdpa, got {self.attention!r}")
        if self.block_size < 2:
            raise UserError("--block-size must be at least 2 for training")
        if self.layer_types and len(self.layer_types) != self.layers:
            raise UserError(f"--layer-types lists {len(self.layer_types)} layers, --layers is {self.layers}")
        if self.resume and self.init_from:
            raise UserError("--resume continues a run's checkpoint, --init-from starts a run from a drafter: pick one")
        if self.grow_layers and not self.init_from:
            raise UserError("--grow-layers adds layers to the drafter of --init-from; give one")
        if self.grow_layers < 0:
            raise UserError(f"--grow-layers must be >= 0, got {self.grow_layers}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise UserError(f"--intermediate-size must be positive, got {self.intermediate_size}")
        if self.eval_every < 1 or self.ckpt_every < 1:
            raise UserError(f"--eval-every and --ckpt-every must be >= 1, got {self.eval_every} and {self.ckpt_every}")
        if self.attention_chunk < 0:
            raise UserError(f"--attention-chunk must be >= 0, got {self.attention_chunk}")
        if self.pad_to < 0:
            raise UserError(f"--pad-to must be >= 0, got {self.pad_to}")
        if self.long_share is not None and not 0 < self.long_share < 1:
            raise UserError(f"--long-share must be between 0 and 1 (exclusive), got {self.long_share}")
        if self.storage is not None and self.storage not in STORAGES:
            raise UserError(f"--storage must be one of {', '.join(STORAGES)}, got {self.storage!r}")
        if self.norm_lr_scale <= 0:
            raise UserError(f"--norm-lr-scale must be positive, got {self.norm_lr_scale}")
        if self.gamma is not None and self.gamma <= 0:
            raise UserError(f"--gamma must be positive, got {self.gamma}")
        if not 0 <= self.ema < 1:
            raise UserError(f"--ema must be in [0, 1), got {self.ema}")
        return self


@dataclass
class Progress:
    """Where a run is; saved in checkpoints."""

    step: int = 0
    elapsed: float = 0.0
    tokens: int = 0
    history: list[dict] = field(default_factory=list)

    def summary(self, weights: str | None = None) -> dict:
        """What an exported drafter's training.json says of the run's progress: its last evaluation of
        those weights (the run's own, or "ema": their average)."""
        evaluations = [r for r in self.history if r.get("weights") == weights]
        return {**({"weights": weights} if weights else {}), "steps": self.step, "tokens": self.tokens,
                "elapsed_s": round(self.elapsed, 1), "last_eval": evaluations[-1] if evaluations else None}


def pick_mask_token(tokenizer, stop_ids: frozenset[int]) -> int:
    """A token whose frozen embedding stands for "masked": a dedicated mask token if the vocabulary
    has one, else the highest-id special token that is not a stop/bos token (rarely used)."""
    added = tokenizer.hf.get_added_vocab()
    for text, idx in added.items():
        if "mask" in text.lower():
            return idx
    specials = sorted(i for t, i in added.items() if i not in stop_ids and t != tokenizer.hf.bos_token)
    if not specials:
        raise UserError("the tokenizer has no spare special token to use as the mask; pass --mask-token-id")
    return specials[-1]


def drafter_config_for(target_cfg, tc: TrainConfig, mask_token: int, trained_ctx: int) -> DrafterConfig:
    types = [{"full": "full_attention", "sliding": "sliding_attention"}.get(t, t) for t in tc.layer_types] or \
        ["full_attention"] * tc.layers
    return DrafterConfig.from_hf({
        "architectures": ["DFlashDraftModel"],
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": tc.intermediate_size or target_cfg.intermediate_size,
        "num_hidden_layers": tc.layers,
        "num_attention_heads": target_cfg.num_heads,
        "num_key_value_heads": target_cfg.num_kv_heads,
        "head_dim": target_cfg.head_dim,
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope.theta,
        "rope_scaling": None if target_cfg.rope.kind == "default" else target_cfg.rope.to_hf(),
        "layer_types": types,
        "sliding_window": tc.sliding_window,
        "block_size": tc.block_size,
        "num_target_layers": target_cfg.num_layers,
        "vocab_size": target_cfg.vocab_size,
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "tie_word_embeddings": target_cfg.tie_word_embeddings,
        "dflash_config": {"mask_token_id": mask_token, "block_size": tc.block_size,
                          "target_layer_ids": list(default_target_layer_ids(target_cfg.num_layers, tc.taps)),
                          "trained_context_length": trained_ctx},
    })




def sample_anchors(seq: Sequence, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` sorted anchor positions on response tokens that have at least one label after them."""
    candidates = torch.nonzero(seq.loss_mask[:-1]).flatten()
    if candidates.numel() > count:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]].sort().values
    return candidates


def saved_weights(state: dict, averaged: bool = False) -> dict[str, torch.Tensor] | None:
    """A checkpoint's drafter weights (Trainer._save_checkpoint): the run's own, or its weight average, which
    AveragedModel keeps under "module." beside its count of steps (None if the run kept none)."""
    if not averaged:
        return state["drafter"]
    if state.get("averaged") is None:
        return None
    return {k.removeprefix("module."): v for k, v in state["averaged"].items() if k.startswith("module.")}


def output_norm_gain(target) -> torch.Tensor:
    """The per-channel gain of the target's final norm (offset-style norms store gain - 1)."""
    weight = target.model.norm.weight.detach().float()
    return weight + (1.0 - getattr(target, "norm_neutral", 1.0))


def fold_feature_scale(drafter: DFlashDrafter, scale: torch.Tensor) -> DFlashDrafter:
    """A copy of a drafter trained on features * scale that reads raw features: fc.weight * scale."""
    folded = copy.deepcopy(drafter)
    with torch.no_grad():
        folded.fc.weight.mul_(scale.to(folded.fc.weight))
    return folded


class Trainer:
    def __init__(self, tc: TrainConfig, target, tokenizer, device: torch.device, group: Group | None = None):
        self.tc, self.target, self.device = tc.validated(), target, device
        self.group = group or Group()  # data-parallel workers (parallel.py); alone by default
        seqs, self.data_meta = read_all(Path(tc.data))
        self.eval_seqs, self.train_seqs = split_held_out(seqs, tc.eval_fraction)
        self._deep_seqs: dict[int, list[Sequence]] = {}  # deep_eval's picks, by window
        trained_ctx = int(self.data_meta.get("max_len") or max(len(s) for s in seqs))
        mask = tc.mask_token_id if tc.mask_token_id is not None else \
            pick_mask_token(tokenizer, tokenizer.stop_ids(target.cfg.eos_token_ids))
        self.cfg = drafter_config_for(target.cfg, tc, mask, trained_ctx)
        start = load_drafter(tc.init_from) if tc.init_from else None
        # a start drafter gives its architecture (plus grown layers, wider MLPs), mask token and taps; this
        # data gives the context
        if start is not None:
            width = tc.intermediate_size or start.cfg.intermediate_size
            if width < start.cfg.intermediate_size:
                raise UserError(f"--intermediate-size {width} would narrow the MLPs of --init-from's drafter "
                                f"({start.cfg.intermediate_size}); it can only widen them")
            self.cfg = dataclasses.replace(start.cfg, trained_context_length=trained_ctx,
                                           num_layers=start.cfg.num_layers + tc.grow_layers,
                                           layer_types=start.cfg.layer_types + ("full_attention",) * tc.grow_layers,
                                           intermediate_size=width)
            validate_pair(self.cfg, target.cfg)
        # a drafter continued session after session keeps its storage (int8 rows keep a deeper one in
        # the 25 MB the repository ships)
        self.storage = tc.storage or (stored_as(tc.init_from) if tc.init_from else "bf16")
        self.drafter = init_random_(DFlashDrafter(self.cfg), tc.seed).to(device)
        with torch.no_grad():  # the drafter's output feeds the target's lm_head: start at the target's output scale
            self.drafter.norm.weight.copy_(output_norm_gain(target))
        self.weights = loss_weights(tc.block_size, tc.gamma or default_gamma(tc.block_size)).to(device)
        self.opt = torch.optim.AdamW(self._param_groups(), lr=tc.lr, betas=(0.9, 0.95))
        self.progress = Progress()
        self.feature_scale = self._measure_feature_scale(self.train_seqs[:16])
        if start is not None:
            self._load_exported(start)
        self.averaged = AveragedModel(self.drafter, multi_avg_fn=get_ema_multi_avg_fn(tc.ema)) if tc.ema else None
        self.train_seqs = self.train_seqs[self.group.rank::self.group.world] or self.train_seqs
        self.repeat_tokens = 0  # loss positions --repeat-anchors added (each worker marks its own share)
        if tc.repeat_anchors:
            self._mark_repeats()
        if tc.long_share is not None:
            self._report_long_share()
        self.generator = torch.Generator().manual_seed(tc.seed + 1 + self.group.rank)
        self.attention = self._choose_attention()
        self.out = Path(tc.out)
        self.out.mkdir(parents=True, exist_ok=True)
        if tc.resume:
            self._load_checkpoint()
        # every replica starts alike
        self.group.share([*self.drafter.parameters(), self.feature_scale, *self._averaged_state()])
        self.started = time.perf_counter() - self.progress.elapsed  # the budget's wall-clock origin
        self.clock = self.fraction_done()  # the budget share all workers agree on (parallel.py)
        self.finished = self.clock >= 1.0

    # --- budget and schedule ------------------------------------------------------------------------
    def fraction_done(self, step: int | None = None, elapsed: float | None = None) -> float:
        """The share of the budget spent after `step` steps and `elapsed` seconds (default: so far)."""
        tc, p = self.tc, self.progress
        step, elapsed = (p.step if step is None else step), (p.elapsed if elapsed is None else elapsed)
        parts = []
        if tc.steps:
            parts.append(step / tc.steps)
        if tc.max_minutes:
            parts.append(elapsed / (tc.max_minutes * 60))
        return max(parts)

    def _param_groups(self) -> list[dict]:
        """Matrices decay; norm gains neither decay (toward 0 is not their neutral value) nor move at the
        matrices' pace unless --norm-lr-scale says so (module doc)."""
        params = list(self.drafter.parameters())
        return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": self.tc.weight_decay, "lr_scale": 1.0},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0,
                 "lr_scale": self.tc.norm_lr_scale}]

    def _mark_repeats(self) -> None:
        """--repeat-anchors: the training sequences' repeats of their openings become loss positions too
        (repeats.py); evaluation keeps scoring responses alone, comparable with runs without it."""
        marked = [with_repeat_anchors(s, self.tc.min_repeat) for s in self.train_seqs]
        added = [int(m.loss_mask.sum() - s.loss_mask.sum()) for m, s in zip(marked, self.train_seqs)]
        self.train_seqs, self.repeat_tokens = marked, sum(added)
        stderr.print(f"--repeat-anchors: {sum(added)} prompt positions of {sum(a > 0 for a in added)} sequences "
                     "become anchor candidates")

    def _report_long_share(self) -> None:
        short, long = split_long(length_batches(self.train_seqs, self.tc.batch_tokens), self.tc.deep_window)
        kept = long_batches_kept(len(short), len(long), self.tc.long_share)
        stderr.print(f"--long-share {self.tc.long_share}: an epoch takes {kept} of the {len(long)} batches of "
                     f"sequences longer than {self.tc.deep_window} tokens, beside {len(short)} others")

    def lr_now(self) -> float:
        """Linear warmup over the first `warmup` of the budget, then cosine down to min_lr_ratio."""
        tc, done = self.tc, self.clock
        if done < tc.warmup:
            return tc.lr * max(done / tc.warmup, 0.01)
        t = min(1.0, (done - tc.warmup) / max(1e-9, 1 - tc.warmup))
        return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    # --- one step -----------------------------------------------------------------------------------
    def _raw_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tap-layer features of right-padded sequences [b, L] (padding after a sequence cannot affect it)."""
        return self._target_pass(tokens)[0]

    def _target_pass(self, tokens: torch.Tensor, final: bool = False):
        """The frozen target over right-padded sequences [b, L]: tap-layer features and, if `final`, its
        final normed states (the last layer's capture), which --distill turns into its distributions."""
        b, length = tokens.shape
        last = self.target.cfg.num_layers - 1
        capture = [*self.cfg.target_layer_ids, *([last] if final else [])]
        with torch.no_grad(), self._autocast():
            cache = self.target.new_cache(b, length)
            _, states = self.target(tokens, torch.arange(length, device=self.device), cache, length,
                                    capture=capture, logits="none")
        if not final:
            return states, None
        width = self.target.cfg.hidden_size
        return states[..., :-width], states[..., -width:]

    def _measure_feature_scale(self, sample: list[Sequence]) -> torch.Tensor:
        """1 / per-channel RMS of the features over a sample, skipping position 0 (the attention sink
        row, whose activations are ~100x the others')."""
        squares, count = 0.0, 0
        for seq in sample:
            feats = self._raw_features(seq.tokens[None].to(self.device))[0, 1:].float()
            squares = squares + feats.square().sum(0)
            count += feats.shape[0]
        return (squares / max(count, 1)).sqrt().clamp(min=1e-3).reciprocal()

    def _load_exported(self, exported: DFlashDrafter) -> None:
        """Weights of an exported drafter, whose fc reads raw features: undo the fold for this run's scale
        (fc.weight / scale), so that the drafter computes the same function as the exported one. Grown
        layers keep their random weights but zeroed output projections: each starts as the identity on
        the residual stream, so the grown drafter also starts where the exported one ended. Widened MLPs
        take the exported units first; the new ones keep random gate/up rows and zeroed down columns, so
        they add nothing until trained."""
        state = fold_feature_scale(exported, self.feature_scale.reciprocal()).state_dict()
        own = self.drafter.state_dict()
        with torch.no_grad():
            for name, value in state.items():
                own[name][tuple(slice(0, n) for n in value.shape)].copy_(value)  # an MLP's first units if wider
            for layer in self.drafter.layers[: exported.cfg.num_layers]:
                layer.mlp.down_proj.weight[:, exported.cfg.intermediate_size :].zero_()
            for layer in self.drafter.layers[exported.cfg.num_layers :]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        grown = tuple(f"layers.{i}." for i in range(exported.cfg.num_layers, self.cfg.num_layers))
        assert set(state) == {k for k in own if not k.startswith(grown)}, sorted(set(state) ^ set(own))

    def _padded(self, length: int) -> int:
        """A sequence length rounded up to --pad-to (within the target's context): every new length is a
        new shape for the attention kernels, and some plan per shape on the host."""
        pad = self.tc.pad_to
        return min(-(-length // pad) * pad, self.target.cfg.max_position_embeddings) if pad else length

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def batch_loss(self, batch: list[Sequence], attention: str | None = None, train: bool = True):
        """(weighted mean loss, per-k acceptance): the share of blocks whose drafts 1..k all match. Over
        random anchors, so not the AL decoding reaches (evaluate walks for that)."""
        with self._sdpa_backends():
            return self._batch_loss(batch, attention, train)

    def _sdpa_backends(self):
        """All SDPA backends but cuDNN attention, unless --cudnn-attention: every sequence length is a
        new shape, for which cuDNN builds a new plan on the host (an H200 step took 1.76 s with it,
        0.22 s without; 0.19 s also with --pad-to 256)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [b for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
                    if self.tc.cudnn_attention or b != SDPBackend.CUDNN_ATTENTION]
        return sdpa_kernel(backends)

    def _batch_loss(self, batch: list[Sequence], attention: str | None, train: bool):
        # every host-to-device copy first (_batch_inputs), then one forward (and backward) per part
        parts = [self._batch_inputs(part) for part in self._parts(batch)]
        labels = [None if anchors is None else labelled(anchors, lengths, loss_mask, real, self.cfg.block_size)
                  for _, lengths, loss_mask, anchors, real in parts]
        # the loss is the batch's weighted mean CE: each part's weighted sum over the whole batch's weight,
        # known before any forward, so that every part can run its backward at once
        batch_weight = sum((self.weights * label[0]).sum() for label in labels if label is not None)
        total = weight = torch.zeros((), device=self.device)
        accepted = counts = torch.zeros(self.cfg.block_size - 1, device=self.device)
        for inputs, label in zip(parts, labels):
            if label is None:  # no response token to learn from
                continue
            loss, w, a, c = self._part_loss(inputs, attention or self.attention, train, label)
            if train:
                (loss / batch_weight).backward()  # frees this part's graph before the next
            accepted = accepted + acceptance_by_position(a, self.cfg.block_size)
            total, weight, counts = total + loss.detach(), weight + w, counts + c
        return total / weight.clamp(min=1), accepted / counts.clamp(min=1)

    def _part_loss(self, inputs, attention: str, train: bool, label=None, window: int | None = None, passed=None):
        """block_loss of one part's _batch_inputs, after the target's feature pass (`passed`: its result, if
        the caller has it)."""
        tokens, lengths, loss_mask, anchors, real = inputs
        feats, final = passed or self._target_pass(tokens, final=self.tc.distill)
        with self._autocast(), torch.set_grad_enabled(train):
            return block_loss(self.drafter, self.target, tokens, lengths, feats * self.feature_scale, loss_mask,
                              anchors, real, self.weights, attention, final, label, self.tc.attention_chunk, window)

    def _parts(self, batch: list[Sequence]) -> list[list[Sequence]]:
        """The batch in parts of at most tc.part_queries block queries whose attention masks stay within
        tc.mask_elements (rows x queries x keys, the keys being the context and one query chunk's blocks):
        the mask is the largest tensor of a training forward (the additive form SDPA reads is 2 bytes per
        element per query head group)."""
        queries = self.tc.anchors * self.cfg.block_size
        parts: list[list[Sequence]] = [[]]
        for seq in sorted(batch, key=len):
            keys = self._padded(len(seq)) + (self.tc.attention_chunk * self.cfg.block_size or queries)
            rows = len(parts[-1]) + 1
            if parts[-1] and (rows * queries * keys > self.tc.mask_elements or rows * queries > self.tc.part_queries):
                parts.append([])
            parts[-1].append(seq)
        return parts

    def _batch_inputs(self, batch: list[Sequence], every_anchor: bool = False):
        """The batch on the device, right-padded to one length (--pad-to): tokens, lengths, loss masks,
        anchors [b, A] (None if no sequence has a response token) and each row's real anchor count. A is
        --anchors with --pad-to, else the most any sequence has, rounded up to whole query chunks; shorter
        rows repeat their last anchor. every_anchor: a block at every response position (evaluation).
        All host-to-device copies happen here, before the step's GPU work: a copy from pageable memory
        waits for the GPU's queue, and one per sequence between the GPU work serialised host and GPU."""
        drawn = [sample_anchors(seq, len(seq) if every_anchor else self.tc.anchors, self.generator) for seq in batch]
        most = max(a.numel() for a in drawn)
        count = self.tc.anchors if self.tc.pad_to and not every_anchor else most
        chunk = self.tc.attention_chunk
        count = -(-count // chunk) * chunk if chunk else count  # whole query chunks
        anchors = torch.zeros(len(batch), count, dtype=torch.long)
        for row, a in zip(anchors, drawn):
            if a.numel():
                row.copy_(torch.cat([a, a[-1:].expand(count - a.numel())]))
        longest = self._padded(max(len(s) for s in batch))
        tokens = torch.zeros(len(batch), longest, dtype=torch.long)
        loss_mask = torch.zeros(len(batch), longest, dtype=torch.bool)
        for i, s in enumerate(batch):
            tokens[i, : len(s)] = s.tokens
            loss_mask[i, : len(s)] = s.loss_mask
        lengths = torch.tensor([len(s) for s in batch])
        real = torch.tensor([a.numel() for a in drawn])
        tokens, lengths, loss_mask, anchors, real = (t.to(self.device) for t in (tokens, lengths, loss_mask, anchors,
                                                                                 real))
        return tokens, lengths, loss_mask, anchors if most else None, real

    def step(self, batch: list[Sequence]) -> dict:
        began = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss, accept = self.batch_loss(batch)
        params = list(self.drafter.parameters())
        after = self.fraction_done(self.progress.step + 1, time.perf_counter() - self.started)
        tokens, self.clock, after = self.group.average_step(params, [sum(len(s) for s in batch),
                                                                     self.fraction_done(), after])
        self.finished = after >= 1.0
        for group in self.opt.param_groups:
            group["lr"] = self.lr_now() * group["lr_scale"]
        norm = torch.nn.utils.clip_grad_norm_(params, self.tc.grad_clip)
        self.opt.step()
        if self.averaged is not None:
            self.averaged.update_parameters(self.drafter)
        # reading the values waits for the step's GPU work, so that tok/s times it, not just its launch
        loss, accept, norm = float(loss), [round(float(a), 4) for a in accept], float(norm)
        p = self.progress
        p.step += 1
        p.tokens += round(tokens * self.group.world)
        seconds = time.perf_counter() - began
        p.elapsed = time.perf_counter() - self.started  # wall clock: evals and checkpoints count too
        return {"step": p.step, "loss": loss, "accept": accept, "grad_norm": norm, "lr": self.lr_now(),
                "tok_per_s": tokens * self.group.world / seconds, "elapsed_s": round(p.elapsed, 1)}

    def evaluate(self, seqs: list[Sequence] | None = None, window: int | None = None) -> dict:
        """On held-out sequences (the first 32 by default), with a block at every response position (no
        random draw): the weighted loss, per k the share of blocks that keep draft k, and the AL greedy
        speculation reaches walking each response as the engine does (walked_acceptance); `window`: the
        drafter sees at most that many positions back (deep_eval)."""
        return self._evaluate(seqs, (window,))[0]

    @torch.no_grad()
    def _evaluate(self, seqs: list[Sequence] | None, windows: tuple) -> list[dict]:
        """evaluate() once per window, with one target pass per sequence for them all (the features do not
        depend on the drafter's window)."""
        self.drafter.eval()
        zero, zeros = torch.zeros((), device=self.device), torch.zeros(self.cfg.block_size - 1, device=self.device)
        sums = [{"loss": zero, "weight": zero, "accepted": zeros, "counts": zeros, "steps": 0, "tokens": 0}
                for _ in windows]
        attention = "sdpa" if self.device.type == "cpu" else self.attention
        with self._sdpa_backends():
            for seq in self.eval_seqs[:32] if seqs is None else seqs:
                inputs = self._batch_inputs([seq], every_anchor=True)
                anchors, real = inputs[3:]
                if anchors is None:
                    continue
                passed = self._target_pass(inputs[0], final=self.tc.distill)
                n = int(real[0])
                for window, total in zip(windows, sums):
                    part, w, a, c = self._part_loss(inputs, attention, train=False, window=window, passed=passed)
                    walked = walked_acceptance(anchors[0, :n].tolist(), a[0, :n].tolist(), len(seq))
                    total.update(loss=total["loss"] + part, weight=total["weight"] + w, counts=total["counts"] + c,
                                 accepted=total["accepted"] + acceptance_by_position(a, self.cfg.block_size),
                                 steps=total["steps"] + walked[0], tokens=total["tokens"] + walked[1])
        self.drafter.train()
        return [{"eval_loss": float(t["loss"] / t["weight"].clamp(min=1)),
                 "eval_accept": [round(float(x), 4) for x in t["accepted"] / t["counts"].clamp(min=1)],
                 "eval_al": round(t["tokens"] / max(t["steps"], 1), 3)} for t in sums]

    # --- loop -------------------------------------------------------------------------------------
    def run(self) -> Path:
        """Train until the budget is spent; the lead worker logs, evaluates, checkpoints and exports."""
        from rich.progress import TextColumn

        lead = self.group.lead
        log = (self.out / "train.jsonl").open("a") if lead else None
        if lead and self.tc.init_from and self.progress.step == 0:
            # the continued drafter on this data's held-out split: what this run adds is read against it
            # (each run restarts the schedule's warmup, and the first evaluation used to come 400 steps in)
            self._log_eval(log, deep=True)
        self.drafter.train()
        with bar(TextColumn("{task.fields[info]}"), disable=not lead) as display:
            task = display.add_task("training drafter", total=1000, info="")
            while not self.finished:
                for batch in iter_batches(self.train_seqs, self.tc.batch_tokens, self.generator, self.tc.long_share,
                                          self.tc.deep_window):
                    record = self.step(batch)
                    p = self.progress
                    display.update(task, completed=int(1000 * min(1.0, self.clock)),
                                   info=f"loss {record['loss']:.3f} accept@1 {record['accept'][0]:.2f} "
                                        f"tok/s {record['tok_per_s']:.0f}")
                    if lead and (p.step % self.tc.log_every == 0 or p.step == 1):
                        log.write(json.dumps(record) + "\n")
                        log.flush()
                    if lead and p.step % self.tc.eval_every == 0:
                        self._log_eval(log)
                    if lead and p.step % self.tc.ckpt_every == 0:
                        self._save_checkpoint()
                    if self.finished:
                        break
        if lead:
            self._log_eval(log, deep=True)
            self._save_checkpoint()
            self.export(self.out / "drafter")
            if self.averaged is not None:  # after the run's own export, which nothing here can then cost
                with self._drafter(self.averaged.module):
                    self._log_eval(log, weights="ema", deep=True)
                self._save_checkpoint()  # again, with the average's evaluation (train-drafter export --ema)
                self.export(self.out / "drafter-ema", weights="ema")
            log.close()
        # after the export, so that a drift (a bug, never seen) fails the run without losing the lead's drafter
        self.group.check_replicas(list(self.drafter.parameters()))
        return self.out / "drafter"

    def deep_eval(self) -> dict:
        """AL on the held-out sequences whose response copies most from beyond tc.deep_window tokens back (the
        32 with the largest share of 6-grams found only there; none that copies nothing from there), with
        the drafter's whole context and with it capped there: what the deep-context design is
        worth where the target needs it (`bench accept` sweeps a few prompts); {} when none qualifies. Picked
        by copying, not by length: long held-out chats, which copy little from far back, would fill the 32."""
        window = self.tc.deep_window
        deep = self._deep_seqs.get(window)
        if deep is None:  # the held-out set is fixed: the scan over it (seconds of Python) runs once a run
            deep = self._deep_seqs[window] = self._copying_from_beyond(window)
        if not deep:
            return {}
        whole, capped = self._evaluate(deep, (None, window))
        return {"deep_sequences": len(deep), "deep_al": whole["eval_al"], f"deep_al_{window}": capped["eval_al"]}

    def _copying_from_beyond(self, window: int, most: int = 32) -> list[Sequence]:
        """The `most` held-out sequences with the largest share of response 6-grams found in their prompt
        only beyond `window` tokens back (none with no such share)."""
        def reach(seq: Sequence) -> float:
            start = int(seq.loss_mask.int().argmax())
            ids = seq.tokens.tolist()
            return copied_from_beyond([ids[:start]], [ids[start:]], window) if start > window else 0.0

        shares = [(reach(seq), i) for i, seq in enumerate(self.eval_seqs)]
        return [self.eval_seqs[i] for share, i in sorted(shares, reverse=True)[:most] if share > 0]

    def _log_eval(self, log, weights: str | None = None, deep: bool = False) -> None:
        """Evaluate, log and keep the record (Progress.summary); weights names the ones evaluated when they
        are not the run's own ("ema"); deep adds deep_eval's figures (at the run's start and end only: one
        more target pass and two drafter passes over long sequences)."""
        record = {"step": self.progress.step, **({"weights": weights} if weights else {}), **self.evaluate(),
                  **(self.deep_eval() if deep else {})}
        self.progress.history.append(record)
        log.write(json.dumps(record) + "\n")
        log.flush()
        which = f" ({weights})" if weights else ""
        window = self.tc.deep_window
        depth = (f", deep AL {record['deep_al']} (capped at {window}: {record[f'deep_al_{window}']}, "
                 f"{record['deep_sequences']} sequences)" if "deep_al" in record else "")
        stderr.print(f"step {record['step']}{which}: eval loss {record['eval_loss']:.3f}, "
                     f"accept@1 {record['eval_accept'][0]:.3f}, AL {record['eval_al']}{depth}")

    @contextlib.contextmanager
    def _drafter(self, drafter: DFlashDrafter):
        """Another drafter in the run's place (the weight average, for evaluate), the run's own restored after."""
        own, self.drafter = self.drafter, drafter
        try:
            yield
        finally:
            self.drafter = own

    def _averaged_state(self) -> list[torch.Tensor]:
        """The weight average's tensors (its weights and its count of averaged steps), if one is kept."""
        return [*self.averaged.parameters(), self.averaged.n_averaged] if self.averaged is not None else []

    def export(self, folder: Path, weights: str | None = None) -> Path:
        """The run's drafter, or with weights="ema" its weight average, in the z-lab format."""
        drafter = self.averaged.module if weights == "ema" else self.drafter
        save_drafter(fold_feature_scale(drafter, self.feature_scale), folder, dtype=torch.bfloat16,
                     storage=self.storage)
        summary = {"train_config": asdict(self.tc), **self.progress.summary(weights), "data": self.data_counts()}
        (folder / "training.json").write_text(json.dumps(summary, indent=2, default=str))
        return folder

    def data_counts(self) -> dict[str, int]:
        """What the data held: sequences trained on and held out, their response tokens, and the prompt
        positions --repeat-anchors added to the training sequences' loss positions."""
        def responses(seqs):
            return sum(int(s.loss_mask.sum()) for s in seqs)

        return {"sequences": len(self.train_seqs), "held_out": len(self.eval_seqs),
                "response_tokens": responses(self.train_seqs) - self.repeat_tokens,
                "held_out_response_tokens": responses(self.eval_seqs), "repeat_tokens": self.repeat_tokens}

    # --- checkpoints --------------------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        path = self.out / "checkpoint.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(),
                    "progress": asdict(self.progress), "config": self.cfg.to_hf(), "train_config": asdict(self.tc),
                    "feature_scale": self.feature_scale,
                    "averaged": self.averaged.state_dict() if self.averaged is not None else None,
                    "generator": self.generator.get_state()}, tmp)
        tmp.replace(path)

    def _load_checkpoint(self) -> None:
        path = self.out / "checkpoint.pt"
        if not path.is_file():
            raise UserError(f"--resume: no checkpoint at {path}")
        state = torch.load(path, map_location=self.device, weights_only=False)
        saved = DrafterConfig.from_hf(state["config"])
        if saved != self.cfg:
            raise UserError(f"--resume: the checkpoint in {path} was made with a different drafter config")
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["optimizer"])
        if self.averaged is not None:
            if state.get("averaged") is None:
                raise UserError(f"--resume --ema: the checkpoint in {path} was made without --ema")
            self.averaged.load_state_dict(state["averaged"])
        self.progress = Progress(**state["progress"])
        self.feature_scale = state["feature_scale"].to(self.device)
        if self.group.lead:  # the checkpoint holds the lead's draws; the others continue on fresh ones
            self.generator.set_state(state["generator"])
        else:
            self.generator.manual_seed(self.tc.seed + 1 + self.group.rank + 7919 * self.progress.step)

    def _choose_attention(self) -> str:
        """flex_attention on CUDA when it works and agrees with the explicit mask; the explicit mask
        elsewhere. A flex failure in auto mode is reported, never hidden."""
        tc = self.tc
        if tc.attention == "sdpa" or (tc.attention == "auto" and self.device.type != "cuda"):
            return "sdpa"
        probe = self.train_seqs[:1]
        try:
            with torch.no_grad():
                state = self.generator.get_state()
                flex, _ = self.batch_loss(probe, attention="flex", train=False)
                self.generator.set_state(state)
                ref, _ = self.batch_loss(probe, attention="sdpa", train=False)
                self.generator.set_state(state)
        except Exception as err:  # noqa: BLE001 - reported loudly below
            if tc.attention == "flex":
                raise
            stderr.print(f"[yellow]flex_attention unavailable ({type(err).__name__}: {err}); "
                         "training with the explicit-mask path[/yellow]")
            return "sdpa"
        if abs(float(flex) - float(ref)) > 1e-2 * max(1.0, abs(float(ref))):
            raise RuntimeError(f"flex_attention loss {float(flex)} disagrees with the explicit mask {float(ref)}")
        return "flex"

