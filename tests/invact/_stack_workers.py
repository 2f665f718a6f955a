"""The MLP, data and loss shared by tests/invact/test_training_stacks.py and its distributed workers.

Run as a module, `python -m tests.invact._stack_workers OUT_DIR`, with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), it is one rank of a gloo job on the CPU: it builds the
patched MLP, takes its half of the global batch and runs one forward/backward under DDP, then under
FSDP2's fully_shard, each also under torch.compile (MODES), and saves the full gradients of each to
OUT_DIR/<mode>_rank<r>.pt (or, if a mode raises, the traceback under "error"). Every collective is
bounded by the process group's timeout.

Compiled, the backend is AOTAutograd with the eager ops (aot_eager) and a recorder of the ops each graph
calls: it checks that invact traces as its custom ops inside DDP's and FSDP2's compiled graphs, and its
gradients are bitwise those of the eager ops; inductor's code generation (a C++ compile per process)
would add tens of seconds on two shared cores and test inductor, not the wrappers.

The workers compute q with the generated torch functions, not the numba kernel (NO_NUMBA): numba
compiles its kernels in each new process (8 s here, 20+ s for two processes sharing two cores), and
what DDP and FSDP do with InvAct's autograd node does not depend on which CPU kernel computes q
(test_functional.test_numba_and_torch_op_backwards_agree checks that the two agree).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

WIDTH, HIDDEN, BATCH = 16, 44, 8  # HIDDEN * rows is not a multiple of 8 for odd rows: a partial bit byte
WORLD = 2
TIMEOUT_S = 60  # per collective; the parent's wait for the workers is longer
MODES = ("ddp", "fsdp", "ddp_compiled", "fsdp_compiled")


class MLP(nn.Module):
    """down(act(up(x))): the block every activation sits in."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(WIDTH, HIDDEN), act, nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def make_mlp(act: nn.Module | None = None) -> MLP:
    """The same weights in every process: seeded construction."""
    torch.manual_seed(0)
    return MLP(nn.GELU() if act is None else act)


def global_batch(rows: int = BATCH) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(1)) * 2


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    """Mean over the batch: DDP's and FSDP's averaged gradients equal those of the global batch."""
    return out.float().square().mean()


def _step(mode: str, rank: int) -> dict:
    import invact

    model = make_mlp()
    assert invact.patch(model) == ["act"]
    share = BATCH // WORLD
    x = global_batch()[rank * share : (rank + 1) * share]
    if mode.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.up)
        fully_shard(model.down)
        wrapped = fully_shard(model)
    nodes, ops, traced = [], set(), set()
    if mode.endswith("compiled"):
        wrapped = torch.compile(wrapped, backend=_recording(ops, traced), fullgraph=False)
    else:
        model.act.register_forward_hook(lambda m, i, o: nodes.append(type(o.grad_fn).__name__))
    loss_fn(wrapped(x)).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return {"grads": grads, "nodes": nodes, "ops": sorted(ops), "traced": sorted(traced),
            "param_type": type(model.up.weight).__name__}  # fmt: skip


def _recording(ops: set, traced: set | None = None):
    """aot_eager whose forward and backward graphs (what runs) add the names of the ops they call to
    `ops`; and where `traced` is given, Dynamo's graph (what was traced, before AOTAutograd decomposes
    invact's ops into their bodies: invact._traced) the names of its ops to `traced`."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, _):
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    if traced is None:
        return backend

    def dynamo(gm, example_inputs):  # the graph and its subgraphs (a checkpointed region's body)
        for sub in gm.modules():
            if isinstance(sub, torch.fx.GraphModule):
                traced.update(str(n.target) for n in sub.graph.nodes if n.op == "call_function")
        return backend(gm, example_inputs)

    return dynamo


def no_numba() -> None:
    """Route InvAct's CPU backward to the generated torch functions (as test_functional does)."""
    from invact.activation import _numba

    _numba.available = lambda: False


def main(out_dir: str) -> None:
    from tests.gloo import run_cases

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    no_numba()
    run_cases(MODES, _step, out_dir, TIMEOUT_S)


if __name__ == "__main__":
    main(sys.argv[1])
