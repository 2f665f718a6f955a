"""`invact-fit`: fit a formula family for an activation, report its errors, write the coefficient JSON.

Exit status: 0 on success, 2 for bad arguments or unusable inputs (unknown activation or family, an
unreadable or invalid --init file, an output path that cannot be written), 1 if the fit itself fails,
130 on Ctrl-C. Errors are one line on stderr. Every option is checked before any work (an output
folder that cannot be written, a --plot suffix matplotlib cannot write, an --init file). Files are
written atomically and only after everything that can fail has succeeded (the fit, then the JSON, the
plot and, with --codegen, the regenerated modules, all rendered in memory), so a failed run changes
neither coeffs/ nor invact/_generated/.
"""

from __future__ import annotations

# Only the standard library at import time: everything else is imported inside main(), so a Ctrl-C
# while numpy, sympy, scipy or matplotlib load is caught there and reported in one line (exit 130).
import argparse
import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from rich.console import Console

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# pyoperon's GeneticAlgorithmConfig takes the seed as an unsigned 64-bit integer: 2**64 and -1 fail
# inside it with a long traceback, so the CLI refuses them first.
MAX_SEED = 2**64 - 1


class UsageError(Exception):
    """Bad input: reported in one line, exit status 2."""


def in_checkout() -> bool:
    """Running from a source checkout (pyproject.toml beside fitting/), not from an installed wheel,
    whose toolkit lives in invact/_toolkit/ (see invact.fit_cli)."""
    return (_PACKAGE_ROOT / "pyproject.toml").exists() and (_PACKAGE_ROOT / "coeffs").is_dir()


def default_coeffs_dir() -> Path:
    """Where a fit is written without --out: coeffs/ of the source checkout when running from one (which
    codegen reads), else the current folder (an installed package's files are not the user's to change)."""
    return _PACKAGE_ROOT / "coeffs" if in_checkout() else Path.cwd()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other invact-fit error (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    from fitting.activations import ACTIVATIONS
    from fitting.families import SEARCH, family_names
    from fitting.search import BACKENDS

    parser = _Parser(
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
            f"families: {', '.join(family_names())} ({SEARCH}: symbolic regression; "
            "see --search-backend). "
            "Examples: invact-fit gelu --family paper --plot gelu.png; your own activation: "
            "invact-fit swish2 --expr 'x*sigmoid(x)**2' --family floor --out swish2.json "
            "--emit swish2_invact.py"
        ),
    )
    parser.add_argument(
        "activation", help="activation to fit (see the list below), or the name of yours with --expr"
    )
    parser.add_argument(
        "--expr",
        metavar="EXPR",
        help="your own activation f(x), in x: +, -, *, /, **, numbers, pi and sqrt, exp, expm1, log, log1p, "
        "erf, erfc, tanh, Phi, sigmoid, softplus, Abs, Max, Min, Piecewise (parsed, never evaluated). "
        "f must be increasing, or decreasing then increasing (one minimum) on [-20, 20]. Write "
        "--expr='-x...' where it starts with a minus",
    )
    parser.add_argument(
        "--emit",
        type=Path,
        metavar="PY",
        help="with --expr: also write a self-contained runtime module; in training, "
        "invact.load_activation(PY) returns its module class",
    )
    parser.add_argument("--family", required=True, help="formula family (see the list below)")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write the JSON (default: coeffs/<activation>/<family>.json of the checkout, or "
        "<activation>/<family>.json in the current folder outside one; with --expr <activation>.json in "
        "the current folder)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="also write the paper's Fig. 2 analogue (format from the suffix: .png, .pdf, .svg, ...)",
    )
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
    parser.add_argument(
        "--seed",
        type=_int_in(0, MAX_SEED),
        default=0,
        help=f"with --family search: random seed, 0 to {MAX_SEED} (default 0)",
    )
    parser.add_argument(
        "--max-flops",
        type=_int_in(1),
        help="with --family search: most flops per branch, at least 1 (default: the paper's)",
    )
    parser.add_argument(
        "--codegen",
        action="store_true",
        help="then regenerate invact/_generated/ (python -m codegen) from coeffs/defaults.json's families; "
        "an activation not in defaults.json yet is added with this family (a new spec entry's one step). "
        "In a source checkout only",
    )
    return parser


