"""The real per-rank peak live bytes of one full training step under FSDP2 (torch's `fully_shard`) over
gloo on the CPU, for checking the planner's per-rank prediction (invact.planner.step) against.

One measurement: `python benchmarks/fsdp_peaks.py --config CFG.json --ranks N --batch B --seq S
[--patched] [--out results.json]` starts N processes (gloo on 127.0.0.1 at a free port, loopback
device, one thread each; every collective bounded by the process group's 60 s timeout, the launcher's
wait by --timeout). CFG is a config JSON (or folder with config.json) or one of ARCHITECTURES' names.
Each rank:
1. builds the model of the config as invact.planner.config.build_model chooses it (its class and attention
   implementation), but on the CPU with random weights (torch.manual_seed(0): the same on every rank),
   in bf16 (the "bf16" recipe: model, gradients and AdamW's state in bf16), in training mode;
2. with --patched, invact.patch(model) (the names it returns must be non-empty);
3. wraps it as torchtitan and accelerate do: fully_shard on each decoder layer (the modules whose class
   is in model._no_split_modules, else model.model.layers), then fully_shard(model), the root (its
   default: reshard_after_forward left to FSDP, which keeps the root's parameters unsharded after
   forward);
4. AdamW(model.parameters(), lr=1e-5, foreach=True); one warm-up step (forward with labels=input_ids,
   backward, step, zero_grad(set_to_none=True)), so that AdamW's state exists;
5. measures three more steps, each the same (forward, loss.backward(), optimizer.step(),
   zero_grad(set_to_none=True)), each under one instrument:
   - "livebytes": invact.planner.live_bytes.LiveBytes exactly as the planner uses it, constructed with the
     tensors alive before the step (weights: the parameters' local shards, p._local_tensor of each
     DTensor, and the buffers; optimizer: AdamW's state, DTensors' local tensors; inputs: input_ids =
     labels), its phase set to "forward", "backward" and "step" (the step and zero_grad). `checks`:
     whether it saw the sharded gradients (every p.grad's local storage noted by the end of backward).
     It over-counts under FSDP2: see the next item.
   - the row's own figures (`peak_bytes`, `at_peak`, `phase`, `op`, `peaks`, `peak_grads`): the same
     LiveBytes, told also of what FSDP2 does to storages without an op. The unsharded parameters live
     in FSDPParam.all_gather_outputs, tensors made once (the first all-gather) whose storages FSDP
     resizes to the padded unsharded size before each all-gather's copy-out and to 0 at each reshard
     (_fsdp_param.py alloc_storage / free_storage: UntypedStorage.resize_, which no dispatch mode
     sees). Plain LiveBytes notes such a storage when an op first returns a view of it (the copy-out's
     `.view(world_size, -1)`), at its full size, and keeps counting it after the reshard empties it
     (the FSDPParam keeps the storage alive): every unsharded parameter counts from its first
     all-gather to the end of the step. Here these storages are counted from the start (0 bytes while
     sharded) under the label "unsharded", their bytes following each resize.
   - "profiler": torch's own view, torch.profiler with profile_memory=True: the largest running sum
     of the CPU allocator's "[memory]" events (each allocation and free, resizes included) in time
     order, plus the bytes alive before the step (distinct storages of the local parameter shards,
     buffers, AdamW's state, the inputs), overall and within each phase (`peaks`). It also sees what
     kernels allocate inside themselves (no dispatch mode does), so where it equals `peak_bytes` no
     workspace was alive at the peak. (The resident set would be useless here: a few MiB on top of
     hundreds for torch and transformers.)
6. writes its results; the launcher gathers them into one JSON: {config, ranks, batch, seq, patched,
   dtype, torch, transformers, machine, per_rank: [{rank, peak_bytes, at_peak, phase, op, peaks,
   peak_grads, livebytes: {...}, profiler: {...}, checks: {...}, alive_before, ...}], seconds}. A rank
   that raises writes its traceback; the launcher reports it in one line and exits nonzero.

The inputs of a rank: input_ids (batch, seq) random in the vocabulary (seeded by the rank), labels the
same tensor. The patched CPU backward runs numba's kernels (NUMBA_NUM_THREADS=1), as a user's would.

`--matrix` runs MATRIX (three architectures, 2 and 4 ranks, eager and patched, batch 1 x seq 512 and
128 per rank, and seq 512 with Hugging Face's gradient checkpointing) and writes
benchmarks/results/fsdp_peaks_cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 2**20
TIMEOUT_S = 60  # per collective (the process group's timeout)
WAIT_S = 300  # the launcher's wait for all ranks of one measurement
DTYPE = "bfloat16"

# Small decoders (random weights from a config, nothing downloaded): vocabulary 2048, hidden 128, so that
# at seq 512 per rank the activations (and the loss's logits) are most of a rank's peak.
_SMALL = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
ARCHITECTURES: dict[str, dict] = {
    # untied head, SwiGLU, RMSNorm
    "llama": {"model_type": "llama", **_SMALL, "tie_word_embeddings": False},
    # RMSNorm on queries and keys, tied head
    "qwen3": {"model_type": "qwen3", **_SMALL, "head_dim": 32, "tie_word_embeddings": True},
    # Conv1D projections, LayerNorm, GELU, learned positions, tied head
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": 2048,
        "n_embd": 128,
        "n_inner": 256,
        "n_layer": 4,
        "n_head": 4,
        "n_positions": 1024,
    },  # fmt: skip
}
# Tensor parallel shards the heads over the ranks: 8 query and 4 key/value heads, whole heads on 2 and 4 ranks
for _name in ("llama", "qwen3"):
    ARCHITECTURES[f"{_name}-tp"] = {**ARCHITECTURES[_name], "num_attention_heads": 8,
                                    "num_key_value_heads": 4}  # fmt: skip
# seq 512: activations most of the peak; seq 128: FSDP2's own buffers and the shards a larger part of it;
# with Hugging Face's gradient checkpointing at seq 512 (its recompute runs FSDP2's hooks again)
MATRIX = dict(architectures=("llama", "qwen3", "gpt2"), ranks=(2, 4), patched=(False, True), batch=1,
              shapes=((512, False), (128, False), (512, True)))  # fmt: skip
# --tp-matrix: the same shapes under transformers' tp_plan (GPT-2 has none), results/tp_peaks_cpu.json:
# (ranks, tensor parallel group) of TP alone on 2 and 4 ranks, and TP in pairs with FSDP2 across two pairs
TP_MATRIX = {**MATRIX, "architectures": ("llama-tp", "qwen3-tp"), "ranks": (2, 4, 4), "tp": (2, 4, 2)}


# -- the worker: one rank ---------------------------------------------------------------------------------


def _local(t):
    """A DTensor's local tensor; any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def build(config, patched: bool):
    """(the model of `config` in bf16 on the CPU, random weights seeded; its class; attention; the names
    invact.patch returned)."""
    import torch
    import transformers

    import invact
    from invact.planner.config import build_model, load_config

    transformers.utils.logging.set_verbosity_error()
    config = load_config(config)[0]
    meta, attention = build_model(config, torch.bfloat16)  # the planner's choice of class and attention
    cls = type(meta)
    del meta
    torch.manual_seed(0)
    model = cls._from_config(config, dtype=torch.bfloat16, attn_implementation=attention)
    assert type(model) is cls and all(p.dtype == torch.bfloat16 for p in model.parameters())
    model.train()
    names = invact.patch(model) if patched else []
    if patched and not names:
        raise RuntimeError(f"invact.patch({cls.__name__}) patched nothing")
    return model, cls.__name__, attention, names


