"""Render invact/_generated/ from coefficient files: three modules per activation, plus an index. One
printer module per target:

- `<act>.py` (codegen.torch_view): constants (threshold, y_min, measured errors) and q_left/q_right on
  torch tensors; for a monotone activation (MONOTONE = True, THRESHOLD = None: no bit) q_right alone.
- `<act>_cpu.py` (codegen.numba_view, with codegen.numba_templates and codegen.near_tables): the same
  formulas as fp32 scalar functions, and the numba backward kernels compiled from them.
- `<act>_triton.py` (codegen.triton_view): the same formulas as @triton.jit device functions.
- In the torch and Triton views, q16_left/q16_right: q for y stored in bf16 or fp16, printed from the
  family coeffs/defaults_16bit.json names for the activation (codegen.half), else aliases of q.
- `__init__.py`, `modules.py`, `functional.py` (codegen.index_view): the activations and the
  coefficient file each was generated from, the runtime's tables (module classes, the classes and
  functions patch() replaces, the classes it skips), and the torch-compatible module classes and
  functional forms, one per class of the spec.
- `norms.py` (codegen.norm_spec): the normalization variants of coeffs/norms.json, for invact.norm.
- --emit modules (codegen.emitted): every view of a user-defined activation in one file.

Every file starts with a header naming its source JSON and that file's sha256 (codegen.common); a test
regenerates everything and fails on any difference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from codegen import spec
from codegen.coeffs_json import CoeffFile, loads
from codegen.common import COEFFS, GENERATED, ROOT, rel, sha256
from codegen.index_view import render_index, render_modules
from codegen.norm_spec import render_file as render_norms
from codegen.numba_view import cpu_runtime_sources, render_cpu
from codegen.torch_view import render_torch
from codegen.triton_view import render_triton

__all__ = ["COEFFS", "GENERATED", "ROOT", "render_all"]


def render_all(coeffs_dir: Path = COEFFS, replaced: Mapping[Path, str] | None = None) -> dict[str, str]:
    """File name (relative to invact/_generated) -> content, for every activation in defaults.json.

    `replaced` maps a coefficient file to the text it is about to be written with: invact-fit renders
    with its new file before it writes anything, so a failure leaves coeffs/ and _generated/ in step."""
    replaced = {Path(p).resolve(): text.encode("utf-8") for p, text in (replaced or {}).items()}

    def source(path: Path) -> tuple[str, bytes]:
        data = replaced.get(path.resolve())
        return rel(path), path.read_bytes() if data is None else data

    def family_table(path: Path) -> tuple[dict[str, str], str, bytes]:
        """activation -> family name from a JSON object (defaults.json, defaults_16bit.json)."""
        name, data = source(path)
        try:
            table = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}: not valid JSON ({e})") from None
        if not (isinstance(table, dict) and all(isinstance(v, str) for v in table.values())):
            raise ValueError(f"{name}: expected an object of activation -> family names")
        return table, name, data

    defaults, defaults_name, defaults_bytes = family_table(coeffs_dir / "defaults.json")
    try:
        spec_name, spec_bytes = source(coeffs_dir / "activations.json")
    except OSError as e:
        path = coeffs_dir / "activations.json"
        raise ValueError(f"{path}: cannot read the activation spec ({e.strerror})") from None
    the_spec = spec.read(spec_bytes.decode("utf-8"), spec_name)
    entries = the_spec.entries
    index_sources = [(defaults_name, sha256(defaults_bytes)), (spec_name, sha256(spec_bytes))]
    missing = sorted(set(defaults) - set(entries))
    if missing:  # checked before any table is printed: each reads the activation's entry
        raise ValueError(f"{defaults_name}: {missing[0]!r} has no entry in {spec_name}")
    sixteen = {}  # optional: without it every dtype evaluates the default family's q
    if (coeffs_dir / "defaults_16bit.json").is_file():
        sixteen, sixteen_name, sixteen_bytes = family_table(coeffs_dir / "defaults_16bit.json")
        strays = sorted(set(sixteen) - set(defaults))
        if strays:
            raise ValueError(f"{sixteen_name}: {strays[0]!r} is not in {defaults_name}")
        index_sources.append((sixteen_name, sha256(sixteen_bytes)))
    files = {"__init__.py": render_index(defaults, the_spec, index_sources, sixteen)}
    cpu_runtime = cpu_runtime_sources()
    generated = {a: entries[a] for a in sorted(defaults)}
    files["modules.py"], files["functional.py"] = render_modules(generated, [(spec_name, sha256(spec_bytes))])

    def coefficients(activation: str, family: str) -> tuple[CoeffFile, tuple[str, str]]:
        path = coeffs_dir / activation / f"{family}.json"
        name, data = source(path)
        try:
            return loads(data.decode("utf-8"), path), (name, sha256(data))
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text") from None

    for activation, family in sorted(defaults.items()):
        c, c_source = coefficients(activation, family)
        c16, c16_sources = None, []
        if activation in sixteen:
            c16, c16_source = coefficients(activation, sixteen[activation])
            c16_sources = [c16_source]
        with_spec = [(spec_name, sha256(spec_bytes)), c_source, *c16_sources]
        files[f"{activation}.py"] = render_torch(c, with_spec, entries[activation], c16)
        files[f"{activation}_cpu.py"] = render_cpu(c, [c_source, *c16_sources, *cpu_runtime], c16)
        files[f"{activation}_triton.py"] = render_triton(c, with_spec, entries[activation], c16)
    norms = coeffs_dir / "norms.json"
    try:
        files["norms.py"] = render_norms(norms, source(norms))
    except OSError as e:
        raise ValueError(f"{norms}: cannot read the norm spec ({e.strerror})") from None
    return files
