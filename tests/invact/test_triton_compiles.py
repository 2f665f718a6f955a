"""The Triton kernels compiled for NVIDIA GPUs on a machine without one. Triton's compiler runs on the
CPU (to PTX, and with the ptxas it ships to a cubin), so a kernel that does not compile fails here, in
CI, rather than on the next GPU run. The interpreter (TRITON_INTERPRET=1, the other CPU tests) runs
the kernels' Python source and never compiles them: the first H100 run found that the precision-bit
kernels did not compile for sm_90, which every interpreter test had passed.

The compiler refuses the interpreter's functions, so one subprocess without TRITON_INTERPRET compiles
every case (about 0.3 s each here) and reports each one's error; a test per case reads its own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from invact.activation.activations import ACTIVATIONS

pytest.importorskip("triton")

from invact.activation import _triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"sm_90": 90, "sm_80": 80}  # H100/H200, A100 (the paper's GPU)


def _case(kernel, name, dtype=torch.float32, precision_bit=False, target="sm_90", integer="i32", even=True,
          rows=True):  # fmt: skip
    mode = "precision_bit" if precision_bit else "bits"
    blocks = "" if even else ("-masked-rows" if rows else "-masked")
    case_id = f"{kernel}-{name}-{str(dtype).removeprefix('torch.')}-{mode}-{target}-{integer}{blocks}"
    return case_id, (kernel, name, dtype, precision_bit, target, integer, even, rows)


KERNELS = tuple(_triton.KERNELS)  # the activation's two and the gated MLP's two
# Every activation's device functions inside the activation's kernels in fp32 and bf16 and the gated
# MLP's in bf16, both modes, on full blocks (n a multiple of the block: no masks); fp16 with gelu (its
# integer view is bf16's), the masked kernels (any other n: masks per row of 8 where n is a multiple of
# 8, else per element) with gelu, int64 offsets (past 2^31 elements), and the A100's target with gelu.
CASES = dict(
    [
        _case(kernel, name, dtype, precision_bit)
        for kernel in KERNELS
        for name in sorted(ACTIVATIONS)
        # the gated kernels' bodies around the same device functions: every activation in bf16
        for dtype in ((torch.bfloat16,) if kernel.startswith("gated_") else (torch.float32, torch.bfloat16))
        for precision_bit in (False, True)
    ]
    + [_case(kernel, "gelu", torch.float16, pb) for kernel in KERNELS for pb in (False, True)]
    + [
        _case(kernel, "gelu", d, pb, even=False, rows=rows)
        for kernel in KERNELS
        for d in (torch.float32, torch.bfloat16)
        for pb in (False, True)
        for rows in (True, False)
    ]  # fmt: skip
    + [_case(kernel, "gelu", integer="i64") for kernel in KERNELS]
    + [_case(kernel, "gelu", precision_bit=pb, target="sm_80") for kernel in KERNELS for pb in (False, True)]
)


def compile_case(kernel, name, dtype, precision_bit, target, integer, even, rows):
    from invact.activation import _triton

    act = ACTIVATIONS[name]
    target = TARGETS[target]
    return _triton.compile_for(kernel, act, dtype, precision_bit, target, integer, even=even, rows=rows)


# The loss's rows kernel (invact.loss._triton): every dtype, transform the kernel takes, with and without
# label smoothing and the gradient pass, at its configuration; and bf16 with a gradient at each launch
# configuration benchmarks/loss_floor.py sweeps on a GPU.
_LOSS_OPS = {"none": (), "scale": (("mul", 0.0625),), "softcap": (("div", 30.0), ("tanh",), ("mul", 30.0))}


def _loss_case_id(dtype, ops: str, smooth: bool, grad: bool) -> str:
    what = ("smooth" if smooth else "plain") + ("-grad" if grad else "-loss")
    return f"loss-{str(dtype).removeprefix('torch.')}-{ops}-{what}"


LOSS_CASES = {
    _loss_case_id(dtype, ops, smooth, grad): (dtype, _LOSS_OPS[ops], smooth, grad, None)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for ops in _LOSS_OPS
    for smooth in (False, True)
    for grad in (False, True)
}


def _loss_configs() -> dict:
    from invact.loss import _triton as loss_triton

    return {f"loss-bf16-config-{c['BLOCK']}-{c['num_warps']}-{'lanes' if c['LANES'] else 'reduce'}":
            (torch.bfloat16, (), False, True, c) for c in loss_triton.SWEEP}  # fmt: skip


def _compile_all() -> None:
    """Compile every case; print {case id: None, or the error's last lines} as JSON."""
    from invact.loss import _triton as loss_triton

    errors = {}
    cases = {**CASES, **LOSS_CASES, **_loss_configs()}
    for case_id, case in cases.items():
        try:
            compiled = loss_triton.compile_for(*case) if case_id.startswith("loss-") else compile_case(*case)
            errors[case_id] = None if compiled.asm.get("cubin") else "no cubin"
        except Exception as e:  # noqa: BLE001 - any failure is the case's result
            errors[case_id] = "\n".join(str(e).splitlines()[-12:]) or type(e).__name__
    print(json.dumps(errors))


@pytest.fixture(scope="module")
def compile_errors(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))  # compile, not load
    code = "from tests.invact.test_triton_compiles import _compile_all; _compile_all()"
    command = [sys.executable, "-c", code]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case_id", [*CASES, *LOSS_CASES, *_loss_configs()])
def test_kernel_compiles_for_nvidia_gpus(compile_errors, case_id):
    assert compile_errors[case_id] is None, compile_errors[case_id]
