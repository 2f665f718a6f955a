"""`make compat`: the core tests at the ends of the supported range, each in a throwaway environment.

    python tests/compat.py                 # every environment in ENVIRONMENTS
    python tests/compat.py --only oldest   # one (or more) of them
    python tests/compat.py --smoke         # SMOKE's few tests (what CI may afford), not CORE

Each environment is a venv under .compat/NAME (kept between runs: installing torch takes minutes)
with its torch and transformers pinned, the checkout on sys.path (PYTHONPATH, nothing installed from
it), and pytest; the core test files run there with `-m "not slow"`, then `invact plan
benchmarks/configs/llama-3.2-1b-shaped.json --fits 24GiB`. Each environment's row (passed / failed /
skipped / errors, whether the plan ran, the machine, the date and the commit) replaces its earlier
one in benchmarks/results/compat_cpu.json, and the table of all rows is printed and written beside it
(.md), so `--only` reruns one environment. The exit status is 1 where a test of this run failed or
a plan did not run, so the target fails as CI would.

The range itself is declared once, in invact/_versions.py (SUPPORTED), which pyproject.toml's and the
README's lines are checked against (tests/invact/test_versions.py); ENVIRONMENTS name its ends.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".compat"
RESULTS = ROOT / "benchmarks" / "results"

# name -> (torch, transformers, why this pair): the range's ends, and the GPU images' stock pair.
ENVIRONMENTS = {
    "oldest": ("2.11.0", "4.57.6", "the oldest torch and the newest transformers 4.x"),
    "gpu-image": ("2.11.0", "5.17.0", "the GPU machines' stock image"),
    "newest": ("2.15.0", "5.25.0", "the newest torch and transformers on the registry"),
}
# What the rest of the tests need that the environment would not have (no triton: its interpreter's
# bf16 casts differ; numba: the CPU kernels, as users install them with invact[cpu]).
EXTRAS = ["pytest>=8", "numpy>=1.24", "numba>=0.60", "peft>=0.10"]
# The core: patch, plan, loss, norm, MLP, compile, the CLI, FSDP2 (its internals differ across torch).
CORE = [
    "tests/invact/test_patch.py",
    "tests/invact/test_patch_safety.py",
    "tests/invact/test_patch_errors.py",
    "tests/invact/test_patch_architectures.py",
    "tests/invact/test_plan_command.py",
    "tests/invact/test_plan_step.py",
    "tests/invact/test_cli_errors.py",
    "tests/invact/test_meta_outputs.py",
    "tests/invact/test_autocast_plan.py",
    "tests/invact/test_loss.py",
    "tests/invact/test_linear_cross_entropy.py",
    "tests/invact/test_logits_reads.py",
    "tests/invact/test_norm.py",
    "tests/invact/test_norm_patch.py",
    "tests/invact/test_mlp.py",
    "tests/invact/test_functional_mlp.py",
    "tests/invact/test_functional_norms.py",
    "tests/invact/test_gated.py",
    "tests/invact/test_experts.py",
    "tests/invact/test_memory_and_compile.py",
    "tests/invact/test_versions.py",
    "tests/invact/test_fsdp.py",
    "tests/invact/test_sharding.py",
]
SMOKE = [
    "tests/invact/test_versions.py",
    "tests/invact/test_cli_errors.py",
    "tests/invact/test_logits_reads.py",
]
PLAN = ["plan", "benchmarks/configs/llama-3.2-1b-shaped.json", "--fits", "24GiB", "--dtype", "bfloat16"]


def _venv(name: str, torch_version: str, transformers_version: str) -> Path:
    """The environment's python, created and installed on first use (torch first, alone)."""
    where = CACHE / name
    python = where / "bin" / "python"
    stamp = where / f".installed-{torch_version}-{transformers_version}"
    if not stamp.exists():
        print(
            f"[{name}] installing torch {torch_version}, transformers {transformers_version} into {where}",
            flush=True,
        )
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(where)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        # The environment's own pins rule: a machine-wide pip constraint file (one capping torch at the
        # release a machine keeps on disk) would otherwise refuse the range's newest end.
        unconstrained = dict(os.environ, PIP_CONSTRAINT=os.devnull)
        subprocess.run([*pip, f"torch=={torch_version}"], check=True, env=unconstrained)
        rest = [f"transformers=={transformers_version}", *EXTRAS]
        subprocess.run([*pip, *rest], check=True, env=unconstrained)
        stamp.touch()
    return python


