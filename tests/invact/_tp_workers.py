"""Tensor parallel runs (DTensor, gloo, the CPU) for tests/invact/test_tensor_parallel.py.

Run as a module, `python -m tests.invact._tp_workers OUT_DIR`, with torchrun's environment (tests.gloo.launch;
WORLD_SIZE 2 or 4), it is one rank of a gloo job that runs CASES one after the other (tests.gloo.run_cases:
each result in OUT_DIR/<case>_rank<r>.pt):

- "functional": invact.functional.linear_cross_entropy with the weight (and bias) a DTensor sharded over
  the vocabulary (Shard(0) on a 1-D mesh of every rank) against float64 F.cross_entropy(F.linear(...)) on
  the whole weight, for every argument (bias, class weights, label smoothing, ignore_index, reductions),
  in one chunk and in many: the relative error of the loss and each gradient, per case;
- "hf": transformers' tensor parallelism (from_pretrained with DistributedConfig(tp_plan="auto"): the
  Llama's colwise/rowwise projections and its "colwise_gather_output" head) of a tiny Llama saved by rank
  0, eager and after invact.patch(): STEPS AdamW steps with labels (_steps); and the bytes a patched
  forward saves with the gated products behind the row-parallel down projections' DTensors recomputed
  and not (_products);
- "native": the native Llama of benchmarks/native_models.py (torchtitan's module structure) parallelized as
  torchtitan does without sequence parallel (parallelize_module: ColwiseParallel wq/wk/wv, w1/w3 and the
  head, RowwiseParallel wo, w2 and the embeddings), eager with the loop's F.cross_entropy on the gathered
  logits, and patch() (called before parallelizing, torchtitan's order) with the loop's one-line change,
  linear_cross_entropy on the hidden states and the head's DTensor weight;
- "native_sp": the same with torchtitan's sequence parallel norms (SequenceParallel on each block's norms and
  the final norm, PrepareModuleInput before the attention and the MLP, RowwiseParallel reducing-scattering
  over the sequence): the inverted norms run on each rank's rows, the loss gathers the final norm's output;
- "fsdp_tp" (4 ranks): the same native Llama on a 2 x 2 mesh, TP within ("tp") and FSDP2 (fully_shard on
  each block and the root) across ("dp"), each dp group its own half of the batch;
- "hf_fsdp_tp" (4 ranks): "hf"'s Llama loaded by transformers on a 2 x 2 mesh (DistributedConfig(
  tp_plan="auto", tp_size=2, fsdp_size=2): its tp_plan within, its fsdp_plan across: the embeddings, each
  layer, the final norm with the head, the root), patched after loading, each dp group its own batch;
- "hf_fsdp_tp_tied" (4 ranks): the same with the head tied to the embeddings (transformers' fsdp_plan
  keeps their unit gathered; the head is no unit of its own).

Step 1 of each training run records its loss, every parameter's whole gradient, the bytes autograd saved
(invact.memory.count_saved), the live bytes' peak (invact.planner.live_bytes.LiveBytes), and the saved
tensors whose last dimension is the vocabulary's or a rank's shard of it (the logits, their log-softmax).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.invact._stack_workers import no_numba

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60  # per collective; the parent's wait is longer
STEPS = 2
LR = 1e-3
# A vocabulary that 2 and 4 ranks shard unevenly (501 | 251, 251, 250, 250 rows), wider than any other
# dimension: a saved tensor whose last dimension is a shard's or the whole vocabulary's is the logits'.
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, SEQ, BATCH = 1002, 64, 128, 2, 4, 128, 2
CASES = ("functional", "hf", "native", "native_sp", "fsdp_tp", "hf_fsdp_tp", "hf_fsdp_tp_tied")
# "functional"'s sizes and cases: test_linear_cross_entropy's (40 rows of 16, a vocabulary of 601, which 2
# and 4 ranks shard unevenly too)
ROWS, FN_HIDDEN, FN_VOCAB = 40, 16, 601
REDUCTIONS, SMOOTHINGS = ("mean", "sum", "none"), (0.0, 0.1)


def _world() -> int:
    return dist.get_world_size()


def _functional(rank: int) -> dict:
    """{case id: max relative error of the loss and the gradients against float64}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import invact
    from invact.loss import op as loss_op

    mesh = init_device_mesh("cpu", (_world(),))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FN_HIDDEN, generator=g, dtype=torch.float64)
    w = torch.randn(FN_VOCAB, FN_HIDDEN, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(FN_VOCAB, generator=g, dtype=torch.float64)
    cw = torch.rand(FN_VOCAB, generator=g, dtype=torch.float64) + 0.5
    t = torch.randint(0, FN_VOCAB, (ROWS,), generator=g)
    t[:7] = -100
    errors, blocks, min_rows = {}, dict(loss_op.BLOCK_BYTES), loss_op.MIN_ROWS
    for chunks, reduction, smoothing, weighted, bias in itertools.product(
        ("one chunk", "many chunks"), REDUCTIONS, SMOOTHINGS, (False, True), (False, True)
    ):
        many = chunks == "many chunks"  # 6 rows of fp32 logits of the widest shard a chunk
        loss_op.BLOCK_BYTES = {"cpu": 6 * 4 * FN_VOCAB, "cuda": 6 * 4 * FN_VOCAB} if many else blocks
        loss_op.MIN_ROWS = 1 if many else min_rows
        leaves = [v.clone().requires_grad_() for v in (x, w, b)]
        upstream = (torch.linspace(0.5, 1.5, ROWS, dtype=torch.float64) if reduction == "none"
                    else torch.tensor(1.3, dtype=torch.float64))  # fmt: skip
        want = F.cross_entropy(F.linear(leaves[0], leaves[1], leaves[2] if bias else None), t,
                               weight=cw if weighted else None, reduction=reduction,
                               label_smoothing=smoothing)  # fmt: skip
        want.backward(upstream)
        xs = x.float().requires_grad_()
        wd = distribute_tensor(w.float(), mesh, [Shard(0)]).requires_grad_()
        bd = distribute_tensor(b.float(), mesh, [Shard(0)]).requires_grad_()
        lce = invact.functional.linear_cross_entropy
        got = lce(xs, wd, t, linear_bias=bd if bias else None, weight=cw.float() if weighted else None,
                  reduction=reduction, label_smoothing=smoothing)  # fmt: skip
        got.backward(upstream.float())
        pairs = [(got.detach(), want), (xs.grad, leaves[0].grad), (wd.grad.full_tensor(), leaves[1].grad)]
        if bias:
            pairs.append((bd.grad.full_tensor(), leaves[2].grad))
        key = f"{chunks}-{reduction}-smoothing {smoothing}-{'weights' * weighted}-{'bias' * bias}"
        errors[key] = max(float((a.double() - r.detach()).norm() / r.detach().norm()) for a, r in pairs)
    loss_op.BLOCK_BYTES, loss_op.MIN_ROWS = blocks, min_rows
    return {"errors": errors}


def _batch(rows: int = BATCH, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _VocabWide:
    """Saved-tensor hooks inside `counted` (an invact.memory.count_saved, whose own hooks the innermost
    ones replace: each tensor is handed on to it) that keep the shapes of the tensors autograd saves whose
    last dimension is the vocabulary's or a rank's shard of it (a DTensor by its own and its local shape)."""

    def __init__(self, widths: set[int], counted) -> None:
        self.widths, self.shapes, self.counted = widths, [], counted
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.counted._pack(t)
        local = getattr(t, "_local_tensor", t)
        if t.dim() and (t.shape[-1] in self.widths or local.shape[-1] in self.widths):
            self.shapes.append(tuple(t.shape))
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def _shard_widths(world: int) -> set[int]:
    """The vocabulary's width and each rank's shard of it (torch.chunk's sizes, DTensor's Shard)."""
    return {VOCAB} | {c.numel() for c in torch.arange(VOCAB).chunk(world)}


def _steps(model, loss_of, params_of=None) -> dict:
    """STEPS AdamW steps of `loss_of(model)` (a scalar): {"losses", "grads" (step 1, whole), "saved" (step 1's
    bytes, invact.memory.count_saved), "peak" (step 1's live bytes, invact.planner.live_bytes.LiveBytes),
    "vocab_wide" (step 1's saved tensors of the vocabulary's width, their shapes)}."""
    import invact
    from invact.planner.live_bytes import LiveBytes

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    run, widths = {"losses": []}, _shard_widths(_world())
    for step in range(STEPS):
        known = [getattr(t, "_local_tensor", t) for t in (*model.parameters(), *model.buffers())]
        live = LiveBytes({"weights": known}) if step == 0 else None
        try:
            with (
                invact.memory.count_saved(model) as counted,
                _VocabWide(widths, counted) as wide,
                live or _null(),
            ):
                loss = loss_of(model)
                loss.backward()
        finally:
            if live is not None:
                live.close()
        run["losses"].append(loss.item())
        if step == 0:
            run["peak"], run["saved"], run["vocab_wide"] = live.peak, counted.report.saved_bytes, wide.shapes
            run["grads"] = {n: _whole(p.grad).detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return run


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _hf(rank: int, out_dir: Path) -> dict:
    import warnings

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    import invact

    folder = out_dir / "hf_llama"
    if rank == 0:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                             max_position_embeddings=SEQ, initializer_range=0.2)  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    dist.barrier()
    ids = _batch()
    result = {}
    for variant in ("eager", "patched"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notes on loading
            tp = DistributedConfig(tp_plan="auto")
            model = AutoModelForCausalLM.from_pretrained(
                folder, distributed_config=tp, dtype=torch.float32
            ).train()
        run = {}
        if variant == "patched":
            run["plan"] = {d.name: (d.kind, d.replace, d.reason) for d in invact.plan(model)}
            run["taken"] = invact.patch(model)
        logits = model(input_ids=ids, labels=ids).logits  # patched: on demand, gathered over the ranks
        run["logits"] = (logits.logits() if hasattr(logits, "logits") and not torch.is_tensor(logits)
                         else logits).detach().clone()  # fmt: skip
        run["logits_type"] = type(logits).__name__
        del logits
        run.update(_steps(model, lambda m: m(input_ids=ids, labels=ids).loss))
        result[variant] = run
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()  # one process, whole
    invact.patch(model)
    result["reference"] = _reference(model, lambda m: m(input_ids=ids, labels=ids).loss)
    result["hooked"] = _hooked_head(folder)
    result["products"] = _products(folder, ids)
    return result


def _products(folder: Path, ids: torch.Tensor) -> dict:
    """The bytes one patched forward saves (invact.memory.count_saved) under transformers' TP, with the
    gated products behind the down projections' DTensors recomputed ("recomputed", patch()'s) and with
    that recognition turned off ("kept": invact.mlp.gated._dtensor_product_node answering None)."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import invact
    from invact.mlp import gated

    out, found = {}, gated._dtensor_product_node
    for variant in ("recomputed", "kept"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(
                folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32
            ).train()
        invact.patch(model)
        if variant == "kept":
            gated._dtensor_product_node = lambda t: None
        try:
            with invact.memory.count_saved(model) as counted:
                del model(input_ids=ids, labels=ids).loss
        finally:
            gated._dtensor_product_node = found
        out[variant] = counted.report.saved_bytes
    return out


def _hooked_head(folder: Path) -> dict:
    """A head parallelize_module shards (forward hooks, not transformers' tp_plan): what plan() says of it,
    what patch() takes, and step 1's loss patched and not (equal: the loss left as it is)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    import invact

    mesh, ids, out = init_device_mesh("cpu", (_world(),)), _batch(), {}
    for variant in ("eager", "patched"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
        if variant == "patched":
            out["plan"] = {d.name: (d.kind, d.replace, d.reason) for d in invact.plan(model)}
            out["taken"] = invact.patch(model)
        out[variant] = model(input_ids=ids, labels=ids).loss.item()
    return out


def _reference(model, loss_of) -> dict:
    """Step 1's loss and whole gradients of the patched model in this one process, undistributed."""
    loss = loss_of(model)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _native_model():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from native_models import NativeLlama

    torch.manual_seed(0)
    model = NativeLlama(HIDDEN, LAYERS, INTERMEDIATE, HEADS, VOCAB)
    for p in model.parameters():  # pre-activations of std ~1: both sides of the activation's branch point
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else None
    return model.train()


def _tp_plan(model, sequence_parallel: bool) -> dict:
    """torchtitan's tensor parallel plan for its Llama (apply_tp), with its sequence parallel norms (the
    residual stream sharded over the sequence between the blocks' TP regions) or without."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    rows = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=rows),
            "output": ColwiseParallel(input_layouts=rows, output_layouts=Replicate())}  # fmt: skip
    for i in range(len(model.layers)):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel(output_layouts=rows)
        if sequence_parallel:
            for name in ("attention_norm", "ffn_norm"):
                plan[f"layers.{i}.{name}"] = SequenceParallel()
            whole = PrepareModuleInput(
                input_layouts=(rows, None, None), desired_input_layouts=(Replicate(), None, None)
            )
            plan[f"layers.{i}.attention"] = whole
            whole = PrepareModuleInput(input_layouts=(rows,), desired_input_layouts=(Replicate(),))
            plan[f"layers.{i}.feed_forward"] = whole
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def _native_loss(patched: bool, ids: torch.Tensor):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from native_models import _body

    from invact.functional import linear_cross_entropy

    labels = ids.roll(-1, 1).flatten()

    def loss_of(model):
        if not patched:  # the loop's loss on the gathered logits
            return F.cross_entropy(model(ids).flatten(0, 1).float(), labels)
        return linear_cross_entropy(_body(model, ids).flatten(0, 1), model.output.weight, labels)

    return loss_of


def _native(rank: int, mesh=None, dp=None, sequence_parallel: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import invact

    tp = mesh if mesh is not None else init_device_mesh("cpu", (_world(),))
    ids = _batch() if dp is None else _batch(seed=1 + dp.get_local_rank())
    result = {}
    for variant in ("eager", "patched"):
        model = _native_model()
        run = {"taken": invact.patch(model) if variant == "patched" else []}
        parallelize_module(model, tp, _tp_plan(model, sequence_parallel))
        if dp is not None:
            from torch.distributed.fsdp import fully_shard

            for block in model.layers:
                fully_shard(block, mesh=dp)
            fully_shard(model, mesh=dp)
        run.update(_steps(model, _native_loss(variant == "patched", ids)))
        result[variant] = run
    model = _native_model()
    invact.patch(model)
    whole = ids if dp is None else torch.cat([_batch(seed=1 + r) for r in range(dp.size())])
    result["reference"] = _reference(model, _native_loss(True, whole))
    return result


def _hf_fsdp_tp(rank: int, out_dir: Path, tied: bool = False) -> dict:
    import warnings

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    import invact

    if _world() != 4:
        return {"skipped": "2-D FSDP2 x TP takes 4 ranks"}
    folder = out_dir / "hf_llama"  # "hf"'s, saved by rank 0 before
    if tied:
        folder = out_dir / "hf_llama_tied"
        if rank == 0:
            config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                 num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                 num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                                 initializer_range=0.2, tie_word_embeddings=True)  # fmt: skip
            torch.manual_seed(0)
            LlamaForCausalLM(config).save_pretrained(folder)
        dist.barrier()
    dp_rank = rank // 2  # transformers' mesh: (fsdp, tp), tp the inner dimension
    ids, result = _batch(seed=1 + dp_rank), {}
    for variant in ("eager", "patched"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallel = DistributedConfig(tp_plan="auto", tp_size=2, fsdp_size=2)
            model = AutoModelForCausalLM.from_pretrained(
                folder, distributed_config=parallel, dtype=torch.float32
            ).train()
        run = {"taken": invact.patch(model) if variant == "patched" else []}
        run.update(_steps(model, lambda m: m(input_ids=ids, labels=ids).loss))
        result[variant] = run
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    invact.patch(model)
    whole = torch.cat([_batch(seed=1 + r) for r in range(2)])
    result["reference"] = _reference(model, lambda m: m(input_ids=whole, labels=whole).loss)
    return result


def _fsdp_tp(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    if _world() != 4:
        return {"skipped": "2-D FSDP2 x TP takes 4 ranks"}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _native(rank, mesh["tp"], mesh["dp"])


def run_case(case: str, rank: int, out_dir: Path) -> dict:
    torch.set_num_threads(1)
    if case == "functional":
        return _functional(rank)
    if case == "hf":
        return _hf(rank, out_dir)
    if case == "native":
        return _native(rank)
    if case == "native_sp":
        return _native(rank, sequence_parallel=True)
    if case in ("hf_fsdp_tp", "hf_fsdp_tp_tied"):
        return _hf_fsdp_tp(rank, out_dir, tied=case.endswith("tied"))
    return _fsdp_tp(rank)


def main(out_dir: str) -> None:
    from tests.gloo import run_cases

    no_numba()
    run_cases(CASES, lambda case, rank: run_case(case, rank, Path(out_dir)), out_dir, TIMEOUT_S)


if __name__ == "__main__":
    main(sys.argv[1])
