"""The wheel as a user gets it: built from the repository, it installs one top-level name, and in a
fresh virtual environment outside any checkout the runtime trains with torch alone, and with the
[fit] extra invact-fit fits an activation of the user's own, whose module load_activation trains.

Slow (a venv and its packages from the local pip cache: about two minutes here); CI runs it.
"""

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the build reads; everything else (venvs, caches, build output) stays behind.
_LEFT_BEHIND = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache"
)

# A Linear-act-Linear block trains 20 SGD steps: with torch's GELU patched by invact, or (argv[1]) with
# the module class of an emitted activation.
TRAIN = """
import sys, torch, invact
torch.manual_seed(0)
if len(sys.argv) > 1:
    act = invact.load_activation(sys.argv[1])()
else:
    act = torch.nn.GELU()
model = torch.nn.Sequential(torch.nn.Linear(8, 32), act, torch.nn.Linear(32, 1))
if len(sys.argv) == 1:
    assert invact.patch(model) == ["1"], "the GELU is replaced"
x, target = torch.randn(64, 8), torch.randn(64, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
losses = []
for _ in range(20):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), target)
    loss.backward()
    opt.step()
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
print("trained", type(model[1]).__name__, invact.__file__)
"""


def _run(args: list, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    run = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{args}: exit {run.returncode}\n{run.stdout[-2000:]}{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the repository (the checkout itself is not written to)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=_LEFT_BEHIND)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp]
    _run([*build, source], tmp)
    (built,) = tmp.glob("invact-*.whl")
    return built


def test_the_wheel_installs_only_invact_names(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names}
    assert top and all(t.startswith("invact") for t in top), sorted(top)
    # the toolkit's data: the spec and every committed coefficient file
    shipped = {n.removeprefix("invact/_toolkit/") for n in names if n.startswith("invact/_toolkit/coeffs/")}
    committed = {p.relative_to(ROOT).as_posix() for p in (ROOT / "coeffs").rglob("*.json")}
    assert shipped == committed


@pytest.mark.slow
def test_a_fresh_venv_trains_then_fits_an_activation_of_its_own(wheel, tmp_path):
    import torch

    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python, bin_dir = env / "bin" / "python", env / "bin"
    pip = [python, "-m", "pip", "install", "-q"]
    # torch first, as the README says (the same version as the tests'), then the wheel alone
    _run([*pip, f"torch=={torch.__version__.split('+')[0]}", wheel], tmp_path)
    work = tmp_path / "user"  # outside any checkout
    work.mkdir()
    trained = _run([python, "-c", TRAIN], work).stdout
    assert str(env) in trained  # the installed package, not the checkout
    _run([*pip, f"{wheel}[fit]"], tmp_path)
    assert "usage: invact-fit" in _run([bin_dir / "invact-fit", "--help"], work).stdout
    fit = ["swish_squared", "--expr", "x*sigmoid(x)**2", "--family", "floor"]
    _run([bin_dir / "invact-fit", *fit, "--emit", "swish_squared_invact.py"], work)
    assert (work / "swish_squared.json").is_file()  # --out defaults to the current folder
    assert "trained" in _run([python, "-c", TRAIN, work / "swish_squared_invact.py"], work).stdout
    codegen = _run_failing([bin_dir / "invact-fit", "gelu", "--family", "paper", "--codegen"], work)
    assert codegen.returncode == 2 and "source checkout" in codegen.stderr
    assert len(codegen.stderr.splitlines()) == 1


def _run_failing(args: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=300)
