"""`invact-fit`: the fitting toolkit's command, launched from the runtime package.

The toolkit (the `fitting` and `codegen` packages, with the activation spec and the committed
coefficient files beside them in `coeffs/`) imports itself by those names. An installed wheel keeps
them in `invact/_toolkit/` rather than as top-level packages, so that installing invact claims no
generic name in a user's environment; this launcher puts that folder first on sys.path in the
command's own process. In a source checkout it uses the repository root instead. Nothing else in
the runtime imports the toolkit.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def toolkit_root() -> Path | None:
    """The folder holding `fitting/`, `codegen/` and `coeffs/`: invact/_toolkit in an installed wheel,
    the repository root in a checkout; None if neither is there (invact installed without them)."""
    here = Path(__file__).resolve().parent
    for root in (here / "_toolkit", here.parent):
        if (root / "fitting" / "cli.py").is_file() and (root / "coeffs" / "activations.json").is_file():
            return root
    return None


def main(argv: list[str] | None = None) -> int:
    root = toolkit_root()
    if root is None:
        print("invact-fit: error: the fitting toolkit is not installed here", file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from fitting.cli import main as fit_main

        return fit_main(argv)
    except ModuleNotFoundError as e:
        if e.name not in fit_dependencies():
            raise
        print(f"invact-fit: error: {e.name} is missing: pip install 'invact[fit]'", file=sys.stderr)
        return 2


def fit_dependencies() -> set[str]:
    """The import names the [fit] extra installs, read from the installed package's metadata (the one
    list is pyproject.toml's); empty where invact's metadata cannot be read."""
    from importlib import metadata

    try:
        requirements = metadata.requires("invact") or []
    except metadata.PackageNotFoundError:
        return set()
    fit = [r for r in requirements if 'extra == "fit"' in r.replace("'", '"')]
    return {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower().replace("-", "_") for r in fit}


if __name__ == "__main__":
    sys.exit(main())
