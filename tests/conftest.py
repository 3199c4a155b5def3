import os

import pytest
import torch

# Without CUDA the Triton kernels' tests run in Triton's interpreter, which is chosen when Triton is
# imported; torch.compile imports it too, and before these tests did, they skipped themselves in a full
# run (helpers.triton_device). So the switch is made before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.delenv("DEEPFLASH_FEAT_RING_CAP", raising=False)
