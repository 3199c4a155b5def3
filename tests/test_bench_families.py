"""deepflash bench families on the CPU: its checks pass for every family at the tiny size in float32 (our CPU
forms are exact there), and a check that raises is a failed row, not the end of the run."""

import json

import pytest
import torch

from deepflash.bench import families
from deepflash.cli import main


@pytest.mark.parametrize("family", families.FAMILIES)
def test_every_family_passes_its_checks_at_the_tiny_size(family):
    row = families.check_family(family, "tiny", torch.device("cpu"), torch.float32, prompt_tokens=24, max_new=12,
                                max_ctx=128, logits_seeds=2)
    logits, spec = row["logits"], row["spec"]
    assert logits["ok"] and logits["max_abs"] <= families.MAX_ABS and logits["seeds"] == 2, logits
    assert spec["ok"] and spec["first_difference"] is None and len(spec["spec_ids"]) == 12, spec
    assert spec["spec_steps"] > 0  # the speculative engine verified blocks, not plain steps alone
    assert spec["peak_bytes"] is None  # measured on CUDA only


def test_first_difference_names_where_outputs_part():
    assert families.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert families.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert families.first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("family,ok,cosines,verdict", [
    ("qwen3.5-moe", False, (0.9922, 0.9788, 0.9927), "NO"),  # failed
    ("qwen3.5", True, (0.9987, 0.9995, 0.9986), "yes"),  # passed as rounding no worse than transformers
])
def test_a_logits_check_the_cosine_alone_does_not_pass_is_shown_with_its_float32_yardstick(family, ok, cosines,
                                                                                           verdict):
    similar, ours, its_own = cosines
    logits = {"ok": ok, "max_abs": 0.5, "cosine": similar, "cosine_to_float32": ours,
              "transformers_cosine_to_float32": its_own}
    row = {"family": family, "size": "tiny", "logits": logits, "spec": {"ok": True, "first_difference": None}}
    assert families.notes(row) == [f"{family} tiny logits: cosine {similar:.6f} to transformers; to transformers in "
                                   f"float32: ours {ours:.6f}, its own {its_own:.6f}"]
    assert families.table_row(row)[2:7] == [verdict, "5.00e-01", f"{similar:.6f}", "yes", "-"]


def test_16_bit_logits_pass_near_transformers_or_rounding_about_as_well_as_it():
    def result(similar, ours, its_own, max_abs=0.1):
        return {"max_abs": max_abs, "cosine": similar, "cosine_to_float32": ours,
                "transformers_cosine_to_float32": its_own}

    assert families.logits_pass(result(0.9995, 0.99, 0.999), torch.bfloat16)  # near transformers
    assert families.logits_pass(result(0.9987, 0.9994, 0.9986), torch.bfloat16)  # closer to float32 than it
    assert not families.logits_pass(result(0.9922, 0.9788, 0.9927), torch.float16)  # further from float32
    assert families.logits_pass(result(0.9971, 0.9956, 0.9966), torch.bfloat16)  # 1.3x its distance: chance flips
    assert not families.logits_pass(result(1.0, 1.0, 1.0, max_abs=1e-3), torch.float32)  # float32: max abs only


def test_a_check_that_raises_is_a_failed_row(monkeypatch, tmp_path, capsys):
    """As a CUDA graph capture error would: the row records the message's first line, the other check and the
    run go on, and the command still exits 0 with the failures counted."""
    def capture_fails(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA kernel errors ...")

    monkeypatch.setattr(families, "Engine", capture_fails)
    out = tmp_path / "families.json"
    code = main(["bench", "families", "--device", "cpu", "--size", "tiny", "--families", "qwen3", "--prompt-tokens",
                 "16", "--max-new-tokens", "4", "--max-ctx", "64", "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    (row,) = record["rows"]
    assert row["logits"]["ok"]
    assert not row["spec"]["ok"]
    assert row["spec"]["error"] == "RuntimeError: operation not permitted when stream is capturing"
    assert record["checks"] == 2 and record["failures"] == 1
    printed = capsys.readouterr().out
    assert "qwen3 tiny spec: RuntimeError: operation not permitted when stream is capturing" in printed
    assert "1 of 2 checks failed" in printed


def test_logits_seeds_below_one_is_a_user_error(capsys):
    assert main(["bench", "families", "--device", "cpu", "--size", "tiny", "--logits-seeds", "0"]) == 2
    assert "--logits-seeds must be at least 1, got 0" in capsys.readouterr().err
