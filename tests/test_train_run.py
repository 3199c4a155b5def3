"""Drafter training runs on a tiny random target: settings, a few steps lower the loss and the exported
drafter loads and keeps the greedy contract, the feature scale folded into the export, --init-from (and
growing layers or width), --resume, the weight average (--ema), the norm gains' learning rate, the deep
evaluation, and distillation with int8 storage."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import train_dataset

from deepflash.cli import main
from deepflash.drafter.checkpoint import load_drafter, save_drafter
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError
from deepflash.train.shards import Sequence, read_all
from deepflash.train.trainer import TrainConfig, Trainer, fold_feature_scale


@pytest.mark.parametrize("bad,message", [(dict(steps=None), "give a budget"), (dict(eval_every=0), "--eval-every"),
                                         (dict(ckpt_every=0), "--ckpt-every"), (dict(gamma=0.0), "--gamma"),
                                         (dict(ema=1.0), "--ema")])
def test_training_settings_are_checked(bad, message):
    with pytest.raises(UserError, match=message):
        TrainConfig(**{"data": "d", "out": "o", "steps": 1, **bad}).validated()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return train_dataset(tmp_path_factory)


def test_training_lowers_loss_and_exports_a_working_drafter(dataset, tmp_path):
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=2, taps=2, block_size=4, anchors=16,
                     steps=40, lr=3e-3, batch_tokens=400, eval_every=1000, ckpt_every=20, log_every=1,
                     eval_fraction=0.25, attention="sdpa", mask_token_id=95)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    first = trainer.evaluate()["eval_loss"]
    folder = trainer.run()
    last = trainer.progress.history[-1]["eval_loss"]
    assert last < first - 0.3, (first, last)
    log = [json.loads(l) for l in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 1 and len(log[0]["accept"]) == 3 and log[-1]["eval_al"] >= 1
    drafter = load_drafter(folder)
    assert drafter.cfg.trained_context_length == 160 and drafter.cfg.block_size == 4
    data = json.loads((folder / "training.json").read_text())["data"]
    assert data["sequences"] + data["held_out"] == 8 and data["held_out"] >= 1 and data["response_tokens"] > 0
    # train-drafter export makes the same drafter from the run's checkpoint and says its step
    assert main(["train-drafter", "export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    exported = json.loads((tmp_path / "exported" / "training.json").read_text())
    assert exported["steps"] == 40 and exported["last_eval"] == trainer.progress.history[-1]
    assert exported["train_config"] == json.loads((folder / "training.json").read_text())["train_config"]
    prompt = [5, 9, 22, 31]
    params = SamplingParams(max_new_tokens=20)
    spec = Engine(target, tok, drafter, config=EngineConfig(spec="on")).complete(prompt, params)
    assert spec.token_ids == Engine(target, tok).complete(prompt, params).token_ids


def test_exported_drafter_reads_raw_features_like_the_trained_one_reads_scaled_ones(dataset, tmp_path):
    """Training feeds features * scale (trainer module doc); export folds the scale into fc."""
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, steps=1,
                     attention="sdpa", mask_token_id=95)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    scale = trainer.feature_scale
    assert scale.shape == (2 * target.cfg.hidden_size,) and torch.all(scale > 0)
    raw = torch.randn(7, scale.shape[0]) * 50
    folded = fold_feature_scale(trainer.drafter, scale)
    torch.testing.assert_close(folded.fuse(raw), trainer.drafter.fuse(raw * scale), rtol=1e-5, atol=1e-5)
    assert not torch.equal(folded.fc.weight, trainer.drafter.fc.weight)  # a copy, training state untouched


def test_init_from_an_exported_drafter_starts_where_it_ended(dataset, tmp_path):
    """--init-from loads the exported (scale-folded) weights back into training form: same eval loss."""
    target, tok, data, _ = dataset
    # anchors above the longest response (40 tokens): every response token is an anchor, so both
    # evaluations see the same blocks
    common = dict(data=str(data), taps=2, block_size=4, anchors=64, lr=3e-3, batch_tokens=400,
                  eval_fraction=0.25, attention="sdpa", mask_token_id=95)
    first = Trainer(TrainConfig(out=str(tmp_path / "a"), layers=2, steps=15, **common), target, tok,
                    torch.device("cpu"))
    exported = first.run()
    second = Trainer(TrainConfig(out=str(tmp_path / "b"), layers=1, steps=1, init_from=str(exported), **common),
                     target, tok, torch.device("cpu"))
    assert second.cfg.num_layers == 2  # the drafter's architecture, not --layers
    ended = first.evaluate()["eval_loss"]
    assert abs(second.evaluate()["eval_loss"] - ended) < 0.01 * ended  # bf16 export rounding only
    grown = Trainer(TrainConfig(out=str(tmp_path / "c"), layers=1, steps=3, init_from=str(exported), grow_layers=1,
                                **common), target, tok, torch.device("cpu"))
    assert grown.cfg.num_layers == 3 and grown.cfg.layer_types[-1] == "full_attention"
    assert abs(grown.evaluate()["eval_loss"] - ended) < 0.01 * ended  # the new layer starts as the identity
    grown.run()
    assert grown.drafter.layers[2].mlp.down_proj.weight.abs().sum() > 0  # and then learns
    assert grown.progress.history[0]["step"] == 0  # a continued run's first evaluation is its starting point
    width = second.cfg.intermediate_size
    wider = Trainer(TrainConfig(out=str(tmp_path / "w"), layers=1, steps=3, init_from=str(exported),
                                intermediate_size=width + 32, **common), target, tok, torch.device("cpu"))
    assert wider.cfg.intermediate_size == width + 32 and wider.cfg.num_layers == 2
    assert abs(wider.evaluate()["eval_loss"] - ended) < 0.01 * ended  # the new units start adding nothing
    wider.run()
    assert wider.drafter.layers[0].mlp.down_proj.weight[:, width:].abs().sum() > 0  # and then learn
    with pytest.raises(UserError, match="can only widen"):
        Trainer(TrainConfig(out=str(tmp_path / "n"), layers=1, steps=1, init_from=str(exported),
                            intermediate_size=width - 1, **common), target, tok, torch.device("cpu"))
    # a continued drafter keeps its storage unless --storage says otherwise
    save_drafter(load_drafter(exported), tmp_path / "int8", storage="int8")
    for init, storage, want in [(exported, None, "bf16"), (tmp_path / "int8", None, "int8"),
                                (tmp_path / "int8", "bf16", "bf16")]:
        tc = TrainConfig(out=str(tmp_path / "d"), layers=1, steps=1, init_from=str(init), storage=storage, **common)
        assert Trainer(tc, target, tok, torch.device("cpu")).storage == want


def test_resume_continues_from_the_checkpoint(dataset, tmp_path):
    target, tok, data, _ = dataset
    base = dict(data=str(data), out=str(tmp_path / "run"), layers=1, taps=1, block_size=4, anchors=8, lr=1e-3,
                batch_tokens=400, eval_every=1000, ckpt_every=5, attention="sdpa", mask_token_id=95)
    Trainer(TrainConfig(**base, steps=5), target, tok, torch.device("cpu")).run()
    resumed = Trainer(TrainConfig(**base, steps=8, resume=True), target, tok, torch.device("cpu"))
    assert resumed.progress.step >= 5
    resumed.run()
    assert resumed.progress.step == 8


def test_the_weight_average_follows_each_step_and_is_exported_beside_the_drafter(dataset, tmp_path, capsys):
    """--ema: after each step average = decay * average + (1 - decay) * weights, from the first step's weights;
    the run evaluates it and exports it as drafter-ema (train-drafter export --ema makes the same from the
    checkpoint), each export's training.json has its own weights' evaluation, and --resume carries it on."""
    from deepflash.train.shards import iter_batches

    target, tok, data, _ = dataset
    base = dict(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, anchors=16, lr=3e-3,
                batch_tokens=200, eval_every=1000, ckpt_every=1000, eval_fraction=0.25, attention="sdpa",
                mask_token_id=95, ema=0.75)
    trainer = Trainer(TrainConfig(**dict(base, out=str(tmp_path / "by-hand")), steps=3), target, tok,
                      torch.device("cpu"))
    batches = [b for _ in range(3) for b in iter_batches(trainer.train_seqs, 200, trainer.generator)]
    expected = None
    for batch in batches[:3]:
        trainer.step(batch)
        weights = [p.detach().clone() for p in trainer.drafter.parameters()]
        expected = weights if expected is None else [0.75 * e + 0.25 * w for e, w in zip(expected, weights)]
    for got, want in zip(trainer.averaged.module.parameters(), expected):
        torch.testing.assert_close(got, want)

    run = Trainer(TrainConfig(**base, steps=3), target, tok, torch.device("cpu"))
    folder = run.run()
    averaged = folder.parent / "drafter-ema"
    assert load_drafter(averaged).cfg == load_drafter(folder).cfg
    assert (averaged / "model.safetensors").read_bytes() != (folder / "model.safetensors").read_bytes()
    log = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert log[-1]["weights"] == "ema" and "weights" not in log[-2] and log[-1]["step"] == log[-2]["step"] == 3
    assert json.loads((folder / "training.json").read_text())["last_eval"] == log[-2]
    assert json.loads((averaged / "training.json").read_text())["last_eval"] == log[-1]
    assert main(["train-drafter", "export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "exported"),
                 "--ema"]) == 0
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == (averaged / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "exported" / "training.json").read_text())["last_eval"] == log[-1]

    resumed = Trainer(TrainConfig(**base, steps=5, resume=True), target, tok, torch.device("cpu"))
    assert int(resumed.averaged.n_averaged) == 3
    for got, want in zip(resumed.averaged.module.parameters(), run.averaged.module.parameters()):
        assert torch.equal(got, want)
    resumed.run()
    assert int(resumed.averaged.n_averaged) == 5
    plain = dict(base, ema=0.0, out=str(tmp_path / "plain"))
    Trainer(TrainConfig(**plain, steps=1), target, tok, torch.device("cpu")).run()
    assert not (tmp_path / "plain" / "drafter-ema").exists()
    assert main(["train-drafter", "export", "--run", str(tmp_path / "plain"), "--out", str(tmp_path / "x"),
                 "--ema"]) == 2
    assert "keeps no weight average" in capsys.readouterr().err
    with pytest.raises(UserError, match="made without --ema"):
        Trainer(TrainConfig(**dict(plain, ema=0.5), steps=2, resume=True), target, tok, torch.device("cpu"))


def test_norm_gains_start_at_the_target_scale_never_decay_and_take_their_own_learning_rate(dataset, tmp_path):
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, steps=2, lr=1e-3,
                     norm_lr_scale=10.0, attention="sdpa", mask_token_id=95)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    torch.testing.assert_close(trainer.drafter.norm.weight, target.model.norm.weight.float())
    matrices, gains = trainer.opt.param_groups
    assert all(p.ndim == 2 for p in matrices["params"]) and matrices["weight_decay"] == tc.weight_decay
    names = {id(p): n for n, p in trainer.drafter.named_parameters()}
    assert {names[id(p)].rsplit(".", 2)[-2] for p in gains["params"]} >= {"q_norm", "k_norm", "norm", "hidden_norm"}
    assert gains["weight_decay"] == 0.0
    trainer.step(trainer.train_seqs[:1])
    assert gains["lr"] == pytest.approx(10 * matrices["lr"])


def test_deep_eval_reads_the_held_out_sequences_that_copy_from_beyond_its_window(dataset, tmp_path, monkeypatch):
    """deep_eval picks the held-out sequences whose response copies from beyond DEEP_WINDOW tokens back (not
    merely long ones) and reads them with the whole context and with every layer's window capped there; a
    cap longer than the sequences changes nothing, a shorter one changes the drafter's outputs."""
    from deepflash.train.shards import write_shard

    target, tok, data, _ = dataset
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i in range(24):
        prompt = torch.randint(5, 90, (60,), generator=gen)
        response = prompt[:20] if i % 2 else torch.randint(5, 90, (20,), generator=gen)  # odd ones copy from 60 back
        seqs.append(Sequence(torch.cat([prompt, response]), torch.arange(80) >= 60))
    (tmp_path / "copies").mkdir()
    write_shard(tmp_path / "copies" / "shard-0000.safetensors", seqs, read_all(data)[1])
    tc = TrainConfig(data=str(tmp_path / "copies"), out=str(tmp_path / "run"), layers=2, taps=2, block_size=4,
                     anchors=16, steps=1, eval_fraction=0.5, attention="sdpa", mask_token_id=95, deep_window=30)
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    copying = [seq for seq in trainer.eval_seqs if torch.equal(seq.tokens[60:], seq.tokens[:20])]
    assert 0 < len(copying) < len(trainer.eval_seqs)
    record = trainer.deep_eval()
    assert record == {"deep_sequences": len(copying), "deep_al": trainer.evaluate(copying)["eval_al"],
                      "deep_al_30": trainer.evaluate(copying, window=30)["eval_al"]}
    whole = trainer.evaluate(copying)["eval_loss"]
    assert trainer.evaluate(copying, window=10_000)["eval_loss"] == whole
    assert trainer.evaluate(copying, window=30)["eval_loss"] != whole
    trainer.tc = replace(trainer.tc, deep_window=70)  # nothing copies from 70 back
    assert trainer.deep_eval() == {}


def test_distillation_trains_a_working_drafter(dataset, tmp_path):
    """Also exported as int8 rows (--storage int8), which keeps the greedy contract like any drafter."""
    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, anchors=16,
                     steps=30, lr=3e-3, batch_tokens=400, eval_every=1000, ckpt_every=1000, eval_fraction=0.25,
                     attention="sdpa", mask_token_id=95, distill=True, storage="int8")
    trainer = Trainer(tc, target, tok, torch.device("cpu"))
    first = trainer.evaluate()["eval_loss"]
    folder = trainer.run()
    assert trainer.progress.history[-1]["eval_loss"] < first - 0.1
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == "int8-rows"
    prompt, params = [5, 9, 22, 31], SamplingParams(max_new_tokens=12)
    spec = Engine(target, tok, load_drafter(folder), config=EngineConfig(spec="on")).complete(prompt, params)
    assert spec.token_ids == Engine(target, tok).complete(prompt, params).token_ids