def _counts(summary: str) -> dict[str, int]:
    """pytest's closing line ("3 failed, 120 passed, 2 skipped in 9.1s") as counts."""
    found = {k: 0 for k in ("passed", "failed", "skipped", "errors")}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary):
        found["errors" if word.startswith("error") else word] = int(n)
    return found


def run(name: str, files: list[str]) -> dict:
    torch_version, transformers_version, why = ENVIRONMENTS[name]
    python = _venv(name, torch_version, transformers_version)
    # INVACT_COMPAT: the tests of the committed table itself skip (it is being rewritten by this run)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", INVACT_COMPAT="1")
    present = [f for f in files if (ROOT / f).exists()]
    start = time.perf_counter()
    tests = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *present],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    lines = tests.stdout.strip().splitlines()
    failed = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED", "ERROR"))]
    plan = subprocess.run(
        [str(python), "-m", "invact", *PLAN], cwd=ROOT, env=env, capture_output=True, text=True
    )
    versions = subprocess.run(
        [str(python), "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"],
        capture_output=True,
        text=True,
    )
    row = {
        "name": name,
        "why": why,
        "versions": versions.stdout.strip(),
        "files": len(present),
        **_counts(lines[-1] if lines else ""),
        "seconds": round(seconds, 1),
        "failures": failed,
        "plan_fits": plan.returncode == 0,
        "plan_says": (plan.stdout.strip().splitlines() or plan.stderr.strip().splitlines() or [""])[-1],
    }
    print(
        f"[{name}] {row['versions']}: {row['passed']} passed, {row['failed']} failed, {row['errors']} errors,"
        f" {row['skipped']} skipped in {seconds:.0f} s;",
        f"plan --fits: {'runs' if row['plan_fits'] else 'FAILS'}",
        flush=True,
    )
    for line in failed:
        print("   ", line)
    return row


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    """The checkout's commit, "+changes" where tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return head.stdout.strip() + ("+changes" if dirty else "")


def _markdown(rows: list[dict], smoke: bool) -> str:
    head = [
        f"## The core tests at the supported range's ends ({'smoke' if smoke else 'core'} set)",
        "",
        f'`python tests/compat.py{" --smoke" if smoke else ""}`, `-m "not slow"`, '
        "each environment's latest run:",
        "",
        "| environment | torch, transformers | passed | failed | errors | skipped | `plan --fits 24GiB` "
        "| machine, date, commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    body = [
        f"| {r['name']} ({r['why']}) | {r['versions']} | {r['passed']} | {r['failed']} | {r['errors']} | "
        f"{r['skipped']} | {'runs' if r['plan_fits'] else 'fails'} | "
        f"{r['machine']}, {r['date']}, {r['commit']} |"
        for r in rows
    ]
    return "\n".join(head + body) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=sorted(ENVIRONMENTS), help="run these environments only")
    parser.add_argument("--smoke", action="store_true", help="the few SMOKE tests instead of the CORE files")
    args = parser.parse_args(argv)
    names = args.only or list(ENVIRONMENTS)
    machine, when = _cpu(), datetime.date.today().isoformat()
    stem = RESULTS / f"compat_cpu{'_smoke' if args.smoke else ''}"
    # One row per environment, each with its machine and date: --only replaces its environments' rows and
    # keeps the others' (each environment's run takes minutes; the table is their latest runs).
    rows = {}
    if stem.with_suffix(".json").exists():
        rows = {r["name"]: r for r in json.loads(stem.with_suffix(".json").read_text())["rows"]}
    for name in names:
        rows[name] = {**run(name, SMOKE if args.smoke else CORE), "machine": machine, "date": when,
                      "commit": _commit()}  # fmt: skip
        ordered = [rows[n] for n in ENVIRONMENTS if n in rows]
        RESULTS.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps({"rows": ordered}, indent=1) + "\n")
        stem.with_suffix(".md").write_text(_markdown(ordered, args.smoke))
    print(_markdown(ordered, args.smoke))
    return (
        0 if all(rows[n]["failed"] == rows[n]["errors"] == 0 and rows[n]["plan_fits"] for n in names) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
