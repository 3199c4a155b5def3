"""Feature window rule, position-tagged rings (no aliasing), quantized storage, and the contract across
storage dtypes and windows much shorter than the prompt."""

import re
from pathlib import Path

import pytest
import torch
from helpers import drafter_config, tiny_drafter, tiny_target, tiny_tokenizer

from deepflash.cli import build_parser
from deepflash.drafter.features import FeatureReadError, FeatureRing, FeatureStore, drafter_window, storage_scale
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.memory import plan_memory
from deepflash.engine.runtime import engine_config
from deepflash.engine.sampling import SamplingParams
from deepflash.errors import UserError
from deepflash.kernels.row_formats import FORMATS, row_format


@pytest.mark.parametrize("cap,want", [
    (None, 8192),        # unset: the trained window
    (0, 8192),           # 0 means unset
    (-5, 8192),          # negative means unset
    (100000, 8192),      # above the trained window means unset
    (4096, 4096),        # the valve lowers it
])
def test_window_rule(cap, want):
    assert drafter_window(max_ctx=16384, trained_ctx=8192, cap=cap) == want


@pytest.mark.parametrize("env,flag,want", [(None, None, None), ("4096", None, 4096), ("4096", "2048", 2048)])
def test_the_valve_comes_from_the_flag_else_the_environment(monkeypatch, env, flag, want):
    """--feat-ring-cap wins over DEEPFLASH_FEAT_RING_CAP; either lands in the one EngineConfig."""
    if env is not None:
        monkeypatch.setenv("DEEPFLASH_FEAT_RING_CAP", env)
    argv = ["generate", "hi"] + (["--feat-ring-cap", flag] if flag else [])
    assert engine_config(build_parser().parse_args(argv)).feat_ring_cap == want


def test_window_is_clamped_by_max_ctx_and_trained_ctx():
    assert drafter_window(max_ctx=3000, trained_ctx=8192) == 3000
    assert drafter_window(max_ctx=40960, trained_ctx=4096) == 4096
    assert drafter_window(max_ctx=40960, trained_ctx=4096, cap=1000) == 1000


def test_bad_valve_value_is_a_user_error(monkeypatch):
    monkeypatch.setenv("DEEPFLASH_FEAT_RING_CAP", "lots")
    with pytest.raises(UserError, match="DEEPFLASH_FEAT_RING_CAP"):
        engine_config(build_parser().parse_args(["generate", "hi"]))


def test_trained_window_from_config_and_override():
    target = tiny_target()
    cfg = drafter_config(target.cfg, dflash_config={"mask_token_id": 95, "target_layer_ids": [0, 2],
                                                    "trained_context_length": 64})
    assert cfg.trained_context_length == 64
    assert drafter_config(target.cfg).trained_context_length == target.cfg.max_position_embeddings
    drafter = tiny_drafter(cfg)
    assert Engine(target, tiny_tokenizer(), drafter).window == 64
    assert Engine(target, tiny_tokenizer(), drafter, config=EngineConfig(trained_ctx=32)).window == 32
    assert Engine(target, tiny_tokenizer(), drafter, config=EngineConfig(trained_ctx=32, feat_ring_cap=20)).window == 20


def encoded(positions: range, width: int) -> torch.Tensor:
    """Rows whose every value is position + 1 (constant rows survive every format to ~1e-3)."""
    return torch.tensor(list(positions), dtype=torch.float32)[:, None].repeat(1, width) + 1


def same_positions(rows: torch.Tensor, positions: range) -> bool:
    return rows.round().eq(encoded(positions, rows.shape[1])).all().item()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rings_never_alias(fmt):
    window, width = 10, 64
    ring = FeatureRing(window, width, row_format(fmt), "cpu")
    end = 0
    for n in [3, 7, 1, 10, 4, 25, 2, 9, 13]:  # runs that wrap, fill exactly, and overflow the ring
        ring.write(torch.arange(end, end + n), encoded(range(end, end + n), width))
        end += n
        for p in range(max(0, end - 40), end):
            if p >= end - window:
                assert same_positions(ring.read(p, 1), range(p, p + 1)), p
            else:
                with pytest.raises(FeatureReadError):
                    ring.read(p, 1)
        lo = max(0, end - window)
        assert same_positions(ring.read(lo, end - lo), range(lo, end))
    with pytest.raises(FeatureReadError):
        ring.read(end, 1)  # never written


