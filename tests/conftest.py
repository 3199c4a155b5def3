import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.delenv("DEEPFLASH_FEAT_RING_CAP", raising=False)
