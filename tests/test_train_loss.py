"""Drafter training's loss: the training masks against a naive rule, chunked and flex attention against
the dense masked one, loss weights, acceptance counting and the engine's walk, the training forward of a
block against the engine's draft of it, and loss invariants (batches, parts, padding, distillation's
teachers)."""


from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_target, tiny_tokenizer, train_dataset

from deepflash.drafter.context import DrafterContext
from deepflash.train.datagen import build_dataset
from deepflash.train.loss import acceptance_by_position, accepted_drafts, block_loss, walked_acceptance
from deepflash.train.masks import default_gamma, loss_weights, training_mask, training_mask_mod
from deepflash.train.prompts import Task
from deepflash.train.shards import read_all
from deepflash.train.trainer import TrainConfig, Trainer, fold_feature_scale


def naive_allowed(anchors, seq_len, block, causal, window, q, kv):
    """The rule of REFERENCE 4, one query/key pair at a time."""
    a, k = divmod(q, block)
    q_position = anchors[a] + k
    if kv < seq_len:  # context: strictly before the anchor (and inside a sliding window)
        return kv < anchors[a] and (window is None or q_position - kv < window)
    b, k2 = divmod(kv - seq_len, block)
    if b != a:  # blocks never see each other
        return False
    if causal and k2 > k:
        return False
    return window is None or abs(k - k2) < window


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3), (False, 5)])
def test_training_mask_equals_naive_rule(causal, window):
    anchors, seq_len, block = torch.tensor([0, 3, 4, 9]), 12, 4
    mask = training_mask(anchors, seq_len, block, causal, window)
    mod = training_mask_mod(anchors, seq_len, block, causal, window)
    for q in range(mask.shape[0]):
        for kv in range(mask.shape[1]):
            want = naive_allowed(anchors.tolist(), seq_len, block, causal, window, q, kv)
            assert bool(mask[q, kv]) == want, (q, kv)
            assert bool(mod(0, 0, torch.tensor(q), torch.tensor(kv))) == want, (q, kv)
    # one row of anchors per sequence: each sequence's own mask
    batch = torch.stack([anchors, torch.tensor([1, 2, 6, 11])])
    batched, mod = training_mask(batch, seq_len, block, causal, window), training_mask_mod(batch, seq_len, block,
                                                                                          causal, window)
    for b in range(2):
        assert torch.equal(batched[b], training_mask(batch[b], seq_len, block, causal, window))
        assert all(bool(mod(torch.tensor(b), 0, torch.tensor(q), torch.tensor(kv))) == bool(batched[b, q, kv])
                   for q in range(0, batched.shape[1], 3) for kv in range(batched.shape[2]))


