"""What a training step keeps in memory: bytes autograd saves for backward, and CUDA peak memory.

`saved_tensors(model, *inputs)` runs a forward pass under torch.autograd.graph.saved_tensors_hooks and
counts every distinct storage autograd saves (a storage saved twice, e.g. by an activation and a Linear,
counts once), excluding the model's parameters and buffers; `count_saved(model)` does the same around
any code (a training step of your own), also on the meta device (shapes only: `invact plan`).
Tensors saved inside torch.utils.checkpoint regions are invisible to these hooks.

`inductor_partition` is a torch.compile backend that saves for backward what inductor saves, without
inductor's code generation: `saved_tensors(torch.compile(model, backend=inductor_partition))` counts a
compiled model's saved bytes on any machine in seconds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


@dataclass
class MemoryReport:
    """Bytes saved for backward by one forward pass, by dtype; CUDA peak of a full step if measured."""

    saved_bytes: int = 0
    saved_tensors: int = 0
    by_dtype: dict[str, int] = field(default_factory=dict)
    peak_cuda_bytes: int | None = None

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(self.by_dtype.items(), key=lambda kv: -kv[1]))
        text = f"saved for backward: {_mib(self.saved_bytes)} in {self.saved_tensors} storages ({parts})"
        if self.peak_cuda_bytes is not None:
            text += f"; CUDA peak of the step: {_mib(self.peak_cuda_bytes)}"
        return text

    def saving_vs(self, baseline: MemoryReport) -> float:
        """Relative change of saved bytes against a baseline: -0.23 means 23% less."""
        return self.saved_bytes / baseline.saved_bytes - 1


def storage_id(t: torch.Tensor) -> int:
    """The identity of t's storage: its address; on the meta device, where every address is 0, the
    storage itself (its StorageImpl's address, `_cdata`, which views share)."""
    storage = t.untyped_storage()
    return storage._cdata if t.is_meta else storage.data_ptr()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this process holds: a wrapper subclass's first inner tensor (a DTensor's
    local shard, an AsyncCollectiveTensor's result: their own storages cannot be read; tensor parallel
    ops save both), any other tensor itself."""
    while is_traceable_wrapper_subclass(t):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t


def parameter_storages(model: nn.Module) -> set[int]:
    """The storage_ids of `model`'s parameters and buffers; of a DTensor's local shard where FSDP2
    (fully_shard) made them DTensors, whose own storage cannot be read."""
    tensors = (*model.parameters(), *model.buffers())
    return {storage_id(_local(t)) for t in tensors}


def inductor_partition(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """torch.compile backend: inductor's decompositions, its joint-graph passes and its min-cut
    partitioner (torch._inductor.compile_fx.partition_fn), then the forward and backward graphs run as
    traced. What the forward graph returns for backward, the saved set, is then inductor's, and
    activation_memory_budget applies as under inductor.

    torch's aot_eager_decomp_partition backend skips the joint-graph passes, and they change what is
    saved: the passes drop no-op clones (dropout with p=0 in training decomposes to x.clone()), and
    without that the partitioner sees a copy of the attention probabilities as a second tensor and saves
    both (Gemma 2's eager attention, 4 layers: three more (batch, heads, seq, seq) tensors).
    """
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import get_nop_func
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx
    from torch._inductor.virtualized import V

    # As aot_eager_decomp_partition: effect tokens (ops with side effects) unlifted as inductor does.
    # The joint-graph passes read the fake mode from inductor's V (the random-op pass builds its seeds
    # under it), which inductor's own compile sets around the partition.
    fake_mode = detect_fake_mode(example_inputs)
    with functorch_config.patch(unlift_effect_tokens=True), V.set_fake_mode(fake_mode):
        return aot_autograd(
            fw_compiler=get_nop_func(),
            bw_compiler=get_nop_func(),
            decompositions=compile_fx.select_decomp_table,
            partition_fn=compile_fx.partition_fn,
        )(gm, example_inputs)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# The attribute that marks a saved tensor as a parameter's gradient computed in the forward (count_saved).
EARLY_GRADIENT = "_invact_early_gradient"


class count_saved:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Context manager: counts every distinct storage autograd saves inside it, parameters and
    buffers of `model` excluded. `report` (a MemoryReport) is filled in on exit."""

    def __init__(self, model: nn.Module) -> None:
        self._excluded = parameter_storages(model)
        self._storages: dict[int, tuple[torch.UntypedStorage, str]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.report = MemoryReport()

    def _counts(self, t: torch.Tensor) -> bool:
        """Whether t's storage counts: not empty, not a parameter's or buffer's, not a parameter's
        gradient an op computed in its forward and saved for its backward to scale (invact.loss's
        weight gradient, EARLY_GRADIENT: the step holds it from the backward's first op anyway, as
        the parameter's .grad, so it is no activation memory)."""
        return (bool(t.untyped_storage().nbytes()) and storage_id(t) not in self._excluded
                and not getattr(t, EARLY_GRADIENT, False))  # fmt: skip

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        held = _local(t)
        storage = held.untyped_storage()
        if self._counts(held):
            # Keyed by the storage itself, not its address, and sized on exit: FSDP2 frees the
            # gathered weights the forward saved by resizing their storage to 0 (the address then
            # goes to later tensors), and gathers them again for backward.
            self._storages[storage._cdata] = (storage, str(t.dtype).removeprefix("torch."))
        return t

    # It returns the tensor itself: invact.mlp.gated's hooks, nested inside, hand it what they keep, so
    # a gated product recomputed in backward is (correctly) not counted.
    _pack._invact_observer = True

    def __enter__(self) -> count_saved:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        by_dtype: dict[str, int] = defaultdict(int)
        held = [(storage.nbytes(), dtype) for storage, dtype in self._storages.values()]
        self._storages.clear()  # no reference kept past the count
        for nbytes, dtype in held:
            by_dtype[dtype] += nbytes
        self.report.saved_tensors = sum(1 for nbytes, _ in held if nbytes)
        self.report.saved_bytes = sum(by_dtype.values())
        self.report.by_dtype = dict(by_dtype)


def saved_tensors(
    model: nn.Module, *inputs, loss: Callable[[object], torch.Tensor] | None = None, **kwargs
) -> MemoryReport:
    """Run model(*inputs, **kwargs) once and measure what autograd saves; then run backward (with
    `loss(output)`, default: sum of the first floating tensor of the output) to free the graph. On
    CUDA, also the peak allocated memory of that whole forward+backward step."""
    cuda = any(p.is_cuda for p in model.parameters())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with count_saved(model) as counter:
        output = model(*inputs, **kwargs)
    (loss or _default_loss)(output).backward()
    report = counter.report
    if cuda:
        torch.cuda.synchronize()
        report.peak_cuda_bytes = torch.cuda.max_memory_allocated()
    return report


def _default_loss(output) -> torch.Tensor:
    for value in _tensors(output):
        if value.is_floating_point() and value.requires_grad:
            return value.float().sum()
    raise ValueError("the model's output holds no floating tensor that requires grad: pass loss=")


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, dict) or hasattr(output, "values"):
        for v in output.values():
            yield from _tensors(v)
    elif isinstance(output, (list, tuple)):
        for v in output:
            yield from _tensors(v)
