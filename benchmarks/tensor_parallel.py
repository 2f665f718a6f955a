"""Tensor parallel training on the CPU over gloo, eager TP against patch(): what each rank saves for
backward and its peak of live bytes in step 1, the losses, and whether any rank saved the logits.

Runs tests/invact/_tp_workers.py (one process a rank, one thread each; tests.gloo.launch) on 2 and 4 ranks
and tabulates its training cases: "hf" (transformers' tp_plan="auto" on a tiny Llama, labels in the
forward), "native" (the native Llama of benchmarks/native_models.py under torchtitan's parallelize_module
plan without sequence parallel, the loop's loss: eager F.cross_entropy on the gathered logits, patched the
one-line change to invact.functional.linear_cross_entropy with the head's DTensor weight), "native_sp" (the
same plan with its SequenceParallel norms) and, on 4 ranks,
"fsdp_tp" (the same on a 2 x 2 mesh, FSDP2 across, TP within) and "hf_fsdp_tp" (transformers' tp_plan and
fsdp_plan on a 2 x 2 mesh, patched after loading). Sizes: _tp_workers' (vocabulary 1002,
hidden 64, 2 layers, batch 2 x 128 tokens a rank), fp32. Per rank the largest figure of the ranks is shown
(they differ by a few KiB: the uneven vocabulary shards). Writes
benchmarks/results/tensor_parallel_cpu.json and its markdown table (.md).

    python benchmarks/tensor_parallel.py [--ranks 2 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.gloo import launch, log_tails  # noqa: E402
from tests.invact._tp_workers import BATCH, HIDDEN, LAYERS, SEQ, VOCAB  # noqa: E402

from timing import device_name, write_result  # noqa: E402

CASES = {
    "hf": "transformers tp_plan",
    "native": "native Llama, parallelize_module",
    "native_sp": "native Llama, parallelize_module + SequenceParallel",
    "fsdp_tp": "native, FSDP2 x TP",
    "hf_fsdp_tp": "transformers tp_plan + fsdp_plan, FSDP2 x TP",
}
TIMEOUT_S = 600


def _rank_results(ranks: int, folder: Path) -> dict:
    codes = launch([sys.executable, "-m", "tests.invact._tp_workers", str(folder)], ranks, folder, TIMEOUT_S)
    if any(codes):
        raise SystemExit(f"workers exited with {codes}:\n{log_tails(folder, ranks)}")
    out = {}
    for case in CASES:
        results = [torch.load(folder / f"{case}_rank{r}.pt", weights_only=False) for r in range(ranks)]
        for r in results:
            if "error" in r:
                raise SystemExit(f"{case}: {r['error']}")
        if "skipped" not in results[0]:
            out[case] = results
    return out


def rows(ranks_list: list[int]) -> list[dict]:
    table = []
    for ranks in ranks_list:
        with tempfile.TemporaryDirectory() as folder:
            for case, results in _rank_results(ranks, Path(folder)).items():
                row = {"case": case, "what": CASES[case], "ranks": ranks}
                for variant in ("eager", "patched"):
                    runs = [r[variant] for r in results]
                    row[variant] = {
                        "saved_mib": max(r["saved"] for r in runs) / 2**20,
                        "peak_mib": max(r["peak"] for r in runs) / 2**20,
                        "losses": runs[0]["losses"],
                        "vocab_wide_saved": max(len(r["vocab_wide"]) for r in runs),
                    }
                table.append(row)
    return table


def markdown(table: list[dict]) -> str:
    lines = [
        "| model, parallelism | ranks | saved a rank, eager -> patch() | peak a rank, eager -> patch() "
        "| logits saved (tensors), eager -> patch() | step 1 loss, eager / patch() |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        e, p = r["eager"], r["patched"]
        lines.append(
            f"| {r['what']} | {r['ranks']} | {e['saved_mib']:.2f} -> {p['saved_mib']:.2f} MiB "
            f"({p['saved_mib'] / e['saved_mib']:.2f}x) | {e['peak_mib']:.2f} -> {p['peak_mib']:.2f} MiB "
            f"({p['peak_mib'] / e['peak_mib']:.2f}x) | {e['vocab_wide_saved']} -> {p['vocab_wide_saved']} "
            f"| {e['losses'][0]:.6f} / {p['losses'][0]:.6f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path, default=None, help="the JSON to write (default: results/)")
    args = parser.parse_args(argv)
    table = rows(args.ranks)
    device = device_name("cpu").replace(f"{torch.get_num_threads()} threads", "1 thread a rank")
    shape = dict(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, batch=BATCH, seq=SEQ)
    result = {"device": device, "torch": torch.__version__, "dtype": "float32", "shape": shape, "rows": table}
    path = write_result(result, "tensor_parallel", "cpu", out=args.out)
    path.with_suffix(".md").write_text(markdown(table))
    print(markdown(table))


if __name__ == "__main__":
    main()
