"""Non-view aten ops of one eager speculative step (draft + verify) and of a prefill commit, on the CPU:
a proxy for the GPU kernels a step launches."""
import sys, torch
sys.path.insert(0, "scripts/gpu")
from profile_step import SMOLLM2, sibling
from deepflash.bench.speed import random_engine
from deepflash.drafter import load_drafter
from deepflash.runtime import DEFAULT_DRAFTER
from deepflash.sampling import SamplingParams
VIEWS = {"aten::view", "aten::reshape", "aten::transpose", "aten::slice", "aten::expand", "aten::as_strided",
         "aten::select", "aten::unsqueeze", "aten::detach", "aten::t", "aten::alias", "aten::_unsafe_view",
         "aten::split", "aten::chunk", "aten::narrow", "aten::split_with_sizes", "aten::permute", "aten::empty",
         "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::contiguous", "aten::empty_like",
         "aten::empty_strided", "aten::squeeze", "aten::unbind", "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"}
base = random_engine(SMOLLM2, "cpu")
drafter = load_drafter(DEFAULT_DRAFTER, base.device, base.target.dtype)
e = sibling(base, drafter, spec="on", max_ctx=8192)
e.complete(list(range(100, 140)), SamplingParams(max_new_tokens=2))
steps = e.steps
params = SamplingParams(max_new_tokens=2).validated()
def count(fn):
    with torch.profiler.profile() as prof:
        fn()
    top = [ev for ev in prof.events() if ev.name.startswith("aten::") and ev.cpu_parent is None]
    return sum(1 for ev in prof.events() if ev.name.startswith("aten::") and ev.name not in VIEWS and all(
        not (p.name.startswith("aten::") and p.name not in VIEWS) for p in ancestors(ev)))
def ancestors(ev):
    p = ev.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent
with torch.no_grad():
    print("draft", count(lambda: steps.draft(16, 256)), "verify", count(lambda: steps.verify(16, 256, params)))