@pytest.mark.parametrize("causal,window", [(False, None), (True, 3)])
def test_chunked_attention_equals_the_dense_masked_one(causal, window):
    """Query chunks that see [context, own blocks] give the dense training mask's outputs and gradients
    (other chunks' block keys are masked there anyway); GQA heads, two sequences."""
    from deepflash.drafter.model import attend
    from deepflash.models.layers import fold_mask
    from deepflash.train.chunks import chunked_mask

    gen = torch.Generator().manual_seed(0)
    anchors = torch.tensor([[0, 3, 4, 9, 10, 11], [1, 2, 6, 7, 8, 11]])
    b, seq_len, block, heads, kv_heads, dim = 2, 12, 4, 4, 2, 8
    q_len = anchors.shape[1] * block
    q = torch.randn(b, heads, q_len, dim, generator=gen, requires_grad=True)
    ctx_k, ctx_v = (torch.randn(b, kv_heads, seq_len, dim, generator=gen, requires_grad=True) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, q_len, dim, generator=gen, requires_grad=True) for _ in range(2))
    dense = training_mask(anchors, seq_len, block, causal, window)[:, None]
    for blocks in (1, 2, 3):
        chunked = chunked_mask(anchors, seq_len, block, causal, window, blocks, heads // kv_heads, q.dtype)
        folded = fold_mask(dense, heads // kv_heads, q.dtype)  # attend takes masks folded for attention
        outs = [attend(q, ctx_k, ctx_v, k, v, mask) for mask in (folded, chunked)]
        grads = [torch.autograd.grad(out.square().sum(), (q, ctx_k, ctx_v, k, v)) for out in outs]
        torch.testing.assert_close(outs[1], outs[0])
        for got, want in zip(*grads[::-1]):
            torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="do not split"):
        chunked_mask(anchors, seq_len, block, causal, window, 4, 2, q.dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's backward needs CUDA (the CPU has none)")
def test_flex_attention_equals_the_dense_masked_one_without_a_compile_per_shape():
    """The flex path (CUDA) gives the dense training mask's outputs and gradients for batches of several
    context lengths and sequence counts, as training meets them, and compiles a few graphs in all, not
    one per shape (dynamo's limit of 8 then sent the rest to the unfused path: 9x slower steps)."""
    import torch._dynamo.utils as dynamo_utils

    from deepflash.drafter.model import attend
    from deepflash.models.layers import fold_mask
    from deepflash.train.flex import block_mask_for

    gen = torch.Generator(device="cuda").manual_seed(0)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    for b, seq_len in [(2, 256), (3, 512), (1, 768), (2, 1280), (4, 1792), (3, 2304)]:
        anchors = torch.randint(1, seq_len, (b, 32), device="cuda", generator=gen).sort(dim=1).values
        q_len = anchors.shape[1] * block

        def rand(*shape):
            return torch.randn(*shape, device="cuda", generator=gen, requires_grad=True)

        q, k, v = rand(b, heads, q_len, dim), rand(b, kv_heads, q_len, dim), rand(b, kv_heads, q_len, dim)
        ctx_k, ctx_v = rand(b, kv_heads, seq_len, dim), rand(b, kv_heads, seq_len, dim)
        dense = fold_mask(training_mask(anchors, seq_len, block, False, None)[:, None], heads // kv_heads, q.dtype)
        flex = block_mask_for(training_mask_mod(anchors, seq_len, block, False, None), q_len, seq_len + q_len,
                              "cuda", batch=b)
        outs = [attend(q, ctx_k, ctx_v, k, v, mask) for mask in (dense, flex)]
        grads = [torch.autograd.grad(out.square().sum(), (q, ctx_k, ctx_v, k, v)) for out in outs]
        torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)
        for got, want in zip(*grads[::-1]):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs <= 4


def test_decay_weights_start_at_one():
    w = loss_weights(16, default_gamma(16))
    assert w.shape == (15,) and w[0] == 1.0 and torch.isclose(w[7], torch.exp(torch.tensor(-1.0)))
    assert default_gamma(10) == 5 and default_gamma(8) == 4


def test_a_block_counts_as_accepted_up_to_its_first_miss():
    hits = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    accepted = accepted_drafts(hits)
    assert accepted.tolist() == [2, 1, 0, 4]
    assert acceptance_by_position(accepted, 5).tolist() == [3, 2, 1, 1]  # blocks that keep draft k


def test_the_walk_anchors_each_step_after_the_previous_one_commits():
    """Blocks at every position of a response 10..19: the engine's steps start at 10, then after each
    step's accepted drafts and its own token; blocks in between are never drafted."""
    anchors = list(range(10, 19))
    accepted = {10: 2, 11: 7, 12: 7, 13: 0, 14: 3, 15: 3, 16: 2, 17: 1, 18: 0}
    steps, tokens = walked_acceptance(anchors, [accepted[p] for p in anchors], end=20)
    assert (steps, tokens) == (4, 9)  # 10 -> 13 -> 14 -> 18 -> end; every token after 10 committed once


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return train_dataset(tmp_path_factory)


@pytest.mark.parametrize("layer_types", [[], ["sliding_attention", "full_attention"]])
def test_training_scores_a_block_as_the_engine_drafts_it(dataset, tmp_path, layer_types):
    """The training forward of an anchor block and the engine's draft of the same block are one
    computation: context features strictly before the anchor, [anchor token, MASK x (B-1)] at positions
    anchor + k, labels at anchor + k (REFERENCE 3-4). Scored with the exported drafter through the
    inference path (DrafterContext, drafter.logits), the blocks give the training loss."""
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=2, taps=2, block_size=4, steps=1,
                     attention="sdpa", mask_token_id=95, layer_types=layer_types, sliding_window=6)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    with torch.no_grad():  # away from the initialisation, whose zeroed projections hide the attention
        for p in trainer.drafter.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    seq = max(read_all(data)[0], key=len)
    anchors = torch.nonzero(seq.loss_mask[:-4]).flatten()[[0, 3, 10]]
    tokens = seq.tokens[None]
    feats, _ = trainer._target_pass(tokens)
    loss, *_ = block_loss(trainer.drafter, target, tokens, torch.tensor([len(seq)]), feats * trainer.feature_scale,
                          seq.loss_mask[None], anchors[None], torch.tensor([3]), trainer.weights, "sdpa")
    exported = fold_feature_scale(trainer.drafter, trainer.feature_scale)
    drafted = 0.0
    for a in anchors.tolist():
        context = DrafterContext(exported, window=512)
        context.append(torch.arange(a), feats[0, :a])
        q_pos = torch.arange(a, a + 4)
        block = torch.tensor([[int(seq.tokens[a]), 95, 95, 95]])
        hidden = exported(exported.block_embeddings(target.model.embed_tokens, block), q_pos, context.kv(),
                          context.masks(q_pos))
        logits = exported.logits(hidden[0, 1:], target.lm_head)
        drafted += (F.cross_entropy(logits, seq.tokens[a + 1 : a + 4], reduction="none") * trainer.weights).sum()
    torch.testing.assert_close(loss.detach(), drafted.detach(), rtol=1e-5, atol=1e-5)


def test_cudnn_attention_switch_gives_the_same_loss(dataset, tmp_path):
    """--cudnn-attention only widens SDPA's choice of kernels (the CPU has no cuDNN attention)."""
    target, tok, data, _ = dataset
    common = dict(data=str(data), layers=1, taps=2, block_size=4, steps=1, anchors=64, attention="sdpa",
                  mask_token_id=95, eval_fraction=0.25)
    losses = [Trainer(TrainConfig(out=str(tmp_path / str(flag)), cudnn_attention=flag, **common), target, tok,
                      torch.device("cpu")).evaluate()["eval_loss"] for flag in (True, False)]
    assert losses[0] == losses[1]


def test_padding_shapes_leaves_the_loss_unchanged(dataset, tmp_path):
    """--pad-to adds context rows no query can see and anchors without loss: the same loss and accuracy."""
    target, tok, data, _ = dataset
    common = dict(data=str(data), layers=1, taps=2, block_size=4, steps=1, anchors=64, attention="sdpa",
                  mask_token_id=95, eval_fraction=0.25)
    plain, padded = (Trainer(TrainConfig(out=str(tmp_path / str(pad)), pad_to=pad, **common), target, tok,
                             torch.device("cpu")) for pad in (0, 48))
    assert padded._padded(100) == 144 and plain._padded(100) == 100
    torch.testing.assert_close(padded.feature_scale, plain.feature_scale)
    a, b = plain.evaluate(), padded.evaluate()
    assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-4 and a["eval_accept"] == b["eval_accept"]


def test_a_batch_trains_like_its_sequences_one_by_one(dataset, tmp_path):
    """block_loss over a padded batch (one forward) gives each sequence's loss, weights, hits and
    gradients as if it ran alone: padding rows, padded anchors and other sequences never leak in."""
    target, tok, data, _ = dataset
    # anchors above the longest response: every response token is an anchor, so no draw differs
    trainer = Trainer(TrainConfig(data=str(data), out=str(tmp_path), layers=2, taps=2, block_size=4, steps=1,
                                  anchors=64, attention="sdpa", mask_token_id=95, pad_to=0), target, tok,
                      torch.device("cpu"))
    seqs = sorted(trainer.train_seqs, key=len)[:: max(1, len(trainer.train_seqs) // 3)][:3]
    assert len({len(s) for s in seqs}) > 1

    def run(batch):
        trainer.drafter.zero_grad()
        tokens, lengths, loss_mask, anchors, real = trainer._batch_inputs(batch)
        feats = trainer._raw_features(tokens) * trainer.feature_scale
        out = list(block_loss(trainer.drafter, target, tokens, lengths, feats, loss_mask, anchors, real,
                              trainer.weights, "sdpa"))
        out[2] = acceptance_by_position(out[2], 4)  # per k: sums over sequences
        out[0].backward()
        return [*out, *(p.grad.clone() for p in trainer.drafter.parameters())]

    together = run(seqs)
    alone = [sum(parts) for parts in zip(*(run([s]) for s in seqs))]
    for got, want in zip(together, alone):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("limit", ["mask_elements", "part_queries"])
def test_a_batch_split_in_parts_gives_the_same_loss(dataset, tmp_path, limit):
    """Batches whose masks would exceed TrainConfig.mask_elements, or whose block queries part_queries, run
    in parts: same loss and accuracy."""
    target, tok, data, _ = dataset
    trainer = Trainer(TrainConfig(data=str(data), out=str(tmp_path), layers=1, taps=2, block_size=4, steps=1,
                                  anchors=64, attention="sdpa", mask_token_id=95, pad_to=0), target, tok,
                      torch.device("cpu"))
    batch = trainer.train_seqs[:5]
    whole = trainer.batch_loss(batch, train=False)
    two_rows = {"mask_elements": 64 * 4 * (16 * 4 + max(map(len, batch))) * 2,  # 16-block chunks
                "part_queries": 64 * 4 * 2}
    trainer.tc = replace(trainer.tc, **{limit: two_rows[limit]})
    assert len(trainer._parts(batch)) >= 3
    split = trainer.batch_loss(batch, train=False)
    torch.testing.assert_close(split[0], whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split[1], whole[1])


def test_a_step_follows_the_weighted_mean_loss_whole_or_in_parts(dataset, tmp_path):
    """The gradient of a step is that of the batch's weighted mean CE (REFERENCE 4's clip of 1.0 assumes
    a mean), whether the batch runs whole or in parts."""
    target, tok, data, _ = dataset
    trainer = Trainer(TrainConfig(data=str(data), out=str(tmp_path), layers=1, taps=2, block_size=4, steps=1,
                                  anchors=64, attention="sdpa", mask_token_id=95, pad_to=0), target, tok,
                      torch.device("cpu"))
    batch = trainer.train_seqs[:5]

    def grads(run):
        trainer.drafter.zero_grad()
        run()
        return [p.grad.clone() for p in trainer.drafter.parameters()]

    def mean_loss():
        tokens, lengths, loss_mask, anchors, real = trainer._batch_inputs(batch)
        feats = trainer._raw_features(tokens) * trainer.feature_scale
        loss, weight, _, _ = block_loss(trainer.drafter, target, tokens, lengths, feats, loss_mask, anchors, real,
                                        trainer.weights, "sdpa")
        (loss / weight).backward()

    want = grads(mean_loss)
    whole = grads(lambda: trainer.batch_loss(batch))
    trainer.tc = replace(trainer.tc, mask_elements=64 * 4 * (16 * 4 + max(map(len, batch))) * 2)  # 16-block chunks
    assert len(trainer._parts(batch)) >= 3
    split = grads(lambda: trainer.batch_loss(batch))
    for w, a, b in zip(want, whole, split):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b, w, rtol=1e-4, atol=1e-6)


def test_distillation_reads_the_target_distribution_that_predicts_each_label(dataset, tmp_path):
    """--distill: the teacher of the token at p is the target's output at p - 1 (no shift either way),
    and its KL loss is CE minus the target's entropy, per label."""
    from deepflash.train.loss import _head_loss

    target, tok, data, _ = dataset
    trainer = Trainer(TrainConfig(data=str(data), out=str(tmp_path), layers=1, taps=2, block_size=4, steps=1,
                                  anchors=64, attention="sdpa", mask_token_id=95, distill=True), target, tok,
                      torch.device("cpu"))
    seq = trainer.train_seqs[0]
    tokens = seq.tokens[None]
    _, final = trainer._target_pass(tokens, final=True)
    cache = target.new_cache(1, tokens.shape[1])
    logits, _ = target(tokens, torch.arange(tokens.shape[1]), cache, tokens.shape[1], logits="all")
    torch.testing.assert_close(target.project(final, "all"), logits, rtol=1e-4, atol=1e-4)

    hidden = torch.randn(3, 2, target.cfg.hidden_size)
    labels = torch.randint(5, 90, (3, 2))
    w, valid = torch.ones(3, 2), torch.ones(3, 2, dtype=torch.bool)
    teacher = final[0, :6].view(3, 2, -1)
    kl, _ = _head_loss(trainer.drafter, target, hidden, labels, w, valid, teacher)
    log_q = torch.log_softmax(trainer.drafter.logits(hidden, target.lm_head).float(), -1)
    log_p = torch.log_softmax(target.project(teacher, "all").float(), -1)
    cross, entropy = -(log_p.exp() * log_q).sum(-1), -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(kl, (cross - entropy).sum(), rtol=1e-4, atol=1e-4)


def test_distillation_teachers_predict_the_labels_of_greedy_data(tmp_path):
    """On responses the target wrote greedily, the teacher distribution of every label has that label
    as its argmax: labels and teachers line up (a shift by one position either way breaks this)."""
    from deepflash.train.loss import labelled, teacher_states

    target, tok = tiny_target(dtype=torch.float32), tiny_tokenizer()
    tasks = [Task("test", "x", [{"role": "user", "content": " ".join(f"w{i}" for i in range(5, 5 + n))}])
             for n in (12, 30)]
    build_dataset(target, tok, tasks, tmp_path / "data", max_new_tokens=20, max_len=120, sampled_fraction=0.0)
    trainer = Trainer(TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "run"), layers=1, taps=2,
                                  block_size=4, steps=1, anchors=64, attention="sdpa", mask_token_id=95,
                                  distill=True, pad_to=0, eval_fraction=0.0), target, tok, torch.device("cpu"))
    tokens, lengths, loss_mask, anchors, real = trainer._batch_inputs(trainer.train_seqs)
    _, final = trainer._target_pass(tokens, final=True)
    valid, label_pos = labelled(anchors, lengths, loss_mask, real, 4)
    predicted = target.project(teacher_states(final, label_pos), "all").argmax(-1).view_as(valid)
    labels = tokens.gather(1, label_pos).view_as(valid)
    assert valid.sum() > 20 and torch.equal(predicted[valid], labels[valid])
