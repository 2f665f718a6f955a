"""The norm spec, coeffs/norms.json, and the runtime table printed from it, invact/_generated/norms.py.

Schema `invact-norms/1`: {"schema", "about", "norms": {name: entry}, "find"}. An entry describes one
normalization formula, y = cast(h * w_eff (+ b)) with h = (x - mean) * rstd or x * rstd, as the
replaced module computes it, field by field:

- `formula` (required): the formula in words, as the module's forward spells it (documentation);
- `center`: subtract the row mean (LayerNorm) or not (RMSNorm);
- `upcast`: the dtype the statistics are computed in: "float32" (Hugging Face's `.to(torch.float32)`,
  which also lowers float64), "opmath" (torch's: float32 for 16-bit inputs, else the input's own) or
  "native" (torch.native_layer_norm computes everything, `cast` "native" too);
- `cast`: where the result is rounded to its storage dtype: "before_weight" (h to x's dtype, then
  times the weight: Llama), "after_weight" (h times the weight in fp32, then to x's dtype: Gemma,
  OLMo-2), "weight_dtype" (h to the weight's dtype where that is 16-bit, then times it: T5);
- `offset`: the weight's offset, w_eff = offset + w (Gemma's 1 + w: 1; else 0);
- `bias`: the formula adds a bias (then the module's `bias` parameter);
- `eps`: the module attribute holding epsilon (torch's RMSNorm: None means finfo(x.dtype).eps);
- `classes`: qualified class name -> what was checked of it (one line). patch() tries an instance of a
  listed class against this entry first; every instance is accepted only after its forward matches
  the formula bitwise on a probe (invact.norm.match).

Top level, `find`: a regular expression on class names (not qualified); a module of an unlisted class
that matches it is tried against every entry (Hugging Face copies its RMSNorm into most models under
the model's name). Every problem is a ValueError, one line naming the entry and field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from codegen.common import header, sha256

SCHEMA = "invact-norms/1"
_CHOICES = {
    "upcast": ("float32", "opmath", "native"),
    "cast": ("before_weight", "after_weight", "weight_dtype", "native"),
}
_FIELDS = {"formula", "center", "upcast", "cast", "offset", "bias", "eps", "classes"}
_QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def read(text: str, where: str) -> dict:
    """The validated spec: {"norms": {name: entry}, "find": pattern}. ValueError, one line, else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f'{where}: expected an object with "schema": "{SCHEMA}"')
    norms, find = data.get("norms"), data.get("find")
    if not isinstance(norms, dict) or not norms:
        raise ValueError(f'{where}: "norms" must be a non-empty object')
    if not isinstance(find, str):
        raise ValueError(f'{where}: "find" must be a regular expression (a string)')
    try:
        re.compile(find)
    except re.error as e:
        raise ValueError(f'{where}: "find" is not a regular expression ({e})') from None
    seen: dict[str, str] = {}
    for name, entry in norms.items():
        here = f"{where}: norm {name!r}"
        if not _NAME.fullmatch(name):
            raise ValueError(f"{here}: names are lowercase identifiers")
        if not isinstance(entry, dict):
            raise ValueError(f"{here}: expected an object")
        missing, extra = _FIELDS - set(entry), set(entry) - _FIELDS
        if missing or extra:
            what = f"missing {sorted(missing)[0]!r}" if missing else f"unknown field {sorted(extra)[0]!r}"
            raise ValueError(f"{here}: {what}")
        for key in ("formula", "eps"):
            if not isinstance(entry[key], str) or not entry[key]:
                raise ValueError(f"{here}: {key} must be a non-empty string")
        for key in ("center", "bias"):
            if not isinstance(entry[key], bool):
                raise ValueError(f"{here}: {key} must be true or false")
        for key, choices in _CHOICES.items():
            if entry[key] not in choices:
                raise ValueError(f"{here}: {key} must be one of {', '.join(choices)}, got {entry[key]!r}")
        if (entry["upcast"] == "native") != (entry["cast"] == "native"):
            raise ValueError(f'{here}: upcast and cast are "native" together (torch.native_layer_norm)')
        if entry["upcast"] == "native" and not entry["center"]:
            raise ValueError(f'{here}: "native" is torch.native_layer_norm, which centers')
        if entry["offset"] not in (0, 1) or isinstance(entry["offset"], bool):
            raise ValueError(f"{here}: offset must be 0 or 1")
        classes = entry["classes"]
        if not isinstance(classes, dict):
            raise ValueError(f"{here}: classes must be an object of qualified class name -> note")
        for cls, note in classes.items():
            if not _QUALNAME.fullmatch(cls) or not isinstance(note, str):
                raise ValueError(f"{here}: classes: {cls!r} must be a qualified class name with a note")
            if cls in seen:
                raise ValueError(f"{here}: class {cls} is listed under {seen[cls]!r} already")
            seen[cls] = name
    return {"norms": norms, "find": find}


def render(spec: dict, sources: list[tuple[str, str]]) -> str:
    """invact/_generated/norms.py: the variants, the listed classes and the pattern, as plain data."""
    rows = []
    for name, e in spec["norms"].items():
        fields = {k: e[k] for k in ("center", "upcast", "cast", "offset", "bias", "eps")}
        rows.append(f"    # {e['formula']}\n    {name!r}: {fields!r},")
    classes = "\n".join(
        f"    {cls!r}: {name!r},  # {note}"
        for name, e in spec["norms"].items()
        for cls, note in e["classes"].items()
    )
    body = "\n".join(rows)
    return f'''{header(sources)}"""The normalization formulas InvAct inverts, from the norm spec
(codegen/norm_spec.py documents the fields)."""

# variant -> how its formula computes y (invact.norm evaluates it)
NORMS = {{
{body}
}}

# qualified class name -> the variant tried first (patch() checks the formula on a probe)
CLASSES = {{
{classes}
}}

# class names (unqualified) of unlisted modules that patch() tries against every variant
FIND = {spec["find"]!r}
'''


def render_file(path: Path, source: tuple[str, bytes]) -> str:
    name, data = source
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    return render(read(text, name), [(name, sha256(data))])
