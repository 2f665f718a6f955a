"""`python -m codegen [--check] [--coeffs-dir DIR]`: regenerate invact/_generated/ from coeffs/
(defaults.json names the family per activation). --check writes nothing and exits 1 if any generated
file is stale. Errors (an invalid coefficient file, ...) are one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from codegen.coeffs_json import CoeffsError, write_atomic
from codegen.render import COEFFS, GENERATED, render_all


@dataclass(frozen=True)
class Plan:
    """What a regeneration would do: every file's new text, and which ones change or go."""

    files: dict[str, str]  # name in invact/_generated -> text
    stale: list[str]  # missing or different on disk
    extra: list[str]  # on disk, generated from no coefficient file

    @property
    def up_to_date(self) -> bool:
        return not self.stale and not self.extra


def plan(coeffs_dir: Path | None = None, replaced: Mapping[Path, str] | None = None) -> Plan:
    """Render everything in memory (writes nothing; raises CoeffsError, OSError or ValueError), from
    `coeffs_dir` (default COEFFS). `replaced`: coefficient files read from the given text instead of
    disk (render_all)."""
    files = render_all(COEFFS if coeffs_dir is None else coeffs_dir, replaced)
    stale = [name for name, text in files.items() if _read(GENERATED / name) != text]
    extra = sorted(p.name for p in GENERATED.glob("*.py") if p.name not in files)
    return Plan(files, stale, extra)


def apply(p: Plan) -> None:
    """Write the stale files (each atomically) and remove the extra ones, saying what changed."""
    GENERATED.mkdir(parents=True, exist_ok=True)
    for name in p.stale:
        write_atomic(GENERATED / name, p.files[name])
        print(f"wrote invact/_generated/{name}")
    for name in p.extra:
        (GENERATED / name).unlink()
        print(f"removed invact/_generated/{name}")
    if p.up_to_date:
        print("invact/_generated/ is up to date")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale or missing files")
    parser.add_argument(
        "--coeffs-dir",
        type=Path,
        default=COEFFS,
        metavar="DIR",
        help="read defaults.json and the coefficient files from DIR (default: the checkout's coeffs/)",
    )
    args = parser.parse_args(argv)
    try:
        p = plan(args.coeffs_dir)
    except (CoeffsError, OSError, ValueError) as e:
        print(f"codegen: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.check:
        for name in p.stale:
            print(f"stale: invact/_generated/{name}")
        for name in p.extra:
            print(f"not generated from any coefficient file: invact/_generated/{name}")
        return 0 if p.up_to_date else 1
    apply(p)
    return 0


def _read(path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
