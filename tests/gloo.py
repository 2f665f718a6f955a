"""Several processes of one gloo job on this machine, as torchrun would start them: `launch` starts a
command once per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1
and a free MASTER_PORT; one thread each; gloo on the loopback device), each rank's output in
FOLDER/rank<r>.log, and waits for all of them, killing those still running at the deadline. Used by
the distributed tests (tests/invact/test_training_stacks.py, test_fsdp.py) and
benchmarks/fsdp_peaks.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], ranks: int, folder: Path, wait_s: float, env: dict | None = None) -> list[int]:
    """Run `command` (argv, from the repository's root, which is on PYTHONPATH) as `ranks` ranks; their
    exit codes once all have ended (-9: killed at `wait_s` seconds, -N: ended by signal N). `env`: more
    variables for every rank."""
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(ranks),
        "OMP_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    if sys.platform.startswith("linux"):
        base.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on the loopback device, not the host's address
    procs = []
    for rank in range(ranks):
        log = open(folder / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(
            (subprocess.Popen(command, cwd=REPO, env=rank_env, stdout=log, stderr=subprocess.STDOUT), log)
        )
    deadline = time.monotonic() + wait_s
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            log.close()
    return [proc.returncode for proc, _ in procs]


def log_tails(folder: Path, ranks: int, chars: int = 3000) -> str:
    """The end of each rank's log, for a failure's message."""
    return "\n".join(f"rank {r}:\n{(folder / f'rank{r}.log').read_text()[-chars:]}" for r in range(ranks))


def run_cases(cases, run_case, out_dir: str, timeout_s: float) -> None:
    """A worker's whole life: join the gloo group (each collective bounded by `timeout_s`), then for each
    case save run_case(case, rank) (or {"error": traceback}) to OUT_DIR/<case>_rank<r>.pt, a barrier
    after each, and exit. Past the last barrier every rank's results are on disk: it exits without
    tearing down the process group or the interpreter (in two CI runs a rank aborted there, "terminate
    called without an active exception", from torch's gloo threads)."""
    import datetime
    import traceback

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    for case in cases:
        try:
            result = run_case(case, rank)
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, Path(out_dir) / f"{case}_rank{rank}.pt")
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)
