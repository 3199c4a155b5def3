"""The command line as a user runs it: streamed text, --json results, info, and one-line errors (exit 2)."""

import json

import pytest
from helpers import DOCTEST, save_tiny_drafter, save_tiny_model, site_packages

from deepflash.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return save_tiny_drafter(tmp_path_factory.mktemp("draft"))


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_streams_text_and_ends_with_json(capsys, model_dir):
    code, out, err = run(capsys, "generate", "w5 w6 w7", "--model", model_dir, "--raw", "--max-new-tokens", 6,
                         "--json")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert {"text", "prompt_tokens", "generated_tokens", "tok_per_s"} <= result.keys()
    assert result["prompt_tokens"] == 3 and 1 <= result["generated_tokens"] <= 6
    assert out.startswith(result["text"])


def test_generate_with_drafter_reports_acceptance(capsys, model_dir, draft_dir):
    args = ["--model", model_dir, "--max-new-tokens", 12, "--temperature", 0]
    code, out, _ = run(capsys, "generate", "w9 w8", *args, "--draft", draft_dir, "--block-size", 4, "--json",
                       "--spec", "on")
    spec = json.loads(out.strip().splitlines()[-1])
    code2, out2, _ = run(capsys, "generate", "w9 w8", *args, "--json")
    plain = json.loads(out2.strip().splitlines()[-1])
    assert code == code2 == 0
    assert spec["text"] == plain["text"]  # chat template applied in both, same greedy output
    assert len(spec["acceptance_histogram"]) == 4 and spec["spec_steps"] > 0
    assert {"acceptance_length", "per_position_acceptance"} <= spec.keys()


def test_generate_prints_stats_without_json(capsys, model_dir):
    code, out, err = run(capsys, "generate", "w5", "--model", model_dir, "--raw", "--max-new-tokens", 3)
    assert code == 0 and "tok/s" in err


def test_info_and_plan(capsys, model_dir, draft_dir):
    code, out, _ = run(capsys, "info", model_dir, "--draft", draft_dir, "--plan", "--json")
    info = json.loads(out)
    assert code == 0 and info["architecture"] == "llama" and info["kv_bytes_per_token"] > 0
    assert info["plan"]["parts"]["drafter context K/V"] > 0
    code, out, _ = run(capsys, "info", model_dir, "--plan", "--max-ctx", "64")
    assert code == 0 and "target KV cache" in out and "max_ctx 64" in out


def test_rope_scaling_extends_the_context_past_the_native_window(capsys, model_dir):
    """--rope-scaling yarn:4 on a 512-position model: --max-ctx 2048 is allowed, info says where the positions
    come from, and a 600-token prompt (past 512) generates."""
    code, out, _ = run(capsys, "info", model_dir, "--rope-scaling", "yarn:4", "--json")
    info = json.loads(out)
    assert code == 0 and info["positions"] == 2048 and info["max_position_embeddings"] == 512
    assert "YaRN" in info["note"] and "512-token window" in info["note"]
    prompt = " ".join(f"w{5 + i % 80}" for i in range(600))
    code, out, _ = run(capsys, "generate", prompt, "--model", model_dir, "--raw", "--rope-scaling", "yarn:4",
                       "--max-ctx", 2048, "--max-new-tokens", 4, "--json")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["prompt_tokens"] == 600