@contextlib.contextmanager
def _progress(console: Console) -> Iterator[Callable[[str], None]]:
    """A transient spinner with elapsed time; yields say(message) to update its text."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    # Only on a terminal: elsewhere (a pipe, a log) rich would leave an empty line behind on stderr.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
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


def _check_plot(path: Path) -> str:
    """The plot's format, checked with its folder before any work (UsageError if unusable)."""
    from fitting.plot import plot_format

    _check_writable(path, "plot")
    try:
        return plot_format(path)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _start_from(init: Path, activation: str, family: str) -> dict[str, dict[str, float]]:
    """The --init file's coefficients per branch, in the family's order. A file stores them with
    sorted keys (c0, c1, c10, ..., c2), so they are matched by name, not position."""
    from codegen.coeffs_json import load
    from fitting.families import get_family

    coeffs = load(init)
    if (coeffs.activation, coeffs.family) != (activation, family):
        raise UsageError(f"{init}: holds {coeffs.activation}/{coeffs.family}, not {activation}/{family}")
    expected = get_family(family, activation)
    if set(coeffs.branches) != set(expected.branches):
        raise UsageError(
            f"{init}: branches {sorted(coeffs.branches)} differ from the family's {sorted(expected.branches)}"
        )
    start = {}
    for name, form in expected.branches.items():
        got = coeffs.branches[name].coefficients
        missing, extra = sorted(set(form.start) - set(got)), sorted(set(got) - set(form.start))
        if missing or extra:
            raise UsageError(
                f"{init}: branches.{name}.coefficients: names differ from the family's "
                f"(missing {missing}, unexpected {extra})"
            )
        start[name] = {k: got[k] for k in form.start}
    return start


def run(args: argparse.Namespace, console: Console) -> int:
    """Check every input and output first, fit, render every output in memory, then write them."""
    from codegen.coeffs_json import CoeffsError, dumps, write_atomic
    from fitting.activations import UnknownActivation, get_activation
    from fitting.families import SEARCH, UnknownFamily, get_family

    entry = _user_activation(args)
    if args.family == SEARCH:
        return run_search(args, console)
    try:
        get_activation(args.activation)
        get_family(args.family, args.activation)
    except (UnknownActivation, UnknownFamily) as e:
        raise UsageError(str(e)) from None
    out = args.out or default_coeffs_dir() / args.activation / f"{args.family}.json"
    if args.expr is not None and args.out is None:
        out = Path(f"{args.activation}.json")
    _check_writable(out, "output")
    if args.emit:
        _check_writable(args.emit, "--emit module")
        if args.emit.suffix != ".py":
            raise UsageError(f"--emit {args.emit}: the module must be a .py file")
    defaults_text = _defaults_with(args.activation, args.family, out) if args.codegen else None
    plot_format = _check_plot(args.plot) if args.plot else None
    start = None
    if args.init:
        try:
            start = _start_from(args.init, args.activation, args.family)
        except CoeffsError as e:
            raise UsageError(str(e)) from None

    from fitting.pipeline import FamilyFit, fit_family
    from fitting.report import print_report  # rich tables

    command = f"invact-fit {args.activation} --family {args.family}"
    if args.init:
        command += f" --init {args.init}"
    with _progress(console) as say:
        fit: FamilyFit = fit_family(args.activation, args.family, start=start, progress=say)
        # Everything that can fail happens before the first write: the JSON (validated), the plot and
        # the regenerated modules (rendered with the new JSON in place of the file on disk).
        say("rendering outputs")
        text = dumps(fit.coeff_file(command))
        image = None
        if plot_format:
            from fitting.plot import figure_bytes

            image = figure_bytes(fit, plot_format)
        emitted = None
        if args.emit:
            from codegen.coeffs_json import loads
            from codegen.emitted import render_emitted
            from codegen.numba_view import cpu_runtime_sources

            sources = [(out.as_posix(), hashlib.sha256(text.encode("utf-8")).hexdigest())]
            sources.extend(cpu_runtime_sources())
            command = f"invact-fit {args.activation} --expr {args.expr!r} --family {args.family} --emit"
            emitted = render_emitted(loads(text, out), entry, sources, command)
        regenerate = None
        if args.codegen:
            from codegen.__main__ import plan

            replaced = {out: text} | ({_defaults_path(): defaults_text} if defaults_text else {})
            regenerate = plan(replaced=replaced)

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text)
    print_report(fit, str(out), _report_console())
    if image is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.plot, image)
        print(f"plot written to {args.plot}")
    if emitted is not None:
        args.emit.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.emit, emitted)
        print(f"runtime module written to {args.emit}: invact.load_activation({str(args.emit)!r})")
    if defaults_text is not None:
        write_atomic(_defaults_path(), defaults_text)
        print(f"added {args.activation!r}: {args.family!r} to {_defaults_path()}")
    if regenerate is not None:
        from codegen.__main__ import apply

        apply(regenerate)
    return 0


