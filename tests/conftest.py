import os

import pytest
import torch

# Without CUDA the Triton kernels' tests run in Triton's interpreter, which is chosen when Triton is
# imported; torch.compile imports it too, and before these tests did, they skipped themselves in a full
# run (helpers.triton_device). So the switch is made before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' tiny models run fastest on one intra-op thread, which also keeps a busy machine from making
# torch's thread pool spin (minutes instead of seconds for the sampling tests on two shared cores).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.delenv("DEEPFLASH_FEAT_RING_CAP", raising=False)
