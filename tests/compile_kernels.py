"""Compile every Triton kernel deepflash launches, for a Hopper GPU (sm_90), on a machine without one.

Triton's interpreter (the CPU tests) runs what the compiler refuses: a helper with two differently typed
returns ran there and failed to compile on the H200. Run as a script (the tests call
it in a subprocess, outside the interpreter): it replaces the launch with a compile of the same
arguments, calls each wrapper with CPU tensors of the shapes the engine uses, and prints one line per
compiled binary."""

import inspect
import os
import sys
from itertools import product

assert os.environ.get("TRITON_INTERPRET") != "1", "compiling needs Triton's compiler, not its interpreter"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_BYTES = 227 * 1024  # an H100/H200 block's most shared memory
OPTIONS = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "launch_pdl"}
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
         torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
compiled = []


def type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, TensorDescriptor):
        return f"tensordesc<{TYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def aligned(param, value) -> bool:
    """Whether the launch specialises this argument as divisible by 16, as Triton's JIT does (a
    tensor's address, an integer): its loads may then be vectorised and pipelined (cp.async), which
    changes the binary and its shared memory (without it a 6-stage loop compiled with one buffer)."""
    if param.is_constexpr or param.do_not_specialize or param.do_not_specialize_on_alignment:
        return False
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def compile_instead(self: JITFunction, *args, grid, warmup, **kwargs):
    """JITFunction.run's stand-in: compile for TARGET what the launch would have run, and check that
    its shared memory fits an SM."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
    bound = inspect.signature(self.fn).bind(*args, **kwargs).arguments
    constexprs = {p.name: bound[p.name] for p in self.params if p.is_constexpr}
    signature = {name: "constexpr" if name in constexprs else type_of(value) for name, value in bound.items()}
    attrs = {(p.num,): [["tt.divisibility", 16]] for p in self.params if aligned(p, bound.get(p.name))}
    kernel = triton.compile(ASTSource(self, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                            options=options)
    assert "cubin" in kernel.asm
    assert kernel.metadata.shared <= SHARED_BYTES, (self.fn.__name__, constexprs, kernel.metadata.shared)
    compiled.append(f"{self.fn.__name__} {constexprs}")


def ring_kernels():
    from deepflash.kernels import rings as rk
    from deepflash.kernels.row_formats import FORMATS

    width, n = 576, 5
    for fmt, rows_dtype, scale in product(FORMATS.values(), (torch.bfloat16, torch.float32), (None, torch.ones(width))):
        data = torch.zeros((8, *fmt.row_shape(width)), dtype=fmt.storage_dtype())
        rk.write(fmt, data, torch.zeros(8, dtype=torch.int64), torch.arange(n), torch.zeros(n, width, dtype=rows_dtype),
                 scale)
        rk.decode(fmt, data, rows_dtype, scale)


def model_kernels():
    from deepflash.kernels import pdl
    from deepflash.kernels.accept import accept_kernel
    from deepflash.kernels.argmax import rows_argmax
    from deepflash.kernels.attention import decode_attention
    from deepflash.kernels.gemv import linear, norm_linear, silu_linear
    from deepflash.kernels.layer_ops import add_rms_norm, silu_mul
    from deepflash.kernels.mailbox import post_kernel
    from deepflash.kernels.pdl import dependent
    from deepflash.kernels.rope import rope_and_write

    # SmolLM2-135M's shapes in both dtypes, Qwen3-8B's in bf16
    for dtype, (heads, kv_heads, dim, hidden, inner) in [(torch.bfloat16, (9, 3, 64, 576, 1536)),
                                                         (torch.float32, (9, 3, 64, 576, 1536)),
                                                         (torch.bfloat16, (32, 8, 128, 4096, 12288))]:
        t, slots = 16, 512
        k, v = (torch.zeros(1, kv_heads, slots, dim, dtype=dtype) for _ in range(2))
        decode_attention(torch.zeros(1, heads, t, dim, dtype=dtype), k, v, torch.arange(t), 64)
        x = torch.zeros(t, 576, dtype=dtype)
        add_rms_norm(x, x, torch.ones(576, dtype=dtype), 1e-5)
        add_rms_norm(x, None, torch.ones(576, dtype=dtype), 1e-5)
        silu_mul(torch.zeros(t, 2 * 1536, dtype=dtype))
        qkv = torch.zeros(1, t, (heads + 2 * kv_heads) * dim, dtype=dtype)
        cos = torch.zeros(t, dim, dtype=torch.float32)
        gain = torch.ones(dim, dtype=dtype)
        for norm in (None, gain):
            rope_and_write(qkv, cos, cos, torch.arange(t), k, v, heads, kv_heads, norm, norm, 1e-6)
        # a decode step's projections with their prologues (1-16 rows: one binary each)
        h = torch.zeros(t, hidden, dtype=dtype)
        qkv_weight = torch.zeros((heads + 2 * kv_heads) * dim, hidden, dtype=dtype)
        norm_linear(h, h, torch.ones(hidden, dtype=dtype), 1e-5, qkv_weight)
        norm_linear(h, None, torch.ones(hidden, dtype=dtype), 1e-5, qkv_weight)
        silu_linear(torch.zeros(t, 2 * inner, dtype=dtype), torch.zeros(hidden, inner, dtype=dtype))
        linear(torch.zeros(t, heads * dim, dtype=dtype), torch.zeros(hidden, heads * dim, dtype=dtype))
        if dtype == torch.bfloat16 and hidden == 576:  # launched as dependents (pdl.py), as on a Hopper GPU
            pdl.dependent = lambda device: True
            silu_linear(torch.zeros(t, 2 * inner, dtype=dtype), torch.zeros(hidden, inner, dtype=dtype))
            rope_and_write(qkv, cos, cos, torch.arange(t), k, v, heads, kv_heads, None, None, 1e-6)
            decode_attention(torch.zeros(1, heads, t, dim, dtype=dtype), k, v, torch.arange(t), 64)
            pdl.dependent = dependent
        if hidden == 4096:  # Qwen3-8B's projections as dependents: their weight tiles through TMA (config.LARGE_TILINGS)
            pdl.dependent = lambda device: True
            norm_linear(h, h, torch.ones(hidden, dtype=dtype), 1e-5, qkv_weight)
            norm_linear(h, h, torch.ones(hidden, dtype=dtype), 1e-5, torch.zeros(2 * inner, hidden, dtype=dtype))
            silu_linear(torch.zeros(t, 2 * inner, dtype=dtype), torch.zeros(hidden, inner, dtype=dtype))
            linear(torch.zeros(t, heads * dim, dtype=dtype), torch.zeros(hidden, heads * dim, dtype=dtype))
            pdl.dependent = dependent
        # the greedy choice over the vocabulary (SmolLM2's, or Qwen3's)
        rows_argmax(torch.zeros(t, 49152 if hidden == 576 else 151936, dtype=dtype))
        # a drafter's context rows: K and V only (DrafterAttention.write_ring)
        rope_and_write(qkv[..., heads * dim :], cos, cos, torch.arange(t), k, v, 0, kv_heads, gain, gain, 1e-6)
    hybrid_kernels()
    # a verify step's acceptance (a block of 16), posting its result to the host (the engine's form) and not
    long = dict(dtype=torch.long)
    for mailbox in [(torch.zeros((), **long), torch.zeros(3, 18, **long)), None]:
        accept_kernel(torch.zeros(15, **long), torch.zeros(16, **long), torch.zeros(17, **long),
                      torch.zeros(1, **long), torch.zeros((), **long), torch.zeros((), **long), mailbox)
    # a plain step's result posted to the host (mailbox.py)
    post_kernel(torch.zeros(17, **long), torch.zeros((), **long), torch.zeros(3, 18, **long))


def hybrid_kernels():
    """The Qwen3.5 / Qwen3.6 kernels at Qwen3.6-35B-A3B's widths in bf16, 16 tokens (1-16: one binary each),
    launched as dependents (pdl.py) as on a Hopper GPU."""
    from deepflash.kernels import delta_rule, int8_rows, pdl, quant_gemv, quant_moe
    from deepflash.kernels.attention import decode_attention
    from deepflash.kernels.delta_inputs import delta_inputs
    from deepflash.kernels.gemv import norm_linear
    from deepflash.kernels.layer_ops import GATED_RMS, add_rms_norm, row_norm, silu_mul
    from deepflash.kernels.moe import routed_experts
    from deepflash.kernels.rope import rope_and_write
    from deepflash.kernels.router import route

    dependent = pdl.dependent
    pdl.dependent = lambda device: True
    bf16, f32, t = torch.bfloat16, torch.float32, 16
    (hk, hv), (dk, dv), width = (16, 32), (128, 128), 3
    channels = 2 * hk * dk + hv * dv
    proj = torch.zeros(1, t, channels + hv * dv + 2 * hv, dtype=bf16)  # the fused input projection: qkv, z, b, a
    qkv, z, b, a = proj.split([channels, hv * dv, hv, hv], dim=-1)
    conv = torch.zeros(1, channels, width, dtype=bf16)
    for window in (None, torch.zeros(1, channels, width + t, dtype=bf16)):
        q, k, v, g, beta = delta_inputs(qkv, b, a, conv, torch.zeros(channels, 1, width + 1, dtype=bf16),
                                        torch.zeros(1, dtype=torch.bool), torch.zeros(hv, dtype=bf16),
                                        torch.zeros(hv, dtype=bf16), (hk, hv), (dk, dv), window)
    state = torch.zeros(1, hv, dk, dv, dtype=f32)
    out, _ = delta_rule.recurrent(q, k, v, g, beta, state, out_dtype=bf16, final=state)
    delta_rule.state_after(k, v, g, beta, state, torch.zeros((), dtype=torch.int64), torch.zeros_like(state))
    row_norm(out, GATED_RMS, 1e-6, torch.ones(dv, dtype=bf16), z.view(1, t, hv, dv))
    row_norm(out, GATED_RMS, 1e-6, torch.ones(dv, dtype=bf16), z.view(1, t, hv, dv), torch.arange(hv))  # GGUF order
    x = torch.zeros(t, 2048, dtype=bf16)
    add_rms_norm(x, x, torch.ones(2048, dtype=bf16), 1e-6, offset=True)
    norm_linear(x, x, torch.ones(2048, dtype=bf16), 1e-6, torch.zeros(proj.shape[-1], 2048, dtype=bf16), offset=True)
    # a Q4_K_M target's projections: the norm and SiLU * up writing their rows' int8 form, Q4_K and Q6_K parts
    # writing their columns of one output
    rows8 = int8_rows.row_buffers(2048, "cpu")
    add_rms_norm(x, x, torch.ones(2048, dtype=bf16), 1e-6, offset=True, rows8=rows8)
    silu_mul(torch.zeros(t, 4096, dtype=bf16), rows8)
    out = torch.zeros(t, 1024, dtype=bf16)
    for kind, first in ((12, 0), (14, 512)):  # a Q4_K part, then a Q6_K part
        blocks = torch.zeros(512, quant_gemv.row_bytes(kind, 2048), dtype=torch.uint8)
        quant_gemv.linear(x, blocks, kind, 2048, rows8=rows8, out=out[:, first : first + 512])
    experts, _ = route(torch.zeros(t, 256, dtype=bf16), 8, True, bf16)
    # routed experts at Qwen3.6-35B-A3B's widths (8 experts of its 256) with its shared expert's part
    routed_experts(x, experts, torch.zeros(t, 8, dtype=bf16), torch.zeros(8, 1024, 2048, dtype=bf16),
                   torch.zeros(8, 2048, 512, dtype=bf16), (x, torch.zeros(t, 257, dtype=bf16)[:, 256:]))
    gate = torch.zeros(8, 512, quant_gemv.row_bytes(12, 2048), dtype=torch.uint8)  # Q4_K_M's experts
    down = torch.zeros(8, 2048, quant_gemv.row_bytes(14, 512), dtype=torch.uint8)
    quant_moe.routed_experts(x, experts, torch.zeros(t, 8, dtype=bf16), gate, gate, down, (12, 12, 14),
                             (x, torch.zeros(t, 1, dtype=bf16)))
    # gated attention: 16 query heads of 256 with their gates, 2 kv heads, a rotary width of 64
    heads, kv_heads, dim = 16, 2, 256
    qkv = torch.zeros(1, t, (2 * heads + 2 * kv_heads) * dim, dtype=bf16)
    k_cache, v_cache = (torch.zeros(1, kv_heads, 512, dim, dtype=bf16) for _ in range(2))
    cos, gain = torch.zeros(t, 64, dtype=bf16), torch.zeros(dim, dtype=bf16)
    q = rope_and_write(qkv, cos, cos, torch.arange(t), k_cache, v_cache, heads, kv_heads, gain, gain, 1e-6,
                       gated=True, offset=True)
    gate = qkv[..., : 2 * heads * dim].view(1, t, heads, 2 * dim)[..., dim:]
    decode_attention(q, k_cache, v_cache, torch.arange(t), 64, gate)
    pdl.dependent = dependent


if __name__ == "__main__":
    JITFunction.run = compile_instead
    from deepflash.kernels import gemv, quant_gemv

    gemv._sms = quant_gemv._sms = lambda device: 132  # an H200's SMs: the projections' reductions split as there
    {"rings": ring_kernels, "model": model_kernels}[sys.argv[1]]()
    print("\n".join(compiled))
