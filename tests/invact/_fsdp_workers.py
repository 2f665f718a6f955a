"""A tiny Llama trained under FSDP2 (fully_shard) in the wrappings people use, under DDP and DeepSpeed
ZeRO-3, patched and not, for tests/invact/test_fsdp.py.

Run as a module, `python -m tests.invact._fsdp_workers OUT_DIR`, with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), it is one rank of a gloo job on the CPU. For each case
of CASES, one after the other with a barrier between them, it builds the model (seeded: the same
weights on both ranks), wraps it as the case says, once without and once after `invact.patch(model)`,
and runs STEPS training steps on its half of the global batch (forward with labels, backward,
AdamW's step, zero_grad), then saves to OUT_DIR/<case>_rank<r>.pt {"unpatched": run, "patched": run}
(_train's dicts), or the traceback under "error" where the case raised. Every case runs in these two
processes: importing transformers (3 s a process) is paid once.

The wrappings (fully_shard's unit structure as torchtitan and accelerate build it: each decoder layer,
then the root):
- "layers": each decoder layer a unit, the root holding embeddings, final norm and head;
- "tied": the same with tie_word_embeddings=True (the head's weight is the embeddings');
- "head_unit": the head a unit of its own (torchtitan's `fully_shard(model.output)`): its forward
  frees the all-gathered weight before the loss, which invact.loss._gathered gathers again;
- "no_reshard": "head_unit" with reshard_after_forward=False on the layers and the head;
- "mixed_bf16": "layers" under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32);
- "cpu_offload": "layers" under CPUOffloadPolicy (the shards, gradients and AdamW's step on the CPU;
  pin_memory only with an accelerator: torch refuses to pin without one, patched or not);
- "checkpointed": each decoder layer in torch's checkpoint_wrapper (non-reentrant) before sharding,
  what torchtitan's activation checkpointing and accelerate's FSDP `activation_checkpointing` do;
- "compiled": each decoder layer torch.compile'd (fullgraph) and registered in its place before
  sharding, as torchtitan's apply_compile does; backend aot_eager (AOTAutograd running the eager ops:
  inductor's C++ compile would add tens of seconds on two shared cores, see _stack_workers);
- "ddp": DistributedDataParallel;
- "patch_after_shard": "layers", with invact.patch() called on the sharded model (a user who shards
  first);
- "deepspeed_zero3": DeepSpeed's ZeRO stage 3 on its CPU accelerator (DS_ACCELERATOR=cpu), where
  deepspeed is installed (not a dependency of the project); {"skipped": why} where it is not;
- "norm_head_unit": the final norm and the head one unit (`fully_shard([norm, lm_head])`). Last: a
  crash of the workers (a segfault, tests/invact/test_fsdp.py's _GROUP_BUG) loses only the cases
  after the one that crashed.

As in _stack_workers, the CPU backward runs the generated torch functions (no_numba: numba would
compile its kernels in each process), with one thread a rank.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback

import torch

from tests.invact._stack_workers import _recording, no_numba

WORLD = 2
TIMEOUT_S = 60  # per collective; the parent's wait for the workers is longer
STEPS = 2
LR = 1e-3  # AdamW's default
# Sizes: a vocabulary and sequence long enough that the logits (SEQ x VOCAB fp32 a row) and the
# layers' activations are a real part of a step's peak, small enough for a fast CPU step.
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 512, 64, 128, 2, 4, 2
SEQ, ROWS_PER_RANK = 256, 1
CASES = ("layers", "tied", "head_unit", "no_reshard", "mixed_bf16", "cpu_offload", "checkpointed",
         "compiled", "ddp", "patch_after_shard", "deepspeed_zero3", "norm_head_unit")  # fmt: skip
FSDP_CASES = tuple(c for c in CASES if c not in ("ddp", "deepspeed_zero3"))
# Where the parameters' names carry a wrapper's prefix: removed, so that every case names them alike.
_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def make_model(tied: bool = False):
    """The tiny Llama, with the same random weights in every process (seeded), fp32, training mode;
    initializer_range 0.2 (as test_training_stacks._tiny_hf): pre-activations of std ~1, both sides of
    each activation's branch point in use."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=SEQ, tie_word_embeddings=tied,
                         initializer_range=0.2)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().train()


