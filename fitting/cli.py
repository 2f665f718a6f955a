"""`invact-fit`: fit a formula family for an activation, report its errors, write the coefficient JSON.

Exit status: 0 on success, 2 for bad arguments or unusable inputs (unknown activation or family, an
unreadable or invalid --init file, an output path that cannot be written), 1 if the fit itself fails,
130 on Ctrl-C. Errors are one line on stderr. Files are written atomically, only after the fit
succeeded, so an interrupted or failed run leaves no partial file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from codegen.coeffs_json import CoeffsError, load, save
from fitting.activations import ACTIVATIONS, UnknownActivation, get_activation
from fitting.families import FAMILIES, UnknownFamily, get_family, require_two_branches
from fitting.pipeline import FamilyFit, fit_family
from fitting.search import BACKENDS

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


class UsageError(Exception):
    """Bad input: reported in one line, exit status 2."""


def default_coeffs_dir() -> Path:
    """coeffs/ of the source checkout when running from one, else ./coeffs."""
    if (_PACKAGE_ROOT / "pyproject.toml").exists() and (_PACKAGE_ROOT / "coeffs").is_dir():
        return _PACKAGE_ROOT / "coeffs"
    return Path.cwd() / "coeffs"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="invact-fit",
        description=(
            "Fit q(y) ~ f'(f^-1(y)) on each monotone branch of an activation, print the errors of the "
            "start (published) coefficients next to the least-squares and minimax refits, and write "
            "the best (smallest linf_fp32) as coefficient JSON (schema invact-coeffs/1)."
        ),
        epilog=(
            f"activations: {', '.join(sorted(ACTIVATIONS))} (quick_gelu is silu rescaled: it reuses "
            "silu's fit). Monotone, with one branch and no bit (fit them with --family exact): "
            f"{', '.join(sorted(a for a, act in ACTIVATIONS.items() if act.monotone))}. "
            f"families: {', '.join(sorted(FAMILIES))}, and search (symbolic regression; "
            "see --search-backend). "
            "Example: invact-fit gelu --family paper --plot gelu.png"
        ),
    )
    parser.add_argument("activation", help="activation to fit (see the list below)")
    parser.add_argument("--family", required=True, help="formula family (see the list below)")
    parser.add_argument(
        "--out", type=Path, help="where to write the JSON (default: coeffs/<activation>/<family>.json)"
    )
    parser.add_argument("--plot", type=Path, metavar="PNG", help="also write the paper's Fig. 2 analogue")
    parser.add_argument(
        "--init",
        type=Path,
        metavar="JSON",
        help="start from the coefficients of an existing coefficient file",
    )
    parser.add_argument(
        "--search-backend", choices=BACKENDS, default="operon",
        help="with --family search: operon (embedded) or pysr (needs Julia)",
    )  # fmt: skip
    parser.add_argument(
        "--budget", type=int, default=100, help="with --family search: generations (default 100)"
    )
    parser.add_argument("--seed", type=int, default=0, help="with --family search: random seed (default 0)")
    parser.add_argument(
        "--max-flops", type=int, help="with --family search: most flops per branch (default: the paper's)"
    )
    parser.add_argument(
        "--codegen",
        action="store_true",
        help="then regenerate invact/_generated/ (python -m codegen) from coeffs/defaults.json's families",
    )
    return parser


@contextlib.contextmanager
def _progress(console: Console) -> Iterator[Callable[[str], None]]:
    """A transient spinner with elapsed time; yields say(message) to update its text."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda message: bar.update(task, description=message)


def _check_writable(path: Path, what: str) -> None:
    """Fail before a long fit, not after it: the folder must exist and accept a new file."""
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory")
    folder = path.parent
    probe_from = folder
    while not probe_from.exists():
        probe_from = probe_from.parent
    if not probe_from.is_dir():
        raise UsageError(f"cannot write {what} {path}: {probe_from} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=probe_from, prefix=".invact-fit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"cannot write {what} {path}: {e.strerror or e}") from None


