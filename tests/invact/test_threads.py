"""invact's CPU kernels leave torch's thread count as the user set it, and run on it. numba's OpenMP
threading layer shares the process's OpenMP runtime with torch, and starting it set torch's count to
numba's (see invact.activation._numba.keeps_torch_threads); it starts once per process, so each case runs in a
fresh one."""

import subprocess
import sys

import pytest

pytest.importorskip("numba")

# Past invact.activation._numba.SERIAL elements, where the kernels run in numba's parallel region.
SCRIPT = """
import torch
torch.set_num_threads(1)
import invact
from torch import nn
{setup}
out.sum().backward()
import numba
print(torch.get_num_threads(), numba.get_num_threads())
"""
SETUPS = {
    "activation": "m = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))\n"
    "invact.patch(m)\nout = m(torch.randn(256, 256))",
    "norm": "m = nn.Sequential(nn.Linear(1024, 1024), nn.LayerNorm(1024), nn.Linear(1024, 8))\n"
    "invact.patch(m)\nout = m(torch.randn(256, 1024))",
}


@pytest.mark.parametrize("kind", sorted(SETUPS))
def test_a_patched_step_keeps_torch_at_one_thread(kind):
    code = SCRIPT.format(setup=SETUPS[kind])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch_threads, numba_threads = proc.stdout.split()[-2:]
    assert torch_threads == "1"
    if kind == "activation":  # its parallel kernels ran on torch's count too (the norm's: rows split 1 way)
        assert numba_threads == "1"
