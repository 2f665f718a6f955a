"""A user-defined activation, made up here (not a built-in), from `invact-fit NAME --expr` to a
training step through invact.load_activation: no file of the package changes on the way."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import invact
from codegen import spec
from codegen.emitted import EMITTED_FORMAT
from fitting import activations as fitting_activations
from fitting import cli
from invact import loader
from invact.activation.activations import ACTIVATIONS
from tests.invact.test_functional import FP32_Q_ROUNDING, _fp32_bound

NAME = "swish_squared"
EXPR = "x*sigmoid(x)**2"  # decreasing then increasing, f -> 0 on the left, slope -> 1 on the right
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    """The --emit module's path, written by the CLI (in this process, as a user would run it)."""
    folder = tmp_path_factory.mktemp("user")
    args = [NAME, "--expr", EXPR, "--family", "floor", "--out", str(folder / f"{NAME}.json")]
    assert cli.main([*args, "--emit", str(folder / f"{NAME}_invact.py")]) == 0
    yield folder / f"{NAME}_invact.py"
    fitting_activations.ACTIVATIONS.pop(NAME, None)


@pytest.fixture(scope="module")
def act_class(emitted):
    cls = invact.load_activation(emitted)
    yield cls
    ACTIVATIONS.pop(NAME, None)  # this process's registry, as before the test
    loader._LOADED.clear()


def test_the_activation_is_made_up():
    assert NAME not in spec.load() and NAME not in ACTIVATIONS


def test_loader_reads_the_format_codegen_prints():
    assert loader.EMITTED_FORMAT == EMITTED_FORMAT


def test_the_fit_reaches_the_floor_familys_goal(act_class):
    from fitting.families.floor import GOAL

    errors = ACTIVATIONS[NAME].generated.ERRORS
    assert max(e["linf_fp32"] for e in errors.values()) <= GOAL


def test_loading_again_returns_the_same_class(act_class, emitted):
    assert invact.load_activation(emitted) is act_class
    assert act_class.__name__ == "InvActSwishSquared"