def _start_from(init: Path, activation: str, family: str) -> dict[str, dict[str, float]]:
    coeffs = load(init)
    if (coeffs.activation, coeffs.family) != (activation, family):
        raise UsageError(f"{init}: holds {coeffs.activation}/{coeffs.family}, not {activation}/{family}")
    expected = get_family(family, activation)
    for name, branch in coeffs.branches.items():
        if list(branch.coefficients) != list(expected.branches[name].start):
            raise UsageError(f"{init}: branches.{name}.coefficients: names differ from the family's")
    return {name: dict(b.coefficients) for name, b in coeffs.branches.items()}


def run(args: argparse.Namespace, console: Console) -> int:
    if args.family == "search":
        return run_search(args, console)
    try:
        get_activation(args.activation)
        get_family(args.family, args.activation)
    except (UnknownActivation, UnknownFamily) as e:
        raise UsageError(str(e)) from None
    out = args.out or default_coeffs_dir() / args.activation / f"{args.family}.json"
    _check_writable(out, "output")
    if args.plot:
        _check_writable(args.plot, "plot")
    start = None
    if args.init:
        try:
            start = _start_from(args.init, args.activation, args.family)
        except CoeffsError as e:
            raise UsageError(str(e)) from None

    command = f"invact-fit {args.activation} --family {args.family}"
    if args.init:
        command += f" --init {args.init}"
    with _progress(console) as say:
        fit: FamilyFit = fit_family(args.activation, args.family, start=start, progress=say)

    from fitting.report import print_report  # rich tables; imported late to keep --help fast

    out.parent.mkdir(parents=True, exist_ok=True)
    save(fit.coeff_file(command), out)
    print_report(fit, str(out), Console(width=None if sys.stdout.isatty() else 120))
    if args.plot:
        from fitting.plot import save_figure

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fit, args.plot)
        print(f"plot written to {args.plot}")
    if args.codegen:
        from codegen.__main__ import main as regenerate

        return regenerate([])
    return 0


def run_search(args: argparse.Namespace, console: Console) -> int:
    """--family search: symbolic search per branch, refined by this toolkit; writes the chosen
    formula (coefficient JSON) and the Pareto front (<out stem>_front.json)."""
    from fitting.search import SearchSettings, SearchUnavailable
    from fitting.search import front as search_front

    try:
        act = get_activation(args.activation)
        require_two_branches("search", act)
    except (UnknownActivation, UnknownFamily) as e:
        raise UsageError(str(e)) from None
    if act.derivation:
        raise UsageError(
            f"search {act.name}'s base instead: invact-fit {act.derivation.base} --family search"
        )
    if args.budget < 1:
        raise UsageError("--budget must be at least 1 generation")
    if args.search_backend == "pysr":
        from fitting.search.pysr import check_available

        try:
            check_available()
        except SearchUnavailable as e:
            raise UsageError(str(e)) from None
    out = args.out or default_coeffs_dir() / args.activation / "search.json"
    front_path = out.with_name(f"{out.stem}_front.json")
    for path, what in ((out, "output"), (front_path, "front")):
        _check_writable(path, what)
    settings = SearchSettings(backend=args.search_backend, generations=args.budget, seed=args.seed)
    limits = (
        search_front.paper_flops(act)
        if args.max_flops is None
        else dict.fromkeys(act.branches, args.max_flops)
    )
    with _progress(console) as say:
        fronts = {b: search_front.search_branch(act, b, settings, say) for b in act.branches}
    if not all(fronts.values()):
        raise RuntimeError("the search found no candidate with a finite error on some branch; raise --budget")
    chosen = {b: search_front.choose(f, (limits or {}).get(b)) for b, f in fronts.items()}
    command = f"invact-fit {act.name} --family search --search-backend {args.search_backend}"
    command += f" --budget {args.budget} --seed {args.seed}"
    out.parent.mkdir(parents=True, exist_ok=True)
    save(search_front.coeff_file(act, chosen, command, settings), out)
    search_front.write_front(front_path, act, fronts, settings)
    from fitting.search.report import print_fronts

    print_fronts(act.name, fronts, chosen, limits, Console(width=None if sys.stdout.isatty() else 140))
    print(f"written: {out} (chosen per branch), {front_path} (Pareto fronts)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        return run(args, console)
    except UsageError as e:
        print(f"invact-fit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("invact-fit: interrupted; nothing was written", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, ValueError) as e:
        print(f"invact-fit: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
