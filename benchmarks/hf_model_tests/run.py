"""Run Hugging Face transformers' own model tests plain and with invact.patch() on every model built.

For each model, pytest runs tests/models/<m>/test_modeling_<m>.py of a transformers test tree twice:
plain, then with INVACT_PATCH=1, where the plugin next to this file (benchmarks.hf_model_tests.plugin,
loaded in both runs) patches every PreTrainedModel the tests build. Slow, FSDP, tensor-parallel and
expert-parallel tests are deselected. The two runs' per-test outcomes (pytest's junit XML) are
compared: `new_failures` fail or error patched and pass plain, `fixed` the reverse.

    python benchmarks/hf_model_tests/run.py --tree /path/to/transformers-tests [--models llama,gpt2]

The tree is a transformers checkout's test layout (conftest.py, tests/, a PROVENANCE.json if any is
recorded in the results) matching the installed transformers. Writes --out (JSON) and the markdown
table beside it (.md, which docs/results/hf-model-tests.md includes) and prints the table; pytest's
logs and XML stay in --logs.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "gpt2", "gpt_neox", "bert"]
MARKERS = "not slow and not is_fsdp_test and not is_tensor_parallel_test and not is_expert_parallel_test"
KEYWORDS = "not fsdp and not tensor_parallel and not expert_parallel"
RANK = {"skipped": 0, "passed": 1, "failed": 2, "errors": 3}  # a test reported twice keeps its worst
BAD = ("failed", "errors")
PLUGIN = "benchmarks.hf_model_tests.plugin"
VERSIONS = (
    "import torch, transformers as t, pytest as p; print(torch.__version__, t.__version__, p.__version__)"
)


def first_line(text: str | None) -> str:
    """The error's first line, and the next one where the first ends in ':' (what it is about)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()] + [""]
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") else lines[0]


def outcomes(xml_path: Path) -> dict[str, tuple[str, str]]:
    """test id (Class::test) -> (passed | failed | errors | skipped, first line of the error)."""
    tests: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        kind, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed" if child.tag == "failure" else "errors"
                message = first_line(child.get("message") or child.text)
                break
            if child.tag == "skipped":
                kind = "skipped"
        if test_id not in tests or RANK[kind] > RANK[tests[test_id][0]]:
            tests[test_id] = (kind, message)
    return tests


