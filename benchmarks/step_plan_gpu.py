"""The planner's whole-step peak and its longest sequence, against a real GPU: does
`invact plan CONFIG --fits SIZE` (invact.planner.step, meta device, planned as on CUDA) give what a real
training step on the GPU allocates, and the longest sequence that really fits?

For a committed config (default the Llama-3.2-1B shape, random weights, nothing downloaded), each recipe
(default bf16 LoRA rank 16 and full bf16 fine-tuning), eager and after invact.patch(), at batch 1:

- at each of --seqs: predicted `Step(config, recipe, device="cuda").peak(1, seq)` against
  `torch.cuda.max_memory_allocated()` of one real step (after a warm-up step, the peak statistics
  reset; the step's inputs, weights, gradients and AdamW's state all on the GPU);
- the longest sequence that fits --budget: the planner's (invact.planner.fits.largest, as `--fits`
  searches) against the real boundary, found by bisection in multiples of SEQ_MULTIPLE with the
  caching allocator held to the budget (torch.cuda.set_per_process_memory_fraction): a step that
  raises torch.cuda.OutOfMemoryError does not fit. The bisection starts from the planner's answer
  and brackets it in steps of BRACKET.

Writes benchmarks/results/step_plan_gpu_<device>.json and its markdown table beside it. Needs a CUDA
device; `benchmarks/gpu_suite.sh plan` runs it.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from step_plan import inputs, steps

from timing import RESULTS, device_name, device_slug, version, write_result

CONFIGS = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = CONFIGS / "llama-3.2-1b-shaped.json"
# The acceptance: predicted within 5% of max_memory_allocated, the longest sequence within 10% of the
# real boundary.
PEAK_WITHIN = 0.05
LONGEST_WITHIN = 0.10
# The bracket's steps around the planner's longest sequence: a tenth of it (the acceptance's width), so
# that a prediction within it costs one probe each side.
BRACKET = 0.10


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


class KeptAfterOOM(RuntimeError):
    """Memory a failed probe left allocated: every later probe of the process would read low."""


def attempt(run, allocated=torch.cuda.memory_allocated) -> bool:
    """Whether run() completes without torch.cuda.OutOfMemoryError. After an out-of-memory error the
    exception is dropped before anything is freed (its traceback's frames hold the step's tensors:
    freeing inside the except clause frees nothing, which once made every later probe of a run fail),
    then the allocated bytes must be back where they were before run(), or KeptAfterOOM is raised."""
    before = allocated()
    failed = False
    try:
        run()
    except torch.cuda.OutOfMemoryError:
        failed = True
    # here the exception, its traceback and their frames are gone
    _free()
    after = allocated() if failed else before
    if after > before:
        raise KeptAfterOOM(f"{after - before} bytes still allocated after an out-of-memory probe")
    return not failed


def measured_peak(step, seq: int) -> int:
    """max_memory_allocated() over one real step at (1, seq), after a warm-up step."""
    given = inputs(step, 1, seq)
    step.run(given)
    torch.cuda.synchronize()
    _free()
    torch.cuda.reset_peak_memory_stats()
    step.run(given)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def runs(step, seq: int) -> bool:
    """A real step at (1, seq) completes within the allocator's limit (no OutOfMemoryError; attempt)."""

    def run() -> None:
        try:
            step.run(inputs(step, 1, seq))
            torch.cuda.synchronize()
        finally:
            step.optimizer.zero_grad(set_to_none=True)  # a step that failed in backward: its gradients

    return attempt(run)


