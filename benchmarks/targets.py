"""Time the exact-target inversion: N values of y per branch and activation, median of several runs.

Prints a markdown table and writes JSON (device, library versions, settings, rows) to
benchmarks/results/targets_cpu.json unless --out says otherwise. The target: 10^6 points in under 2 s
on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import scipy

from codegen.coeffs_json import write_atomic
from fitting.activations import ACTIVATIONS
from fitting.evaluate import branch_x_range
from fitting.targets import target

RESULTS = Path(__file__).resolve().parent / "results"


def sample_y(act, branch: str, n: int) -> np.ndarray:
    """y = f(x) for x uniform over the branch's part of [-20, 20] (what the metrics use)."""
    lo, hi = branch_x_range(act, branch)
    return act.f(np.linspace(lo, hi, n, endpoint=False) + (hi - lo) / (2 * n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=10**6, help="y values per branch (default 1e6)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row; the median is reported")
    parser.add_argument("--out", type=Path, default=RESULTS / "targets_cpu.json", help="JSON output path")
    args = parser.parse_args(argv)
    if args.points < 1 or args.repeats < 1:
        parser.error("--points and --repeats must be positive")

    rows = []
    for name, act in ACTIVATIONS.items():
        for branch in act.branches:
            y = sample_y(act, branch, args.points)
            target(act, y[:1000], branch)  # build the branch table outside the timing
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                target(act, y, branch)
                times.append(time.perf_counter() - t0)
            rows.append({"activation": name, "branch": branch, "seconds": statistics.median(times)})

    print(f"| activation | branch | seconds for {args.points:.0e} points (median of {args.repeats}) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['activation']} | {r['branch']} | {r['seconds']:.3f} |")
    result = {
        "device": f"cpu: {platform.processor() or platform.machine()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "settings": {"points": args.points, "repeats": args.repeats},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
