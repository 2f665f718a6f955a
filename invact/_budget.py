"""Whether torch.compile's partitioner works to an activation memory budget.

AOTAutograd's min-cut partitioner recomputes only the ops of its allowlist, aten's (pointwise, view
and a few others: torch 2.13, torch/_functorch/partitioners.py, get_default_op_list), never a custom
op. With `torch._functorch.config.activation_memory_budget` below 1 it recomputes what it may until the
saved bytes fit; invact's ops would then keep what they save while the budget alone recomputes the
activations and norms they replace. Measured (benchmarks/memory.py, fp32, CPU, budget 0.5, inductor's
partitioner: invact.memory.inductor_partition, share of eager's saved bytes): with invact's ops kept,
compile + patch() held more than the budget alone on Qwen3 (0.3 points), Qwen3-MoE (3.6) and Gemma 2
(5.0), less on the other thirteen rows; with them traced as torch's ops, what the budget alone holds
on every row. So under a budget the activation, the MLP and the norm trace as torch's ops, and the
partitioner decides for them: never more than the budget alone.

Read while dynamo traces; the partitioner reads the same setting when it partitions that graph.
`traces_custom_ops()` is the one test the op kinds' compiled forwards make: compiling, and neither a
budget nor a torch.func transform active.
"""

from __future__ import annotations

import torch
import torch._functorch.config as _functorch_config

_transforms_active = torch._C._are_functorch_transforms_active


def traces_custom_ops() -> bool:
    """Dynamo is tracing and invact's custom ops go into the graph: neither a torch.func transform
    (whose grad and vmap cannot differentiate a custom op's registered autograd in torch 2.13: see
    invact.activation.ops.invact) nor an activation memory budget is active. Where this is False under
    compile, each op kind traces torch's own ops (or its module's forward) instead."""
    return torch.compiler.is_compiling() and not (_transforms_active() or budgeted())


def budgeted() -> bool:
    """An activation memory budget below 1 is set (for the graph being traced)."""
    return _functorch_config.activation_memory_budget < 1


# A constant to Dynamo, evaluated once while it traces: read as an ordinary config attribute inside the
# traced code, it made Dynamo compile the same graph twice (a dynamic-shape MLP went through the
# backend twice on its first call). torch.compiler.assume_constant_result marks it so, but imports
# torch._dynamo (and sympy) to do it, which `import invact` must not; the mark is the attribute it sets
# (torch 2.13, torch/_dynamo/decorators.py), which tests/invact/test_kinds.py checks against it.
budgeted._dynamo_marked_constant = True