def run_pytest(args, model: str, patched: bool, logs: Path) -> tuple[dict, dict]:
    name = f"{model}_{'patched' if patched else 'plain'}"
    xml, log = logs / f"{name}.xml", logs / f"{name}.log"
    test_file = Path("tests", "models", model, f"test_modeling_{model}.py")
    cmd = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider", "-p", PLUGIN]
    cmd += ["-m", MARKERS, "-k", KEYWORDS, f"--junitxml={xml}"]
    if args.jobs > 1:
        cmd += ["-n", str(args.jobs)]
    paths = dict.fromkeys([str(args.invact), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), HF_HUB_OFFLINE="1")
    env["OMP_NUM_THREADS"] = str(args.threads)
    env.pop("INVACT_PATCH", None)
    if patched:
        env["INVACT_PATCH"] = "1"
    xml.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            code = subprocess.run(
                cmd, cwd=args.tree, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    counts = {"seconds": round(time.monotonic() - start, 1), "exit_code": code}
    if not xml.exists():
        return {**counts, "error": f"no junit XML; see {log}"}, {}
    tests = outcomes(xml)
    for kind in RANK:
        counts[kind] = sum(1 for k, _ in tests.values() if k == kind)
    return counts, tests


def command_output(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.rstrip()
    except OSError:
        return ""


def source_hash(folder: Path) -> str:
    """One sha256 over invact's .py files (names and contents): which code a run imported."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def machine(args) -> dict:
    lscpu = dict(line.split(":", 1) for line in command_output(["lscpu"]).splitlines() if ":" in line)
    versions = command_output([sys.executable, "-c", VERSIONS]).split() + ["?"] * 3
    git = ["git", "-C", str(args.invact)]
    provenance = args.tree / "PROVENANCE.json"
    return {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": lscpu.get("Model name", "").strip(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": versions[0],
        "transformers": versions[1],
        "pytest": versions[2],
        "jobs": args.jobs,
        "threads_per_job": args.threads,
        "markers": MARKERS,
        "keywords": KEYWORDS,
        "invact": {
            "path": str(args.invact),
            "commit": command_output([*git, "rev-parse", "HEAD"]),
            "uncommitted": command_output([*git, "status", "--porcelain", "--", "invact"]).splitlines(),
            "sha256": source_hash(args.invact / "invact"),
        },
        "tree": {
            "path": str(args.tree),
            "provenance": json.loads(provenance.read_text()) if provenance.exists() else None,
        },
    }


def compare(plain: dict, patched: dict) -> tuple[list, list]:
    new = [
        {"test": t, "error": msg}
        for t, (kind, msg) in sorted(patched.items())
        if kind in BAD and plain.get(t, ("",))[0] == "passed"
    ]
    fixed = [t for t, (k, _) in sorted(patched.items()) if k == "passed" and plain.get(t, ("",))[0] in BAD]
    return new, fixed


def table(results: dict) -> str:
    def cell(c):
        return f"{c.get('passed', '-')}/{c.get('failed', '-')}/{c.get('skipped', '-')}/{c.get('errors', '-')}"

    lines = [
        "| model | plain pass/fail/skip/err | patched pass/fail/skip/err | new failures | fixed "
        "| plain s | patched s |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, r in results.items():
        lines.append(
            f"| {model} | {cell(r['plain'])} | {cell(r['patched'])} | {len(r['new_failures'])} "
            f"| {len(r['fixed'])} | {r['plain']['seconds']} | {r['patched']['seconds']} |"
        )
    causes = defaultdict(list)
    for model, r in results.items():
        for failure in r["new_failures"]:
            causes[failure["error"][:160]].append(f"{model}: {failure['test']}")
    if causes:
        lines += ["", "New failures by error (count, error, one test):", ""]
        for error, tests in sorted(causes.items(), key=lambda item: -len(item[1])):
            lines.append(f"- {len(tests)} x `{error}` e.g. {tests[0]}")
    return "\n".join(lines)


def write_atomically(path: Path, text: str) -> None:
    """`text` to `path` through a temporary file renamed over it: a run that dies while writing leaves
    the previous file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree", type=Path, required=True, help="transformers test tree (holds tests/models)"
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: %(default)s)")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks/results/hf_model_tests_cpu.json",
        help="JSON path (default %(default)s; the markdown table beside it)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="pytest-xdist workers; 1 runs without xdist")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each pytest process")
    parser.add_argument(
        "--invact",
        type=Path,
        default=REPO,
        help="directory whose invact/ is imported (first on PYTHONPATH; default the repo)",
    )
    parser.add_argument("--logs", type=Path, help="where pytest's logs and XML go (default: a temp dir)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per pytest run")
    args = parser.parse_args()
    args.tree, args.invact = args.tree.resolve(), args.invact.resolve()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="hf_model_tests_"))
    logs.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(args), "logs": str(logs), "models": {}}
    for model in args.models.split(","):
        runs = {}
        for patched in (False, True):
            label = "patched" if patched else "plain"
            print(f"[{model}] {label} ...", file=sys.stderr, flush=True)
            runs[label] = run_pytest(args, model, patched, logs)
            print(f"[{model}] {label}: {runs[label][0]}", file=sys.stderr, flush=True)
        new, fixed = compare(runs["plain"][1], runs["patched"][1])
        report["models"][model] = {
            "plain": runs["plain"][0],
            "patched": runs["patched"][0],
            "new_failures": new,
            "fixed": fixed,
        }
        # written after each model: an interrupted run keeps the models it finished
        write_atomically(args.out, json.dumps(report, indent=2) + "\n")
        write_atomically(args.out.with_suffix(".md"), table(report["models"]) + "\n")
    print(table(report["models"]))
    print(f"\nwrote {args.out}; logs in {logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