def global_batch() -> torch.Tensor:
    """input_ids (and labels) of the global batch: ROWS_PER_RANK rows for each rank."""
    return torch.randint(0, VOCAB, (WORLD * ROWS_PER_RANK, SEQ), generator=torch.Generator().manual_seed(1))


def rank_batch(rank: int) -> torch.Tensor:
    return global_batch()[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]


def plain_name(name: str) -> str:
    for prefix in _PREFIXES:
        name = name.replace(prefix, "")
    return name


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), a plain tensor as it is; detached, copied."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage this process holds: a DTensor's shard, a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _fully_shard(case: str, model, compiled_ops: set, traced: set) -> None:
    """The case's FSDP2 units, built bottom up as torchtitan's parallelize does: activation
    checkpointing and compilation of each layer first, then fully_shard on each layer, on the head's
    unit where the case has one, and on the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if case == "mixed_bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case == "cpu_offload":
        # pinned memory needs an accelerator: with CPUOffloadPolicy()'s pin_memory=True, torch refuses a
        # CPU-only machine ("Cannot access accelerator device when none is available"), patched or not
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    layers = model.model.layers
    for name, layer in list(layers.named_children()):
        if case == "checkpointed":
            layer = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if case == "compiled":
            layer = torch.compile(layer, backend=_recording(compiled_ops, traced), fullgraph=True)
        layers.register_module(name, layer)
    reshard = case != "no_reshard"
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    if case in ("head_unit", "no_reshard"):
        fully_shard(model.lm_head, reshard_after_forward=reshard, **kwargs)
    if case == "norm_head_unit":
        fully_shard([model.model.norm, model.lm_head], **kwargs)
    fully_shard(model, **kwargs)


def _deepspeed(model):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": ROWS_PER_RANK,
        "gradient_accumulation_steps": 1,
        # Every parameter partitioned (the default keeps those under 1e5 elements whole: all of this
        # model's) and released after its module's forward (the defaults keep up to 1e9 elements
        # gathered, and those used again within 1e9), buckets of this model's size (the default 5e8
        # elements allocates 2 GB a rank).
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                              "reduce_bucket_size": 2**16, "stage3_prefetch_bucket_size": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
    }  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _shard_sizes(model) -> dict:
    """{name: (elements this rank holds, elements of the whole parameter)}: a DTensor's shard, ZeRO-3's
    partition (ds_tensor), or a plain parameter whole."""
    sizes = {}
    for name, p in model.named_parameters():
        if hasattr(p, "ds_tensor"):
            sizes[plain_name(name)] = (p.ds_tensor.numel(), p.ds_numel)
        else:
            sizes[plain_name(name)] = (local(p).numel(), p.numel())
    return sizes


def _train(case: str, rank: int, patched: bool) -> dict:
    """STEPS steps of the case's wrapping on this rank's half of the batch. Returns {"losses": [per
    step], "grads": [per step: {name: the whole gradient}], "params": {name: the whole parameter after
    step 1's update}, "peak": the live bytes' peak of step 1's forward and backward
    (invact.planner.live_bytes.LiveBytes; None under compile, which Dynamo refuses to trace under a dispatch
    mode), "max_logit": max |logit| of each step (unpatched; [] patched, whose logits are not computed),
    "layer_calls": decoder-layer forwards in step 1 (checkpointing runs each again in backward),
    "param_types", "shards" (_shard_sizes), "patched": what invact.patch() replaced, and under compile
    "ops" and "traced" (_stack_workers._recording: the ops the compiled graphs run, and those Dynamo
    traced)."""
    import invact
    from invact.planner.live_bytes import LiveBytes

    model = make_model(tied=case == "tied")
    names = invact.patch(model) if patched and case != "patch_after_shard" else []
    calls = []
    if case != "compiled":  # a hook's side effect inside a compiled layer would be Dynamo's to trace
        for layer in model.model.layers:  # a pre-hook: checkpointing's recompute stops before the end
            layer.register_forward_pre_hook(lambda *_: calls.append(1))
    engine, ops, traced = None, set(), set()
    if case == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    elif case == "deepspeed_zero3":
        engine = wrapped = _deepspeed(model)
    else:
        _fully_shard(case, model, ops, traced)
        wrapped = model
    if patched and case == "patch_after_shard":
        names = invact.patch(model)
    optimizer = None if engine else torch.optim.AdamW(model.parameters(), lr=LR)
    ids = rank_batch(rank)
    run = {"losses": [], "grads": [], "peak": None, "max_logit": [], "patched": names}
    if engine is None:
        run["probe"] = _probe(wrapped, model, ids)
        calls.clear()  # step 1's layer forwards are counted
    for step in range(STEPS):
        measure = step == 0 and case != "compiled"
        known = [local(t) for t in (*model.parameters(), *model.buffers())]
        live = LiveBytes({"weights": known, "inputs": [ids]}) if measure else None
        try:
            with live or contextlib.nullcontext():
                out = wrapped(input_ids=ids, labels=ids, use_cache=False)
                loss, logits = out.loss, out.logits
                if isinstance(logits, torch.Tensor):
                    run["max_logit"].append(logits.detach().abs().max().item())
                del out, logits
                engine.backward(loss) if engine is not None else loss.backward()
        finally:
            if live is not None:
                live.close()
        if live is not None:
            run["peak"] = live.peak
        if step == 0:
            run["layer_calls"] = len(calls)
        run["losses"].append(loss.detach().item())
        if engine is not None:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

            run["grads"].append(
                {plain_name(n): safe_get_full_grad(p).clone() for n, p in model.named_parameters()}
            )
            engine.step()
            params = {plain_name(n): safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
        else:
            run["grads"].append(
                {plain_name(n): full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            params = {plain_name(n): full(p) for n, p in model.named_parameters()}
        if step == 0:
            run["params"] = params
    run["param_types"] = sorted({type(p).__name__ for p in model.parameters()})
    run["shards"] = _shard_sizes(model)
    if case == "compiled":
        run["ops"], run["traced"] = sorted(ops), sorted(traced)
    return run


def _read(logits) -> dict:
    """{"sum", "max"} of the logits (a patched model's computed when read), or {"error": its one line}."""
    try:
        values = logits.detach().float()
    except RuntimeError as e:
        return {"error": str(e)}
    return {"sum": values.sum().item(), "max": values.abs().max().item()}


def _probe(wrapped, model, ids) -> dict:
    """A forward with labels whose logits are read before its backward (of the loss times 0: no
    gradient), after it, and after every parameter is added 0 in place (what an optimizer's step does to
    the version counters, without changing a value), before any step: {"before", "after", "updated"},
    each _read's."""
    out = wrapped(input_ids=ids, labels=ids, use_cache=False)
    logits = out.logits
    before = _read(logits)
    (out.loss * 0).backward()
    model.zero_grad(set_to_none=True)
    after = _read(logits)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0)
    return {"before": before, "after": after, "updated": _read(logits)}


def run_case(case: str, rank: int) -> dict:
    """{"unpatched": run, "patched": run}, each _train's dict or {"error": traceback}, and "seconds"."""
    if case == "deepspeed_zero3":
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            return {"skipped": f"deepspeed is not installed ({e})"}
    start = time.perf_counter()
    torch._dynamo.reset()
    result = {}
    for variant in ("unpatched", "patched"):
        try:
            result[variant] = _train(case, rank, variant == "patched")
        except Exception:
            result[variant] = {"error": traceback.format_exc()}
    return {**result, "seconds": time.perf_counter() - start}


def main(out_dir: str) -> None:
    from tests.gloo import run_cases

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    no_numba()
    run_cases(CASES, run_case, out_dir, TIMEOUT_S)


if __name__ == "__main__":
    main(sys.argv[1])
