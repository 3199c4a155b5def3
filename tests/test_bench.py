"""The benchmarks' own bookkeeping (their GPU figures live in BENCHMARKS.md)."""

import pytest

from deepflash.bench.rings import parse_shape
from deepflash.bench.speed import TORCH_KERNELS, plain_of
from deepflash.ring_kernels import Shape
from deepflash.errors import UserError


def test_each_system_is_checked_against_plain_decode_on_its_own_kernels():
    assert plain_of("deepflash dflash (spec auto)") == "deepflash plain"
    assert plain_of("deepflash dflash (spec auto)" + TORCH_KERNELS) == "deepflash plain" + TORCH_KERNELS
    # plain on Triton's kernels against plain on torch's: where bf16 rounding differs, this shows it
    assert plain_of("deepflash plain" + TORCH_KERNELS) == "deepflash plain"


def test_ring_shapes_parse_or_explain():
    assert parse_shape("32x4") == Shape(32, 4, 1, 1)
    assert parse_shape("16x1x8x3") == Shape(16, 1, 8, 3) and str(Shape(16, 1, 8, 3)) == "16x1x8x3"
    for bad in ("32-4", "32x4x2", "16x0"):
        with pytest.raises(UserError, match="GROUPSxWARPS"):
            parse_shape(bad)
