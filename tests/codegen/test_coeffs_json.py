"""The invact-coeffs/1 contract: round trip, byte-stable output, atomic writes, clear errors."""

import copy
import json

import pytest
import sympy

from codegen.coeffs_json import CoeffsError, Y, atomic_target, from_dict, load, save, write_atomic

VALID = {
    "schema": "invact-coeffs/1",
    "activation": "gelu",
    "family": "paper",
    "threshold": -0.7517915246935645,
    "y_min": -0.16997120747990363,
    "branches": {
        name: {
            "expression": "c0*sqrt(Max(0, y + c1)) + exp(-y)",
            "coefficients": {"c0": 1.5, "c1": 0.17},
            "errors": {"l2": 1e-4, "linf": 1e-3, "linf_bf16": 1e-3, "linf_fp16": 1e-3, "linf_fp32": 1e-3},
            "storage_floor": {"bf16": 0.01, "fp16": 0.005, "fp32": 5e-5},
            "flops": 7,
        }
        for name in ("left", "right")
    },
    "provenance": {"command": "invact-fit gelu --family paper", "package_version": "0.1.0", "seed": 0},
}


def _monotone(doc: dict) -> dict:
    """VALID turned into a monotone activation's file: the one branch "right", threshold null."""
    doc = copy.deepcopy(doc)
    doc.update(activation="softplus", family="exact", threshold=None, y_min=0.0)
    del doc["branches"]["left"]
    doc["branches"]["right"].update(expression="1 - exp(-y)", coefficients={}, flops=4)
    return doc


def _write(tmp_path, doc, name="c.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_round_trip_is_byte_identical(tmp_path):
    coeffs = from_dict(copy.deepcopy(VALID))
    save(coeffs, tmp_path / "a.json")
    save(load(tmp_path / "a.json"), tmp_path / "b.json")
    a, b = (tmp_path / "a.json").read_bytes(), (tmp_path / "b.json").read_bytes()
    assert a == b
    text = a.decode()
    assert text.index('"activation"') < text.index('"branches"') < text.index('"schema"')  # sorted keys
    assert "-0.7517915246935645" in text  # repr floats: all 17 significant digits survive


def test_substituted_expression_has_only_y():
    expr = from_dict(copy.deepcopy(VALID)).branches["left"].sympy_expression()
    assert {s.name for s in expr.free_symbols} == {"y"}
    assert float(expr.subs(Y, 0.0)) == pytest.approx(1.5 * 0.17**0.5 + 1)
    assert isinstance(expr, sympy.Expr)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("y_min"), r"c\.json: y_min: missing"),
        (lambda d: d.update(schema="invact-coeffs/2"), r"schema: expected 'invact-coeffs/1'"),
        (
            lambda d: d["branches"].pop("right"),
            r"branches: expected exactly \['left', 'right'\] \(or \['right'\] for a monotone activation\), "
            r"got \['left'\]",
        ),
        (
            lambda d: d["branches"]["left"]["coefficients"].update(c1="x"),
            r"branches\.left\.coefficients\.c1: not a",
        ),
        (
            lambda d: d["branches"]["left"]["coefficients"].update(c1=float("nan")),
            r"coefficients\.c1: not a finite",
        ),
        (
            lambda d: d["branches"]["left"]["coefficients"].update(a=1.0),
            r"coefficients\.a: coefficient names",
        ),
        (
            lambda d: d["branches"]["right"]["errors"].pop("linf_fp16"),
            r"branches\.right\.errors\.linf_fp16: missing",
        ),
        (lambda d: d["branches"]["right"].update(flops=-1), r"branches\.right\.flops: must be >= 0"),
        (
            lambda d: d["branches"]["right"].update(flops=True),
            r"branches\.right\.flops: expected int, got bool",
        ),
        (
            lambda d: d["branches"]["left"].update(expression="c0*z"),
            r"branches\.left\.expression: unknown symbol 'z' \(allowed: c0, c1, y\)",
        ),
        (lambda d: d["branches"]["left"].update(expression="sin(y)"), r"function 'sin' is not allowed"),
        (
            lambda d: d["branches"]["left"].update(expression="c0*(y"),
            r"branches\.left\.expression: cannot parse",
        ),
        (lambda d: d.update(threshold=None), r"threshold: not a finite number"),
        # A monotone file (branches exactly ["right"]) must say threshold null, and only it may.
        (lambda d: d["branches"].pop("left"), r"threshold: must be null when branches are \['right'\]"),
        (lambda d: d.update(_monotone(d) | {"threshold": -1.0}), r"threshold: must be null when branches"),
        (lambda d: (d.update(_monotone(d)), d.pop("threshold")), r"c\.json: threshold: missing"),
        (
            lambda d: d.update(_monotone(d), branches={"right": d["branches"]["right"], "middle": {}}),
            r"branches: expected exactly .* got \['middle', 'right'\]",
        ),
    ],
)
def test_validation_names_file_and_field(tmp_path, mutate, message):
    doc = copy.deepcopy(VALID)
    mutate(doc)
    with pytest.raises(CoeffsError, match=message) as info:
        load(_write(tmp_path, doc))
    assert str(info.value).startswith(str(tmp_path / "c.json"))


def test_monotone_file_round_trips(tmp_path):
    coeffs = load(_write(tmp_path, _monotone(VALID)))
    assert coeffs.threshold is None and coeffs.monotone and list(coeffs.branches) == ["right"]
    assert not from_dict(copy.deepcopy(VALID)).monotone
    save(coeffs, tmp_path / "a.json")
    assert '"threshold": null' in (tmp_path / "a.json").read_text()
    assert load(tmp_path / "a.json") == coeffs


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "invact-coeffs/1", ')
    with pytest.raises(CoeffsError, match=r"bad\.json: not valid JSON \(line 1, column"):
        load(bad)
    with pytest.raises(CoeffsError, match=r"nope\.json: cannot read"):
        load(tmp_path / "nope.json")


def test_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_target(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    write_atomic(target, "new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
