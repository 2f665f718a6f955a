"""The runtime imports with torch alone: no fitting toolkit, no scipy or sympy."""

import subprocess
import sys
from pathlib import Path

import pytest

from invact.activation.activations import ACTIVATIONS

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = ("fitting", "codegen", "scipy", "sympy", "matplotlib", "rich")


def test_runtime_import_pulls_in_no_fitting_dependency():
    code = (
        "import sys, invact\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print(invact.__version__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_the_hand_written_runtime_names_no_activation(name):
    # Every per-activation view is printed from the spec into invact/_generated/; the runtime's own
    # modules take an activation by name and so work unchanged for a new one.
    hand_written = sorted(p for p in (ROOT / "invact").rglob("*.py") if "_generated" not in p.parts)
    assert hand_written and not [p.name for p in hand_written if name in p.read_text().lower()]


def _imports(path: Path) -> set[str]:
    """The invact modules `path` imports, at its top or inside a function: `from invact import m` names
    the module invact.m where that is a module, else the package."""
    import ast

    def is_module(dotted: str) -> bool:
        p = ROOT.joinpath(*dotted.split("."))
        return p.with_suffix(".py").exists() or (p / "__init__.py").exists()

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "invact":
            found |= {f"{node.module}.{a.name}" if is_module(f"{node.module}.{a.name}") else node.module
                      for a in node.names}  # fmt: skip
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "invact"}
    return found


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in (ROOT / "invact").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = _imports(path) - {name}
    return graph


def test_no_import_circle():
    """No invact module reaches itself through the imports of others, deferred imports included: each
    module can be read (and loaded) after the ones it needs."""
    graph = _import_graph()
    assert "invact.activation.activations" in graph["invact.activation.ops"]  # the graph is read
    done, active, circles = set(), [], []

    def visit(name: str) -> None:
        active.append(name)
        for dep in sorted(graph.get(name, ())):
            if dep in active:
                circles.append(" -> ".join(active[active.index(dep) :] + [dep]))
            elif dep not in done:
                visit(dep)
        active.pop()
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name)
    assert not circles, circles


def test_imports_run_one_way_cli_planner_runtime():
    """The command imports the planner, the planner the runtime's op kinds; never back: no module outside
    invact.planner but the command's (invact.cli, invact.__main__) imports it, and no room of the planner
    imports the command."""
    graph = _import_graph()
    planner = {name for name in graph if name == "invact.planner" or name.startswith("invact.planner.")}
    assert {"invact.planner.forward", "invact.planner.step"} <= planner  # the graph is read
    command = {"invact.cli", "invact.__main__"}
    back = sorted(
        f"{name} -> {dep}" for name in set(graph) - planner - command for dep in graph[name] & planner
    )
    assert not back, back
    assert not [name for name in planner if graph[name] & command]
