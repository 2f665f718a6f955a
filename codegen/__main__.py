"""`python -m codegen [--check]`: regenerate invact/_generated/ from coeffs/ (defaults.json names
the family per activation). --check writes nothing and exits 1 if any generated file is stale."""

from __future__ import annotations

import argparse
import sys

from codegen.coeffs_json import CoeffsError, write_atomic
from codegen.render import GENERATED, render_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale or missing files")
    args = parser.parse_args(argv)
    try:
        files = render_all()
    except (CoeffsError, OSError, ValueError) as e:
        print(f"codegen: error: {e}", file=sys.stderr)
        return 2
    stale = [name for name, text in files.items() if _read(GENERATED / name) != text]
    extra = sorted(p.name for p in GENERATED.glob("*.py") if p.name not in files)
    if args.check:
        for name in stale:
            print(f"stale: invact/_generated/{name}")
        for name in extra:
            print(f"not generated from any coefficient file: invact/_generated/{name}")
        return 1 if stale or extra else 0
    GENERATED.mkdir(parents=True, exist_ok=True)
    for name in stale:
        write_atomic(GENERATED / name, files[name])
        print(f"wrote invact/_generated/{name}")
    for name in extra:
        (GENERATED / name).unlink()
        print(f"removed invact/_generated/{name}")
    if not stale and not extra:
        print("invact/_generated/ is up to date")
    return 0


def _read(path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