@pytest.mark.parametrize("fmt,bound", [("q8_0", 1 / 254), ("q4_0", 1 / 8), ("f16", 1e-3), ("bf16", 1 / 128)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_quantized_round_trip_within_bound(fmt, bound, scale):
    """Per 32-value block: |x - decode(encode(x))| <= bound * max|x| of the block, plus the rounding of
    the fp16 scale itself (relative 2^-11 times the largest code, and subnormal steps of 2^-24)."""
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)) * scale
    f = row_format(fmt)
    y = f.decode(f.encode(x))
    blocks_x, blocks_err = x.reshape(16, -1, 32), (y - x).reshape(16, -1, 32)
    amax = blocks_x.abs().amax(-1, keepdim=True)
    assert (blocks_err.abs() <= (bound + 2.0**-11) * amax + 128 * 2.0**-24).all()


def test_block_formats_are_compact_and_need_whole_blocks():
    assert row_format("q8_0").row_bytes(2880) == 90 * 34
    assert row_format("q4_0").row_bytes(2880) == 90 * 18
    assert row_format("f32").row_bytes(2880) / row_format("q4_0").row_bytes(2880) > 7
    with pytest.raises(UserError, match="multiple of 32"):
        row_format("q4_0").row_bytes(100)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "f16"])
def test_writes_never_touch_neighbouring_rows(fmt):
    """Guard rows around every write stay bit-identical."""
    ring = FeatureRing(8, 64, row_format(fmt), "cpu")
    guard = torch.full((8, 64), 5.0)
    ring.write(torch.arange(8), guard)
    before = ring.data.clone()
    ring.write(torch.arange(3, 5), torch.randn(2, 64) * 100)  # slots 3, 4
    changed = (ring.data != before).any(-1)
    assert changed.tolist() == [False, False, False, True, True, False, False, False]


def test_mirror_is_the_ring_when_bytes_would_be_identical():
    same = FeatureStore(16, 64, "f32", torch.float32, "cpu", "cpu")
    assert same.mirror is same.ring
    other = FeatureStore(16, 64, "q4_0", torch.float32, "cpu", "cpu")
    assert other.mirror is not other.ring and other.nbytes < 2 * same.nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_default_mirror_is_the_targets_dtype_and_so_the_ring_itself(dtype):
    """'auto' stores the mirror in the target's dtype, the cheapest lossless format: on one device it is the
    ring, and the memory plan counts no mirror bytes."""
    store = FeatureStore(16, 64, EngineConfig().feature_dtype, dtype, "cpu", "cpu")
    assert store.mirror is store.ring and store.mirror.fmt.dtype == dtype


