"""The coefficient file, schema "invact-coeffs/1": load with validation, write atomically.

Both `fitting` (writer) and `codegen` (reader) use this module; it imports neither. A file is written
with sorted keys and `repr` floats, via a temporary file renamed into place, so a reader never sees a
half-written file and the same content always gives the same bytes. Every validation error names the
file and the field, e.g. ``coeffs/gelu/paper.json: branches.left.coefficients.c3: not a finite number``.

A monotone activation's file has the one branch "right" and `"threshold": null` (no bit), and
`"y_min": null` where f is unbounded below (leaky_relu: its infimum is -inf); any other file has the
branches "left" and "right" and a finite threshold and y_min.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy

from codegen.safe_expr import ALLOWED_FUNCTIONS as ALLOWED_FUNCTIONS  # re-exported: the contract names them
from codegen.safe_expr import ExpressionError, parse, real_symbols

SCHEMA = "invact-coeffs/1"
BRANCH_NAMES = ("left", "right")
MONOTONE_BRANCH_NAMES = ("right",)  # a monotone activation: one branch, threshold null
ERROR_KEYS = ("l2", "linf", "linf_bf16", "linf_fp16", "linf_fp32")
FLOOR_KEYS = ("bf16", "fp16", "fp32")
_COEFF_NAME = re.compile(r"c(0|[1-9][0-9]*)")
Y = sympy.Symbol("y", real=True)


class CoeffsError(ValueError):
    """A coefficient file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class BranchCoeffs:
    expression: str  # sympy string in y and the coefficient names
    coefficients: dict[str, float]
    errors: dict[str, float]  # ERROR_KEYS, see docs/fitting.md "Error metrics"
    storage_floor: dict[str, float]  # FLOOR_KEYS: the error no approximation beats in that dtype
    flops: int

    def sympy_expression(self) -> sympy.Expr:
        """The expression with its coefficients substituted: y is its only free symbol."""
        return _substituted(self.expression, tuple(self.coefficients.items()))


@functools.lru_cache(maxsize=256)
def _substituted(expression: str, coefficients: tuple[tuple[str, float], ...]) -> sympy.Expr:
    """BranchCoeffs.sympy_expression, kept: every view of a file (torch, numba, Triton, tables) asks for
    it, and parsing plus substitution was half of a regeneration's time. sympy expressions are
    immutable, so the views share one."""
    return parse_expression(expression, [k for k, _ in coefficients], where="").subs(
        {sympy.Symbol(k, real=True): v for k, v in coefficients}
    )


@dataclass(frozen=True)
class CoeffFile:
    activation: str
    family: str
    threshold: float | None  # T: bit = 1 (left branch) where x < T; None: monotone, no bit
    y_min: float  # f(T); a monotone f's infimum (-inf where f is unbounded below)
    branches: dict[str, BranchCoeffs]
    provenance: dict[str, Any]

    @property
    def monotone(self) -> bool:
        """One branch ("right") and no bit."""
        return self.threshold is None

    def to_json(self) -> str:
        doc = {
            "schema": SCHEMA,
            "activation": self.activation,
            "family": self.family,
            "threshold": self.threshold,
            "y_min": None if self.y_min == -math.inf else self.y_min,  # JSON has no -inf
            "branches": {
                name: {
                    "expression": b.expression,
                    "coefficients": b.coefficients,
                    "errors": b.errors,
                    "storage_floor": b.storage_floor,
                    "flops": b.flops,
                }
                for name, b in self.branches.items()
            },
            "provenance": self.provenance,
        }
        return json.dumps(doc, sort_keys=True, indent=2, allow_nan=False) + "\n"


def parse_expression(text: str, coefficient_names: list[str], where: str) -> sympy.Expr:
    """Parse a branch expression with the safe reader (codegen.safe_expr, never eval): only numbers,
    y, the named coefficients, arithmetic and ALLOWED_FUNCTIONS may appear."""
    try:
        return parse(text, real_symbols([*coefficient_names, "y"]), where)
    except ExpressionError as e:
        raise CoeffsError(str(e)) from None


