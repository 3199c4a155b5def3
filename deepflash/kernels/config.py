"""The kernels' tuning that a test or a benchmark varies, passed explicitly (TargetModel.use_kernels,
FeatureRing's shape).

Everything else about a kernel's shape is a constant beside the kernel, with the measurement that chose
it. Imports no Triton, so the models can hold a config without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A projection's tiling: (widest reduction, most outputs, (BLOCK_N, BLOCK_K, num_warps, num_stages, weight first,
# waves, TMA)): the first entry whose bounds a weight [outputs, reduction] is within. Weight first: the product is
# weight tile @ rows.T, the weight on the M side, where Hopper's wgmma runs (M >= 64; 16 rows on that side take
# mma.sync). Waves: programs per SM that the reduction's split aims for (gemv.split). TMA: the weight tiles through
# a tensor descriptor (Hopper, under a dependent launch; else plain loads).
#
# SMALL_TILINGS, for weights up to small_weight_bytes (the time is launch and latency), measured on SmolLM2-135M's
# projections in isolation (us at 1 / 16 rows, H200): q/k/v 64x128x4x4 weight first
# 3.71 / 4.01 against 3.97 / 4.13; the down projection 32x128x4x4 weight first 4.49 / 4.95 against 64x64x4x6's
# 4.59 / 5.97; gate/up and o fastest at 32x128x4x4 at both row counts. TMA there cost plain decode 1312 -> 1262
# tok/s, so these tiles use plain loads.
SMALL_TILINGS = ((1024, 640, (32, 128, 4, 4, False, 4, False)),  # o (576 outputs)
                 (1024, 1024, (64, 128, 4, 4, True, 4, False)),  # q/k/v (960)
                 (1024, None, (32, 128, 4, 4, False, 4, False)),  # gate/up (3072)
                 (None, None, (32, 128, 4, 4, True, 4, False)))  # down (1536 wide)
# LARGE_TILINGS, for larger weights (the time is streaming), measured on Qwen3-8B's (1 row, us, H200): 64x128x4x3
# weight first with TMA: q/k/v 17.6, gate/up 49.2, down 28.5, o 12.5, against 20.7, 51.5, 34.8, 12.0 with plain
# loads. At most three such programs fit an SM (~60 KB of shared memory each): 3 waves leave programs for a second
# round (Qwen3-8B-shaped MBU 0.846 -> 0.709; 4 stages, two an SM: 0.653). 2.9 waves split q/k/v in 4 and down in 6
# (384 programs, about three on every SM): MBU 0.832 -> 0.844 against 2 waves in the same run; gate/up stays whole
# (384 column blocks). Blocks of 16 or 32 weight rows ran q/k/v, gate/up and down 3-17x slower.
LARGE_TILINGS = ((4096, 4096, (64, 256, 4, 2, True, 2, True)),  # o (4096 wide): 4 slices, 256 programs; 11.5 us
                 (None, None, (64, 128, 4, 3, True, 2.9, True)))


@dataclass(frozen=True)
class ProjectionTiling:
    """How the projection kernels (gemv.py) cut a weight into programs."""

    small: tuple = SMALL_TILINGS
    large: tuple = LARGE_TILINGS
    # weights up to this take `small`, larger ones `large`; a projection with no prologue and a weight up to
    # this walks whole reductions (gemv._launch)
    small_weight_bytes: int = 8 << 20
    # Larger weights take torch's GEMM: LM heads (Qwen3-8B's 1.16 GiB, which cuBLAS streams at 1.08 of the copy
    # bandwidth; the kernels have nothing to fuse there). Qwen3-8B's projections (32-192 MiB) stream at 0.69-0.97
    # of the copy bandwidth in isolation with their prologues inside, where add + norm (or silu * up) and torch's
    # GEMM took 0.58-0.91.
    max_weight_bytes: int = 512 << 20
    waves: float | None = None  # every shape's programs per SM when set (tests force splits with it)
    # Reductions of at least this many slices add them in an unrolled loop, all loads in flight (None: never):
    # SmolLM2's down projection (24 slices) 5.50 -> 4.56 us at 1 row, 6.39 -> 5.93 at 16; a plain step's device
    # time 791 -> 763 us, a spec step's 1099 -> 1070 (H200). The sums and their order are the same either way.
    unroll_from: int | None = 17

    def takes(self, weight) -> bool:
        """Whether a weight is small enough for the projection kernels; larger ones take torch's GEMM."""
        return weight.numel() * weight.element_size() <= self.max_weight_bytes


# Tokens per rope program (rope.py): a tile of this many rows of one head. A verify step's 16 tokens take one
# program per head; each row is computed alone, so a token's result does not depend on its tile. Against 1 token
# per program: a spec step's rope kernels 54.6 -> 48.2 us of device time (H200), a plain step's unchanged.
ROPE_TOKENS = 16


@dataclass(frozen=True)
class KernelConfig:
    """The Triton kernels' tuning (SHIPPED unless a test or benchmark asks for another)."""

    rope_tokens: int = ROPE_TOKENS
    projections: ProjectionTiling = field(default_factory=ProjectionTiling)


SHIPPED = KernelConfig()


@dataclass(frozen=True)
class Shape:
    """How a feature-ring kernel (rings.py) cuts its work: its SHAPES, or another that `bench rings
    --triton-shapes` times."""

    groups: int  # blocks of 32 values per work item (a row's run of GROUPS x 32 values)
    warps: int  # per program
    items: int = 1  # consecutive work items per program
    stages: int = 1  # > 1: an item's loads are issued that many items ahead

    def __str__(self) -> str:
        return "x".join(str(v) for v in (self.groups, self.warps, self.items, self.stages))

