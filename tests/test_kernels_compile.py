"""Every Triton kernel compiles for the H200 (sm_90), checked on the CPU: the interpreter tests run kernels
the compiler would refuse (compile_kernels.py says how one slipped through)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (torch CPU builds lack it); the GPU chain runs "
                                       "these kernels")


@pytest.mark.parametrize("kernels,binaries", [("rings", 40), ("model", 70)])
def test_triton_kernels_compile_for_sm90(kernels, binaries):
    script = Path(__file__).with_name("compile_kernels.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the script runs from tests/: deepflash is the checkout's, not whichever an installed finder names
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(script.parent.parent), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(script), kernels], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == binaries, done.stdout