def _gradient_error(m: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """|dx/dy - f'(x)| per element, f' in float64 from the emitted module, net of q's fp32 rounding."""
    x = x.detach().requires_grad_()
    m(x).backward(dy)
    q = x.grad.double() / dy.double()
    df = ACTIVATIONS[NAME].df(x.detach().double())
    return (q - df).abs() - FP32_Q_ROUNDING * df.abs().clamp_min(1)


@pytest.mark.parametrize("mode", ["bits", "precision_bit"])
def test_training_step_gradient_within_the_fitted_error(act_class, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), act_class(mode), nn.Linear(256, 1))
    seen = {}
    model[1].register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0]))
    model[1].register_full_backward_hook(lambda mod, gin, gout: seen.update(dx=gin[0], dy=gout[0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, target = torch.randn(64, 16) * 3, torch.randn(64, 1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.mse_loss(model(inputs), target)
    loss.backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    x, dx, dy = seen["x"].detach(), seen["dx"], seen["dy"]
    df = ACTIVATIONS[NAME].df(x.double())
    used = dy != 0
    err = (dx.double() / dy.double() - df).abs() - FP32_Q_ROUNDING * df.abs().clamp_min(1)
    # The recorded fit error (linf_fp32, per branch) plus what storing y in fp32 costs near the cusp.
    assert err[used].max().item() <= _fp32_bound(NAME)


def test_gradient_bound_over_many_inputs(act_class):
    torch.manual_seed(1)
    x, dy = torch.randn(2**16) * 4, torch.randn(2**16)
    assert _gradient_error(act_class(), x, dy).max().item() <= _fp32_bound(NAME)


def test_loads_and_trains_without_numba(act_class, emitted, tmp_path):
    """torch and the toolkit but no numba: the module loads without its numba view, and invact's
    portable CPU backward gives gradients within the same bound."""
    out = tmp_path / "gradient.pt"
    child = f"""
import sys
sys.modules["numba"] = None  # `import numba` raises ImportError from here on
import torch, invact
cls = invact.load_activation({str(emitted)!r})
module = sys.modules[cls.__module__]
assert module.numba is None and not hasattr(module, "q_right_scalar")
torch.manual_seed(1)
x, dy = (torch.randn(2**12) * 4).requires_grad_(), torch.randn(2**12)
cls()(x).backward(dy)
torch.save((x.detach(), dy, x.grad), {str(out)!r})
"""
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    x, dy, dx = torch.load(out)
    df = ACTIVATIONS[NAME].df(x.double())
    err = (dx.double() / dy.double() - df).abs() - FP32_Q_ROUNDING * df.abs().clamp_min(1)
    assert err.max().item() <= _fp32_bound(NAME)


def test_gradcheck_float64(act_class):
    x = (torch.randn(40, dtype=torch.float64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(act_class(), (x,))


def test_compile_fullgraph(act_class, portable):
    torch.manual_seed(2)
    m = act_class()
    x, dy = torch.randn(1000), torch.randn(1000)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_()
    compiled(xc).backward(dy)
    xe = x.clone().requires_grad_()
    m(xe).backward(dy)
    assert torch.equal(xc.grad, xe.grad)


def test_triton_backend(act_class, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("INVACT_BACKEND", "triton")  # on CPU tensors: under the interpreter (conftest)
    torch.manual_seed(3)
    x, dy = (torch.randn(3000) * 4).to(DEVICE), torch.randn(3000).to(DEVICE)
    err = _gradient_error(act_class(), x, dy)
    # Triton's fp32 forward is not torch's bitwise: y differs by a few ulps, which the storage term of
    # the bound covers as it does for the built-ins (tests/invact/test_triton.py).
    assert err.max().item() <= _fp32_bound(NAME)


def test_the_generic_module_and_function_serve_it(act_class):
    x = torch.randn(100)
    assert torch.equal(invact.InvAct(NAME)(x), act_class()(x))
    assert torch.equal(invact.functional.invact(x, NAME), act_class()(x))


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("x**3 - 3*x", "changes sign 2 times"),
        ("-x", "decreasing"),
        ("__import__('os')", "not allowed"),
        ("x.real", "not allowed"),
        ("2*x*sigmoid(x)", "slope tends to 1"),
    ],
)
def test_unusable_expressions_are_one_line_errors(expr, message, tmp_path, capsys):
    name = "made_up_" + str(abs(hash(expr)) % 10**6)
    try:
        rc = cli.main([name, f"--expr={expr}", "--family", "floor", "--out", str(tmp_path / "c.json")])
    finally:
        fitting_activations.ACTIVATIONS.pop(name, None)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "c.json").exists()


def test_a_built_in_name_is_refused(capsys):
    assert cli.main(["gelu", "--expr", "x*Phi(x)", "--family", "floor"]) == 2
    assert "built-in" in capsys.readouterr().err


def test_loading_a_file_that_is_not_emitted(tmp_path):
    path = tmp_path / "other.py"
    path.write_text("X = 1\n")
    with pytest.raises(ValueError, match="not a module printed by invact-fit --emit"):
        invact.load_activation(path)


def test_a_file_whose_cpu_kernels_do_not_import_loads_with_a_warning(emitted, tmp_path):
    """A file emitted by an older invact-fit names modules this invact has moved (invact._cpu_math before
    the package-per-kind layout): its numba view's import fails inside the file, which still loads on
    the portable CPU path; with numba installed the loader says so instead of running slower silently."""
    pytest.importorskip("numba")
    import re

    text = emitted.read_text().replace("invact.activation._cpu_math", "invact._cpu_math")
    text = re.sub(r"ACTIVATION = ['\"]swish_squared['\"]", "ACTIVATION = 'swish_squared_old'", text)
    old = tmp_path / "swish_squared_old_invact.py"
    old.write_text(text)
    try:
        with pytest.warns(UserWarning, match="its CPU kernels did not import") as caught:
            loaded_at = sys._getframe().f_lineno + 1
            cls = invact.load_activation(old)
        (warned,) = caught
        assert (warned.filename, warned.lineno) == (__file__, loaded_at)  # at the user's line
        assert ACTIVATIONS["swish_squared_old"].emitted.numba is None
        x = torch.randn(64, requires_grad=True)
        cls()(x).sum().backward()  # the portable path still trains
        assert x.grad is not None and torch.isfinite(x.grad).all()
    finally:
        ACTIVATIONS.pop("swish_squared_old", None)
        loader._LOADED.clear()
