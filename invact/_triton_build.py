"""A Triton kernel compiled for an NVIDIA GPU without one (Triton's compiler and its ptxas run on the CPU):
the one home of the step each op kind's `compile_for` ends with (tests/invact/test_triton_compiles.py,
benchmarks/kernel_sass.py). Not under TRITON_INTERPRET=1, whose functions the compiler refuses."""

from __future__ import annotations

import triton


def build(function, signature: dict, constexprs: dict, aligned: list[int], num_warps: int, arch: int = 90):
    """`function` (a @triton.jit kernel) compiled for compute capability `arch` with `signature` (argument
    name -> Triton type, "constexpr" for the keys of `constexprs`), the arguments at the indices
    `aligned` marked 16-byte divisible (as a launch specializes torch's allocations), `num_warps`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(
        function,
        signature,
        constexprs={(function.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