@pytest.mark.parametrize("args,message", [
    (["--rope-scaling", "yarn:0.5"], "yarn:FACTOR with a factor above 1"),
    (["--rope-scaling", "ntk:4"], "yarn:FACTOR"),
    (["--max-ctx", "3000", "--rope-scaling", "yarn:4"], "more than the model supports: 2048 positions"),
    (["--model", "/no/such/model"], "no such model path"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--max-ctx", "4"], "context holds 4"),
    (["--max-ctx", "513"], "more than the model supports: 512 positions"),
    (["--model", "NOT_GGUF"], "is not a readable GGUF file"),
    (["--block-size", "64", "--draft", "DRAFT"], "block-size"),
    (["--draft", "/no/such/drafter"], "no such drafter"),
    (["--device", "cuda:0"], "CUDA"),
])
def test_user_errors_exit_2_with_one_line(capsys, model_dir, draft_dir, args, message, monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("DEEPFLASH_CACHE", str(tmp_path / "cache"))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("a text file, so named")
    args = [str(draft_dir) if a == "DRAFT" else str(not_gguf) if a == "NOT_GGUF" else a for a in args]
    if "--model" not in args:
        args += ["--model", str(model_dir)]
    code, out, err = run(capsys, "generate", "w5 w6 w7 w8 w9", "--raw", *args)
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("shares,flag", [(("--doctest-fraction", "1.5"), "--doctest-fraction"),
                                         (("--write-fraction", "-0.1"), "--write-fraction"),
                                         (("--doctest-fraction", "0.6", "--write-fraction", "0.5"), "add up"),
                                         (("--function-offset", "-1"), "--function-offset"),
                                         (("--prompt-workers", "-1"), "--prompt-workers"),
                                         (("--recall-min-opening", "0"), "--recall-min-opening"),
                                         (("--recall-min-opening", "19501"), "--recall-min-opening"),
                                         (("--exercise-fraction", "1.2"), "--exercise-fraction")])
def test_generate_data_refuses_shares_outside_0_1_and_negative_offsets(capsys, tmp_path, shares, flag):
    code, _, err = run(capsys, "train-drafter", "generate", "--out", tmp_path, *shares)
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1


def test_generate_data_says_when_it_has_fewer_prompts_than_asked(capsys, tmp_path, model_dir, monkeypatch):
    """Files with one doctest function each: at --function-offset 1 the doctest share finds none, and the
    data comes out smaller than --count with a warning, not silently."""
    site_packages(tmp_path, monkeypatch, lambda i: DOCTEST)
    code, out, err = run(capsys, "train-drafter", "generate", "--model", model_dir, "--out", tmp_path / "data",
                         "--count", 4, "--doctest-fraction", 0.5, "--function-offset", 1, "--long-fraction", 0,
                         "--max-new-tokens", 4, "--device", "cpu")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["sequences"] == 2
    assert "warning: 2 prompts from the sources for 4 asked" in err


def test_generate_data_says_when_the_target_wrote_fewer_exercises_than_asked(capsys, tmp_path, model_dir,
                                                                           monkeypatch):
    """A random-weight target writes no Python: the exercise share comes out empty with a warning, and
    a run of exercises alone fails with one line instead of writing no data."""
    site_packages(tmp_path, monkeypatch, lambda i: DOCTEST)
    args = ["--model", model_dir, "--long-fraction", 0, "--max-new-tokens", 4, "--device", "cpu"]
    code, out, err = run(capsys, "train-drafter", "generate", "--out", tmp_path / "data", "--count", 4,
                         "--exercise-fraction", 0.5, *args)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["sequences"] == 2
    assert "the target wrote 0 usable exercises of 2" in err
    code, _, err = run(capsys, "train-drafter", "generate", "--out", tmp_path / "none", "--count", 2,
                       "--exercise-fraction", 1, *args)
    assert code == 2 and "no prompts to answer" in err


def test_training_settings_are_checked_before_the_target_loads(capsys, tmp_path):
    code, _, err = run(capsys, "train-drafter", "train", "--data", tmp_path, "--out", tmp_path / "run", "--steps", "1",
                       "--gamma", "0", "--model", "/no/such/model")
    assert code == 2 and "--gamma" in err and len(err.strip().splitlines()) == 1


def test_every_help_states_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "(default: 256)" in out and "(default: auto)" in out and "(default: 0.0)" in out


def test_unsupported_architecture_exits_2(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    code, _, err = run(capsys, "generate", "hi", "--model", tmp_path)
    assert code == 2 and "supported model types" in err