def _user_activation(args: argparse.Namespace):
    """With --expr: the user's activation, registered for this process (its spec entry); else None.
    UsageError for an expression that is not math, a shape InvAct cannot invert, or options that
    need a built-in."""
    if args.codegen and not in_checkout():
        raise UsageError("--codegen regenerates invact/_generated/ in a source checkout; outside one, fit "
                         "your own activation with --expr and --emit (see invact-fit --help)")  # fmt: skip
    if args.expr is None:
        if args.emit:
            raise UsageError("--emit writes the runtime module of your own activation: give it with --expr")
        return None
    if args.codegen:
        raise UsageError("--codegen regenerates the built-in activations; yours goes to --emit (to build it "
                         "in, add an entry to coeffs/activations.json)")  # fmt: skip
    from fitting.activations import from_expression

    try:
        entry, _ = from_expression(args.activation, args.expr)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return entry


def _defaults_path() -> Path:
    return default_coeffs_dir() / "defaults.json"


def _defaults_with(activation: str, family: str, out: Path) -> str | None:
    """defaults.json's new text when `activation` is not in it yet (written to the default place,
    coeffs/<activation>/<family>.json, which codegen reads), else None: an existing choice of family
    is the user's, and --codegen never changes it."""
    import json

    defaults = json.loads(_defaults_path().read_text(encoding="utf-8"))
    if activation in defaults:
        return None
    if out.resolve() != (default_coeffs_dir() / activation / f"{family}.json").resolve():
        raise UsageError(f"{activation} is not in {_defaults_path()}: write it to the default place "
                         "(no --out) so that --codegen can generate it")  # fmt: skip
    return json.dumps(dict(sorted((defaults | {activation: family}).items())), indent=2) + "\n"


def _report_console(width: int = 120) -> Console:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else width)


def run_search(args: argparse.Namespace, console: Console) -> int:
    """--family search: symbolic search per branch, refined by this toolkit; writes the chosen
    formula (coefficient JSON) and the Pareto front (<out stem>_front.json)."""
    from codegen.coeffs_json import dumps, write_atomic
    from fitting.activations import UnknownActivation, get_activation
    from fitting.families import SEARCH, UnknownFamily, require_two_branches
    from fitting.search import SearchSettings, SearchUnavailable
    from fitting.search import front as search_front

    try:
        act = get_activation(args.activation)
        require_two_branches(SEARCH, act)
    except (UnknownActivation, UnknownFamily) as e:
        raise UsageError(str(e)) from None
    if act.derivation:
        raise UsageError(
            f"search {act.name}'s base instead: invact-fit {act.derivation.base} --family search"
        )
    if args.budget < 1:
        raise UsageError("--budget must be at least 1 generation")
    for flag in ("init", "plot", "codegen"):
        if getattr(args, flag):
            raise UsageError(f"--{flag} does not apply to --family search")
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
    # Both files rendered (and the JSON validated) before either is written.
    text = dumps(search_front.coeff_file(act, chosen, command, settings))
    front_text = search_front.front_json(act, fronts, settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text)
    write_atomic(front_path, front_text)
    from fitting.search.report import print_fronts

    print_fronts(act.name, fronts, chosen, limits, _report_console(140))
    print(f"written: {out} (chosen per branch), {front_path} (Pareto fronts)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors are one line on stderr: 2 bad input, 1 a failed fit, 130 interrupted (Ctrl-C)."""
    try:
        args = build_parser().parse_args(argv)
        from rich.console import Console

        return run(args, Console(stderr=True))
    except UsageError as e:
        print(f"invact-fit: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("invact-fit: interrupted", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, ValueError) as e:
        print(f"invact-fit: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


if __name__ == "__main__":
    sys.exit(main())