def _field(doc: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(doc, dict):
        raise CoeffsError(f"{where}: expected an object")
    if key not in doc:
        raise CoeffsError(f"{where}.{key}: missing" if where else f"{key}: missing")
    value = doc[key]
    path = f"{where}.{key}" if where else key
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CoeffsError(f"{path}: not a finite number")
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):  # bool is an int
        raise CoeffsError(f"{path}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _numbers(doc: dict, keys: tuple[str, ...], where: str) -> dict[str, float]:
    return {k: _field(doc, k, float, where) for k in keys}


def from_dict(doc: Any) -> CoeffFile:
    """Validate a parsed document; raises CoeffsError naming the first bad field (without the file)."""
    if not isinstance(doc, dict):
        raise CoeffsError("top level: expected an object")
    if _field(doc, "schema", str, "") != SCHEMA:
        raise CoeffsError(f"schema: expected {SCHEMA!r}, got {doc['schema']!r}")
    branches_doc = _field(doc, "branches", dict, "")
    names = tuple(sorted(branches_doc))
    if names not in (BRANCH_NAMES, MONOTONE_BRANCH_NAMES):
        raise CoeffsError(
            f"branches: expected exactly {list(BRANCH_NAMES)} (or {list(MONOTONE_BRANCH_NAMES)} for a "
            f"monotone activation), got {list(names)}"
        )
    monotone = names == MONOTONE_BRANCH_NAMES
    if monotone and _field(doc, "threshold", object, "") is not None:
        raise CoeffsError(f"threshold: must be null when branches are {list(MONOTONE_BRANCH_NAMES)}")
    branches = {}
    for name in names:
        where = f"branches.{name}"
        b = branches_doc[name]
        coeffs_doc = _field(b, "coefficients", dict, where)
        for key in coeffs_doc:
            if not _COEFF_NAME.fullmatch(key):
                raise CoeffsError(f"{where}.coefficients.{key}: coefficient names are c0, c1, ...")
        coefficients = _numbers(coeffs_doc, tuple(coeffs_doc), f"{where}.coefficients")
        expression = _field(b, "expression", str, where)
        parse_expression(expression, list(coefficients), f"{where}.expression")
        flops = _field(b, "flops", int, where)
        if flops < 0:
            raise CoeffsError(f"{where}.flops: must be >= 0")
        branches[name] = BranchCoeffs(
            expression=expression,
            coefficients=coefficients,
            errors=_numbers(_field(b, "errors", dict, where), ERROR_KEYS, f"{where}.errors"),
            storage_floor=_numbers(
                _field(b, "storage_floor", dict, where), FLOOR_KEYS, f"{where}.storage_floor"
            ),
            flops=flops,
        )
    return CoeffFile(
        activation=_field(doc, "activation", str, ""),
        family=_field(doc, "family", str, ""),
        threshold=None if monotone else _field(doc, "threshold", float, ""),
        y_min=-math.inf if monotone and doc.get("y_min", 0) is None else _field(doc, "y_min", float, ""),
        branches=branches,
        provenance=_field(doc, "provenance", dict, ""),
    )


def load(path: str | os.PathLike) -> CoeffFile:
    """Read and validate a coefficient file. Raises CoeffsError("<path>: <field>: <problem>")."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CoeffsError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    return loads(text, path)


def loads(text: str, path: str | os.PathLike) -> CoeffFile:
    """Validate the text of a coefficient file; `path` names it in errors (see load)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CoeffsError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:  # json nests past Python's recursion limit
        raise CoeffsError(f"{path}: not valid JSON (nested too deeply)") from None
    try:
        return from_dict(doc)
    except CoeffsError as e:
        raise CoeffsError(f"{path}: {e}") from None


@contextlib.contextmanager
def atomic_target(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed onto `path`, on any error removed.
    Readers never see a half-written file, and a failed write leaves nothing behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix or ".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write text or bytes to `path` atomically (see atomic_target), flushed to disk."""
    with atomic_target(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())


def dumps(coeffs: CoeffFile) -> str:
    """The file's text, validated by a round trip through from_dict (raises CoeffsError)."""
    text = coeffs.to_json()
    from_dict(json.loads(text))
    return text


def save(coeffs: CoeffFile, path: str | os.PathLike) -> None:
    """Validate (round trip through from_dict) and write atomically."""
    write_atomic(path, dumps(coeffs))