def boundary(fits, guess: int, multiple: int, cap: int) -> tuple[int, int]:
    """(the largest multiple of `multiple` in [multiple, cap] for which fits(x) holds, fits(x) assumed
    to hold up to a point and not beyond; how many calls it took): a bracket grown from `guess` in
    steps of BRACKET * guess, then bisection."""
    calls = 0

    def probe(x: int) -> bool:
        nonlocal calls
        calls += 1
        return fits(x)

    down = lambda x: max(multiple, min(cap, x // multiple * multiple))  # noqa: E731
    stride = max(multiple, down(int(guess * BRACKET)))
    x = down(max(guess, multiple))
    if probe(x):
        low, high = x, None
        while high is None and low < cap:
            x = down(low + stride)
            if probe(x):
                low = x
            else:
                high = x
        if high is None:
            return low, calls
    else:
        high, low = x, None
        while low is None:
            if high == multiple:
                return 0, calls
            x = down(high - stride)
            if probe(x):
                low = x
            else:
                high = x
    while high - low > multiple:
        mid = down((low + high) // 2)
        if probe(mid):
            low = mid
        else:
            high = mid
    return low, calls


def compare(config: dict, recipe: str, seqs, budget: int, report=print):
    from invact.planner.fits import largest
    from invact.planner.options import SEQ_MULTIPLE

    meta, real = steps(config, recipe, device="cuda")
    cap = getattr(meta.base.config.get_text_config(), "max_position_embeddings", None) or 2**17
    total = torch.cuda.get_device_properties(0).total_memory
    for patched in (False, True):
        if patched:
            meta.patch()
            real.patch()
        for seq in seqs:
            predicted = meta.peak(1, seq)
            _free()
            peak: list[int] = []
            measure = lambda peak=peak, seq=seq: peak.append(measured_peak(real, seq))  # noqa: E731
            measured = peak[0] if attempt(measure) else None
            row = {
                "recipe": recipe,
                "patched": patched,
                "seq": seq,
                "predicted_bytes": predicted["peak_bytes"],
                "measured_bytes": measured,
                "phase": predicted["phase"],
                "ratio": None if measured is None else predicted["peak_bytes"] / measured,
            }
            report(row)
            yield row
        t0 = time.perf_counter()
        planned, _, _ = largest(lambda x: meta.peak(1, x), budget, SEQ_MULTIPLE, cap)
        t1 = time.perf_counter()
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        try:
            real_seq, probes = boundary(lambda x: runs(real, x), planned or SEQ_MULTIPLE, SEQ_MULTIPLE, cap)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        row = {"recipe": recipe, "patched": patched, "budget_bytes": budget, "planned_seq": planned,
               "real_seq": real_seq, "probes": probes, "plan_s": round(t1 - t0, 1),
               "bisect_s": round(time.perf_counter() - t1, 1),
               "ratio": planned / real_seq if real_seq else None}  # fmt: skip
        report(row)
        yield row


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        f"| {' | '.join(header)} |",
        "|" + " --- |" * len(header),
        *(f"| {' | '.join(r)} |" for r in rows),
    ]


def _ratio(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(result: dict) -> str:
    gib = 2**30
    peaks = [
        [r["recipe"], "yes" if r["patched"] else "no", str(r["seq"]), f"{r['predicted_bytes'] / gib:.2f}",
         "OOM" if r["measured_bytes"] is None else f"{r['measured_bytes'] / gib:.2f}", _ratio(r["ratio"], 4)]
        for r in result["peaks"]
    ]  # fmt: skip
    longest = [
        [r["recipe"], "yes" if r["patched"] else "no", str(r["planned_seq"]), str(r["real_seq"]),
         _ratio(r["ratio"], 3)]
        for r in result["longest"]
    ]  # fmt: skip
    return "\n".join(
        [
            f"Predicted (invact.planner.step, meta device, as on CUDA) against a real step on "
            f"{result['device']}, {result['config']}, batch 1.",
            "",
            *_markdown(
                ["recipe", "patched", "seq", "predicted GiB", "max_memory_allocated GiB", "ratio"], peaks
            ),
            "",
            f"The longest sequence in {result['budget']}:",
            "",
            *_markdown(["recipe", "patched", "planned", "real (bisected)", "ratio"], longest),
        ]
    )


def main(argv=None) -> int:
    import json

    from invact.planner.options import parse_size
    from invact.planner.recipes import RECIPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="a config JSON (default %(default)s)"
    )
    parser.add_argument("--recipes", nargs="+", default=["lora", "bf16"], choices=list(RECIPES),
                        help="recipes (default lora bf16)")  # fmt: skip
    parser.add_argument("--seqs", nargs="+", type=int, default=[2048, 4096],
                        help="sequence lengths of the peak comparison (default 2048 4096)")  # fmt: skip
    parser.add_argument(
        "--budget", default="24GiB", help="the memory the longest sequence must fit (default 24GiB)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON file (default results/step_plan_gpu_<device>.json)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the CPU's comparison is benchmarks/step_plan.py)")
    config = json.loads(args.config.read_text())
    budget = parse_size(args.budget)
    start = time.perf_counter()
    peaks, longest = [], []
    for recipe in args.recipes:
        for row in compare(config, recipe, args.seqs, budget):
            (longest if "planned_seq" in row else peaks).append(row)
        _free()
    result = {
        "device": device_name("cuda"),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "peft": version("peft"),
        "config": str(
            args.config.relative_to(Path.cwd()) if args.config.is_relative_to(Path.cwd()) else args.config
        ),
        "budget": args.budget,
        "acceptance": {"peak_within": PEAK_WITHIN, "longest_within": LONGEST_WITHIN},
        "wall_s": round(time.perf_counter() - start, 1),
        "peaks": peaks,
        "longest": longest,
    }
    print()
    print(table(result))
    path = write_result(
        result, "step_plan_gpu", "cuda", out=args.out or RESULTS / f"step_plan_gpu_{device_slug('cuda')}.json"
    )
    path.with_suffix(".md").write_text(table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