def shard(model) -> list[str]:
    """fully_shard on each decoder layer, then on the root (torchtitan's and accelerate's units); the
    layers' class names."""
    from torch.distributed.fsdp import fully_shard

    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        layers = list(model.model.layers)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return sorted({type(m).__name__ for m in layers}) + [f"x{len(layers)}"]


def _fsdp_params(model) -> list:
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    states, params = [], []
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        if state is not None and state not in states:
            states.append(state)
            for group in state._fsdp_param_groups:
                params.extend(group.fsdp_params)
    return params


_COUNTER = None  # the FSDPLiveBytes told of FSDP's storage resizes, while one is measuring


def _hook_fsdp_resizes() -> None:
    """Route FSDP2's alloc_storage / free_storage (storage resizes of the unsharded parameters) through
    _COUNTER as well."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor):
        alloc(tensor)
        if _COUNTER is not None:
            _COUNTER.resized(tensor.untyped_storage())

    def free_storage(tensor):
        free(tensor)
        if _COUNTER is not None:
            _COUNTER.resized(tensor.untyped_storage())

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage


def _live_class():
    from invact.planner.live_bytes import LiveBytes

    class FSDPLiveBytes(LiveBytes):
        """LiveBytes that also follows storages resized in place (FSDP2's unsharded parameters):
        `resized(storage)` sets its bytes to its current size, under the label "unsharded" where it is
        new."""

        def resized(self, storage) -> None:
            key, nbytes = storage._cdata, storage.nbytes()
            entry = self.live.get(key)
            if entry is None:
                self.live[key] = (storage._weak_ref(), nbytes, "unsharded")
                label, delta = "unsharded", nbytes
            else:
                self.live[key] = (entry[0], nbytes, entry[2])
                label, delta = entry[2], nbytes - entry[1]
            self.total += delta
            self.by_label[label] = self.by_label.get(label, 0) + delta

    return FSDPLiveBytes


def build_tensor_parallel(config, patched: bool, folder: Path, rank: int, tp: int, ranks: int):
    """build()'s model (unpatched) saved by rank 0 into `folder`, then loaded by every rank as transformers
    shards it for tensor parallelism: from_pretrained(folder, distributed_config=DistributedConfig(
    tp_plan="auto", tp_size=tp, fsdp_size=ranks // tp)) (the model's tp_plan: its projections' DTensor
    shards and forwards, over groups of `tp` ranks; with fewer than all, FSDP2 across the groups by the
    model's fsdp_plan), in bf16, then patched with `patched`. Returns build()'s four."""
    import warnings

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import invact
    from invact.planner.config import build_model, load_config

    meta, attention = build_model(load_config(config)[0], torch.bfloat16)  # build()'s class and attention
    cls = type(meta).__name__
    del meta
    if rank == 0:
        model = build(config, False)[0]
        model.save_pretrained(folder)
        del model
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on loading
        parallel = DistributedConfig(tp_plan="auto", tp_size=tp, fsdp_size=ranks // tp)
        model = AutoModelForCausalLM.from_pretrained(
            folder, distributed_config=parallel, dtype=torch.bfloat16, attn_implementation=attention,
        ).train()  # fmt: skip
    if type(model).__name__ not in (cls, f"FSDP{cls}"):  # FSDP2's fully_shard swaps the class
        raise RuntimeError(f"from_pretrained built {type(model).__name__}, not {cls}")
    # A shard of rows transformers loads on the CPU is a view of the whole checkpoint tensor
    # (distributed/sharding_utils.py: source[slices].to(device), a no-op on the CPU), keeping the whole
    # storage alive; on a GPU `.to` copies the slice alone. Each such shard copied out, as a GPU holds it.
    for p in model.parameters():
        local = getattr(p, "_local_tensor", None)
        if local is not None and local.untyped_storage().nbytes() > local.numel() * local.element_size():
            p._local_tensor = local.clone()
    names = invact.patch(model) if patched else []
    if patched and not names:
        raise RuntimeError(f"invact.patch({cls}) patched nothing")
    return model, cls, attention, names


def measure(spec: dict, rank: int) -> dict:
    import torch

    tp = spec.get("tp") or 0  # tensor parallel groups of this many ranks (0: FSDP2 alone)
    if tp:
        model, cls, attention, names = build_tensor_parallel(
            spec["config"], spec["patched"], Path(spec["folder"]), rank, tp, spec["ranks"]
        )
    else:
        model, cls, attention, names = build(spec["config"], spec["patched"])
    if spec.get("checkpointing"):  # Hugging Face's, as the planner's checkpointing rows (invact.planner.step)
        from invact.planner.recipes import enable_checkpointing

        enable_checkpointing(model)
    units = shard(model) if not tp else ["tp_plan", f"x{tp}", f"fsdp_plan x{spec['ranks'] // tp}"]
    # AdamW's foreach refuses tensor parallel's mix of DTensor and plain parameters ("got mixed
    # torch.Tensor and DTensor"): its for-loop there, as the planner's --tp (invact.planner.step)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=not tp)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1 + (rank // tp if tp else rank))  # a TP group's: one batch
    ids = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=generator)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    params = list(model.parameters())
    fsdp_params = _fsdp_params(model)

    def step(live=None, marks: bool = False):
        """One training step; `live`'s phase set as it goes; with `marks`, each phase inside a
        profiler range "fsdp_peaks::<phase>"."""
        from torch.profiler import record_function

        def phase(name):
            if live is not None:
                live.phase = name
            return record_function(f"fsdp_peaks::{name}") if marks else contextlib.nullcontext()

        with phase("forward"):
            loss = model(**inputs).loss
        with phase("backward"):
            loss.backward()
            del loss
        if live is not None:  # the sharded gradients, seen by the mode by the end of backward?
            grads = [_local(p.grad) for p in params if p.grad is not None]
            seen = sum(g.untyped_storage()._cdata in live.live for g in grads)
            checks["grads_seen"] = f"{seen}/{len(grads)}"
            checks["grad_types"] = sorted({type(p.grad).__name__ for p in params if p.grad is not None})
            checks["grad_bytes"] = _storage_bytes(grads)
        with phase("step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def state():
        return [
            _local(t) for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ]

    def known():
        weights = [_local(p) for p in model.parameters()] + list(model.buffers())
        return {"weights": weights, "optimizer": state(), "inputs": [ids]}

    def grads_bytes():
        return _storage_bytes([_local(p.grad) for p in params if p.grad is not None])

    step()  # the warm-up: AdamW's state, FSDP's lazy init and its all_gather_outputs tensors
    checks: dict = {}
    out = {"rank": rank, "model_class": cls, "attention": attention, "patched_modules": len(names),
           "fsdp_units": units, "param_types": sorted({type(p).__name__ for p in params})}  # fmt: skip
    k = known()
    out["alive_before"] = {label: _storage_bytes(ts) for label, ts in k.items()}
    out["alive_before"]["total"] = _storage_bytes([t for ts in k.values() for t in ts])
    out["unsharded_param_bytes"] = sum(t.numel() * t.element_size() for p in fsdp_params
                                       for t in p.all_gather_outputs)  # fmt: skip

    from invact.planner.live_bytes import LiveBytes

    def result(live) -> dict:
        return {"peak_bytes": live.peak, "at_peak": dict(live.at_peak), "phase": live.peak_phase,
                "op": str(live.peak_op), "peaks": dict(live.peaks),
                "peak_grads": live.peak_grads}  # fmt: skip

    # 1. LiveBytes as the planner uses it
    gc.collect()
    live = LiveBytes(known(), grads_bytes)
    with live:
        step(live)
    out["livebytes"] = result(live)
    out["checks"] = dict(checks)
    live.close()

    # 2. LiveBytes told of FSDP's storage resizes (the unsharded parameters): the row's figures
    global _COUNTER
    gc.collect()
    live = _live_class()(known(), grads_bytes)
    for p in fsdp_params:  # the unsharded parameters' storages: 0 bytes while sharded
        for t in p.all_gather_outputs:
            live.resized(t.untyped_storage())
    live.peak, live.at_peak = live.total, dict(live.by_label)
    _COUNTER = live
    try:
        with live:
            step(live)
    finally:
        _COUNTER = None
    out.update(result(live))
    live.close()

    # 3. torch's profiler: the CPU allocator's events
    if spec.get("profile", True):
        gc.collect()
        alive = out["alive_before"]["total"]
        from step_plan import profiled_peak

        profiled = profiled_peak(lambda: step(marks=True), ranges="fsdp_peaks::")
        out["profiler"] = {"peak_bytes": alive + profiled["peak"], "alive_before": alive,
                           "end_bytes": profiled["end"], "at": profiled["at"],
                           "peaks": {k: alive + v for k, v in profiled["peaks"].items()}}  # fmt: skip
    return out


def worker(out_dir: str) -> None:
    """One rank (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): writes
    OUT_DIR/rank<r>.json, the measurement or {"error": traceback}."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    spec = json.loads((Path(out_dir) / "spec.json").read_text())
    t0 = time.perf_counter()
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
        _hook_fsdp_resizes()
        result = measure(spec, rank)
    except BaseException:
        result = {"rank": rank, "error": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    path = Path(out_dir) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result, indent=1))
    os.replace(path.with_suffix(".tmp"), path)
    if "error" not in result:
        try:  # every rank done with its collectives before any leaves the group
            dist.barrier()
        except Exception:
            pass
    # Exit without tearing down the process group or the interpreter: torch's gloo threads can abort
    # there ("terminate called without an active exception"; tests/invact/_stack_workers.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if "error" not in result else 1)


# -- the launcher -----------------------------------------------------------------------------------------


class RunError(Exception):
    """A measurement failed: one line saying which rank and why."""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run(config, ranks: int, batch: int, seq: int, patched: bool, wait_s: float = WAIT_S,
        profile: bool = True, checkpointing: bool = False, tp: int = 0) -> dict:  # fmt: skip
    """One measurement: `ranks` processes; the gathered result (RunError where a rank failed)."""
    import torch
    import transformers

    from timing import cpu_model

    name = None
    if isinstance(config, str) and config in ARCHITECTURES:
        name, config = config, ARCHITECTURES[config]
    elif isinstance(config, (str, Path)):
        path = Path(config)
        name, config = str(path), json.loads((path / "config.json" if path.is_dir() else path).read_text())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fsdp_peaks_") as tmp:
        out = Path(tmp)
        spec = {"config": config, "batch": batch, "seq": seq, "patched": patched, "profile": profile,
                "checkpointing": checkpointing, "tp": tp, "ranks": ranks,
                "folder": str(out / "model")}  # fmt: skip
        (out / "spec.json").write_text(json.dumps(spec))
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from tests.gloo import launch

        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out)]
        codes = launch(command, ranks, out, wait_s)
        results, errors = [], []
        for rank, code in enumerate(codes):
            path = out / f"rank{rank}.json"
            if not path.exists():
                how = f"killed at the launcher's {wait_s:.0f} s" if code == -9 else f"exited {code}"
                errors.append(
                    f"rank {rank} {how} without a result: {_last_line((out / f'rank{rank}.log').read_text())}"
                )
                continue
            result = json.loads(path.read_text())
            if "error" in result:
                errors.append(f"rank {rank}: {_last_line(result['error'])}")
            results.append(result)
        if errors:
            # the first rank's traceback, for the one that raised first
            first = next((r["error"] for r in results if "error" in r), "")
            raise RunError("; ".join(errors) + (f"\n{first}" if first else ""))
    return {
        "config": {"name": name, **config},
        "ranks": ranks,
        "batch": batch,
        "seq": seq,
        "patched": patched,
        "checkpointing": checkpointing,
        "parallel": "tp" if tp else "fsdp",
        "tp": tp,
        "dtype": DTYPE,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, 1 thread a rank",
        "per_rank": results,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def summary(result: dict) -> str:
    """One line: arch, ranks, variant, the peak (rank 0 / max over ranks, MiB), its phase and op, then
    plain LiveBytes' and the profiler's."""
    per = result["per_rank"]

    def mib(sub=None):
        values = [(r[sub] if sub else r)["peak_bytes"] for r in per if (sub is None or sub in r)]
        return f"{values[0] / MIB:6.2f}/{max(values) / MIB:6.2f}" if values else "-"

    variant = "patched" if result["patched"] else "eager"
    r0 = per[0]
    tp = f" (tp {result['tp']})" if result.get("tp") else ""
    return (f"{result['config']['name']:>8} ranks {result['ranks']}{tp} {variant:>7}: peak {mib()} MiB"
            f" ({r0['phase']}, {r0['op']}); plain LiveBytes {mib('livebytes')}; profiler {mib('profiler')}"
            f"  [{result['seconds']:.1f} s]")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help=f"config JSON / folder, or one of {', '.join(ARCHITECTURES)}")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="rows per rank")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--patched", action="store_true", help="invact.patch(model) before sharding")
    parser.add_argument("--tp", type=int, default=0, metavar="N",
                        help="tensor parallel groups of N ranks (transformers' tp_plan); N below --ranks: "
                             "FSDP2 across the groups (its fsdp_plan)")  # fmt: skip
    parser.add_argument("--checkpointing", action="store_true",
                        help="Hugging Face's gradient checkpointing on each decoder layer")  # fmt: skip
    parser.add_argument("--out", type=Path, help="where to write the JSON")
    parser.add_argument("--matrix", action="store_true", help="run MATRIX into results/fsdp_peaks_cpu.json")
    parser.add_argument("--tp-matrix", action="store_true",
                        help="run TP_MATRIX into results/tp_peaks_cpu.json")  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=WAIT_S, help="the launcher's wait per measurement (s)"
    )
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiler's step")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0  # not reached
    sys.path.insert(0, str(HERE))
    if args.matrix or args.tp_matrix:
        from timing import write_result

        t0, runs, failed = time.perf_counter(), [], 0
        matrix, kind = (TP_MATRIX, "tp") if args.tp_matrix else (MATRIX, "fsdp")
        groups = list(zip(matrix["ranks"], matrix.get("tp", (0,) * len(matrix["ranks"])), strict=True))
        cases = [(name, ranks, tp, patched, seq, ckpt) for seq, ckpt in matrix["shapes"]
                 for name in matrix["architectures"] for ranks, tp in groups
                 for patched in matrix["patched"]]  # fmt: skip
        for name, ranks, tp, patched, seq, ckpt in cases:
            try:
                result = run(name, ranks, matrix["batch"], seq, patched, args.timeout, args.profile, ckpt,
                             tp)  # fmt: skip
                print(summary(result), flush=True)
            except RunError as e:
                failed += 1
                line = str(e).splitlines()[0]
                print(f"{name} ranks {ranks} patched {patched}: FAILED: {line}", flush=True)
                result = {"config": {"name": name, **ARCHITECTURES[name]}, "ranks": ranks,
                          "batch": matrix["batch"], "seq": seq, "patched": patched,
                          "checkpointing": ckpt, "parallel": kind, "tp": tp, "error": line}  # fmt: skip
            runs.append(result)
        seconds = round(time.perf_counter() - t0, 1)
        print(f"matrix: {len(runs)} runs in {seconds} s")
        out = args.out or HERE / "results" / f"{kind}_peaks_cpu.json"
        write_result({"benchmark": f"{kind}_peaks", "matrix": {k: list(v) if isinstance(v, tuple) else v
                                                               for k, v in matrix.items()},
                      "seconds": seconds, "runs": runs}, f"{kind}_peaks", "cpu", out=out)  # fmt: skip
        return 1 if failed else 0
    if not args.config:
        parser.error("--config (or --matrix, --tp-matrix) is required")
    try:
        result = run(args.config, args.ranks, args.batch, args.seq, args.patched, args.timeout, args.profile,
                     args.checkpointing, args.tp)  # fmt: skip
    except RunError as e:
        print(f"FAILED: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(summary(result))
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"written to {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