def test_the_default_mirror_drafts_what_an_f32_mirror_drafts():
    target = tiny_target(dtype=torch.bfloat16)
    drafter = tiny_drafter(drafter_config(target.cfg, block_size=4), dtype=torch.bfloat16)
    ids = torch.randint(5, 90, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    results = [Engine(target, tiny_tokenizer(), drafter, config=EngineConfig(spec="on", feature_dtype=fmt))
               .complete(ids, SamplingParams(max_new_tokens=24)) for fmt in ("auto", "f32")]
    assert results[0].token_ids == results[1].token_ids and results[0].spec.histogram == results[1].spec.histogram
    plan = plan_memory(target, drafter, 64, EngineConfig())
    assert plan.parts["drafter mirror"] == 0 and plan.feature_dtype == "bf16"


def massive_features(n: int, width: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows like a residual stream's (a few channels ~150x the rest, near-constant over positions) and an
    fc weight whose columns go as 1 / RMS of their channel, as training leaves it (trainer.py)."""
    g = torch.Generator().manual_seed(3)
    rms = torch.ones(width)
    rms[[5, 70, 200]] = torch.tensor([600.0, 150.0, 300.0])
    x = torch.randn(n, width, generator=g) * rms
    x[:, [5, 70, 200]] = rms[[5, 70, 200]] * (1 + 0.05 * torch.randn(n, 3, generator=g))
    return x, torch.randn(32, width, generator=g) / rms


def test_storage_scale_is_powers_of_two_and_finite():
    weight = torch.tensor([[1.0, 3.0, 0.25, 0.0, 1e6]]).repeat(4, 1)
    assert storage_scale(weight).tolist() == [1.0, 4.0, 0.25, 2.0**-10, 2.0**10]


@pytest.mark.parametrize("fmt,gain", [("q4_0", 2.0), ("q8_0", 2.0)])
def test_scaled_block_storage_keeps_what_fc_reads(fmt, gain):
    """Stored times storage_scale, a block format's error in fc's output falls by at least `gain` on
    rows with massive channels, and every read is a row's own, within the format's bound per channel."""
    x, weight = massive_features(12)
    errors = {}
    for scaled in (False, True):
        ring = FeatureRing(16, x.shape[1], row_format(fmt), "cpu",
                           channel_scale=storage_scale(weight) if scaled else None)
        ring.write(torch.arange(12), x)
        y = ring.read(0, 12)
        errors[scaled] = ((y - x) @ weight.T).norm() / (x @ weight.T).norm()
    assert errors[True] * gain < errors[False], errors
    scale = storage_scale(weight)
    f = row_format(fmt)
    assert torch.equal(y, f.decode(f.encode(x * scale)) / scale)  # the ring's bf16 scales are these float32 ones
    with pytest.raises(ValueError, match="exact in bfloat16"):
        FeatureRing(16, x.shape[1], f, "cpu", channel_scale=torch.full((x.shape[1],), 0.3))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q4_0"])
def test_memory_plan_counts_the_feature_stores_bytes(fmt):
    target = tiny_target(dtype=torch.float32)
    drafter = tiny_drafter(drafter_config(target.cfg, sliding=True, window=5), dtype=torch.float32)
    engine = Engine(target, tiny_tokenizer(), drafter, config=EngineConfig(feature_dtype=fmt, max_ctx=64))
    parts = plan_memory(target, drafter, 64, EngineConfig(feature_dtype=fmt)).parts
    assert parts["target feature ring"] + parts["drafter mirror"] == engine.steps.features.nbytes
    assert parts["drafter context K/V"] == engine.steps.context.nbytes


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("window", [3, 16, None])
def test_contract_holds_for_every_dtype_and_short_windows(fmt, window):
    """A short window or a lossy storage dtype may change speed, never the output."""
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(target.cfg, sliding=True, window=5, taps=(0, 1)))
    prompt = torch.randint(5, 90, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(max_new_tokens=24)
    tok = tiny_tokenizer()
    engine = Engine(target, tok, drafter, config=EngineConfig(feature_dtype=fmt, feat_ring_cap=window, spec="on", block_size=5))
    assert engine.window == (window or target.cfg.max_position_embeddings)
    assert engine.complete(prompt, params).token_ids == Engine(target, tok).complete(prompt, params).token_ids


def test_every_environment_variable_is_documented():
    """ENVIRONMENT.md lists every variable the code reads."""
    root = Path(__file__).parent.parent
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", (root / "ENVIRONMENT.md").read_text()))
    pattern = re.compile(r"""(?:os\.environ(?:\.get)?\(|os\.getenv\(|os\.environ\[)\s*["']([A-Z0-9_]+)["']""")
    constants = re.compile(r"""^([A-Z_]+_ENV)\s*=\s*["']([A-Z0-9_]+)["']""", re.M)
    read = set()
    for path in (root / "deepflash").rglob("*.py"):
        text = path.read_text()
        read |= set(pattern.findall(text))
        read |= {value for _, value in constants.findall(text)}
    assert read, "the scan found no environment reads at all"
    assert read <= documented, f"undocumented environment variables: {sorted(read - documented)}"
