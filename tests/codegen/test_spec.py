"""The activation spec (coeffs/activations.json): what it holds is self-consistent, and a bad spec is
one clear error."""

import json

import mpmath as mp
import numpy as np
import pytest
import sympy

from codegen import spec
from fitting.activations import ACTIVATIONS, numpy_function

ENTRIES = spec.load()
NAMES = sorted(ENTRIES)
X = np.concatenate([np.linspace(-30, 30, 601), [-0.75, -1.28, 1e-3, -1e-3]])
# A given df is f' rewritten to avoid cancellation: it must agree with sympy's derivative of f evaluated
# at 30 digits (mpmath) to the float64 rounding of terms of size ~1 (measured: 2.2e-16 for mish here;
# sympy's own form, 1 - tanh^2, is off by 2.4e-15 at x = 19 in float64).
REWRITE_AGREEMENT = 4 * np.finfo(np.float64).eps
MPMATH = {"sigmoid": lambda z: 1 / (1 + mp.exp(-z)), "softplus": lambda z: mp.log1p(mp.exp(z)),
          "Phi": mp.ncdf}  # fmt: skip


def test_the_registry_is_the_spec():
    assert sorted(ACTIVATIONS) == NAMES


def _clipped(name):
    return bool(ENTRIES[name].derivation and ENTRIES[name].derivation[2])


# (a clipped entry's f' is checked against its base's below: sympy differentiates Min/Max to Heaviside)
@pytest.mark.parametrize("name", [n for n in NAMES if ENTRIES[n].df_given and not _clipped(n)])
def test_a_given_derivative_is_the_derivative_of_f(name):
    e = ENTRIES[name]
    derived = sympy.lambdify(spec.X, sympy.diff(e.f, spec.X), modules=[MPMATH, "mpmath"])
    with mp.workdps(30):
        want = np.array([float(derived(mp.mpf(float(x)))) for x in X])
    assert np.abs(numpy_function(e.df)(X) - want).max() <= REWRITE_AGREEMENT


@pytest.mark.parametrize("name", [n for n in NAMES if ENTRIES[n].derivation])
def test_a_derived_entry_is_its_base_scaled(name):
    e = ENTRIES[name]
    base, a, clip = e.derivation
    f = numpy_function(e.f)(X)
    scaled = numpy_function(ENTRIES[base].f)(a * X) / a
    df, base_df = numpy_function(e.df)(X), numpy_function(ENTRIES[base].df)(a * X)
    if clip:  # clipped, with f' = 0 at and past the bounds (fitting.activations._clipped says why)
        inside = (scaled > clip[0]) & (scaled < clip[1])
        scaled, base_df = np.clip(scaled, *clip), np.where(inside, base_df, 0.0)
        assert (~inside).any() and inside.any()  # X reaches past the bound: the test sees both
    assert np.abs(f - scaled).max() <= 4 * np.finfo(np.float64).eps * np.abs(f).max()
    assert np.abs(df - base_df).max() <= 4 * np.finfo(np.float64).eps * np.abs(df).max()


def _spec(**entry) -> str:
    return json.dumps({"schema": spec.SCHEMA, "activations": {"act": entry}})


GOOD = {"f": "x*sigmoid(x)", "torch": {"function": "silu"}, "module": {"class": "InvActSiLU"}}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"torch": {"function": "silu"}}, "activation 'act': missing field 'f'"),
        (GOOD | {"colour": 1}, "unknown field(s) ['colour']"),
        (GOOD | {"f": "__import__('os').system('true')"}, "activation 'act': f: "),
        (GOOD | {"f": "x.real"}, "attribute access is not allowed"),
        (GOOD | {"f": "gamma(x)"}, "function 'gamma' is not allowed"),
        (GOOD | {"f": "x*y"}, "unknown symbol 'y'"),
        (GOOD | {"torch": {"function": "eval"}}, "function 'eval' is not one of"),
        (GOOD | {"torch": {"function": "gelu", "kwargs": {"inplace": True}}}, "takes no keyword 'inplace'"),
        (GOOD | {"torch": {"function": "gelu", "kwargs": {"approximate": "a b"}}}, "finite number or a name"),
        (GOOD | {"torch": {"formula": "x", "function": "silu"}}, "expected {\"function\""),
        (GOOD | {"exact_q": "1 - exp(-y)"}, 'exact_q must be an object {"left": formula, "right": formula}'),
        (GOOD | {"monotone": True, "exact_q": {"right": "1"}}, "exact_q must be one formula (monotone)"),
        (GOOD | {"exact_q": {"left": "y", "right": "__import__('os')"}}, "activation 'act': exact_q: "),
        (GOOD | {"derivation": {"base": "silu", "scale": -1}}, "derivation must be"),
        (GOOD | {"derivation": {"base": "silu", "clip": [10, -10]}}, "derivation must be"),
        (GOOD | {"torch": {"function": "silu", "clamp": [0, "inf"]}}, "clamp must be [lo, hi]"),
        (GOOD | {"derivation": {"base": "nope", "scale": 2}}, "derivation base 'nope' is not in the spec"),
        (GOOD | {"monotone": "yes"}, "monotone must be true or false"),
        ({"f": "x", "torch": {"function": "silu"}}, "missing field 'module'"),
        (GOOD | {"module": {"class": "os.system"}}, "class must be a name InvAct<Something>"),
        (GOOD | {"module": {"class": "InvAct"}}, "class must be a name InvAct<Something>"),
        (GOOD | {"module": {"class": "InvActX", "why": {"beta": "b"}}}, "why names ['beta'], which are not"),
        (GOOD | {"module": {"class": "InvActX", "kwargs": {"a": 1}, "why": {"a": "x\nimport os"}}},
         "why must be an object of argument -> one line"),
        (GOOD | {"module": {"class": "InvActX", "kwargs": {"a": 1}, "ignored": {"a": 2}}}, "both in kwargs"),
        (GOOD | {"module": {"class": "InvActX", "ignored": {"mode": 2}}}, "or is named mode"),
        (GOOD | {"module": {"class": "InvActX", "kwargs": {"a": [1]}}}, "a must be a finite number"),
        (GOOD | {"patch": {"Swish": "x"}}, "'Swish' is not a qualified class name"),
        (GOOD | {"patch": {"m.Swish": 3}}, "expected the checked formula"),
        (GOOD | {"patch": {"m.Swish": "x\nimport os"}}, "one line of printable ASCII"),
        (GOOD | {"patch": {"m.S": {"when": {"a": 1}, "checked": "x\rimport os"}}}, "one line of printable"),
        (GOOD | {"patch": {"m.Swish": {"when": {}, "checked": "x"}}}, "an empty when"),
        (GOOD | {"functions": ["os.system"]}, "'os.system' is not a function of torch.nn.functional"),
    ],
)  # fmt: skip
def test_a_bad_entry_is_one_line_naming_it(entry, message):
    with pytest.raises(spec.SpecError) as info:
        spec.loads(_spec(**entry))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        (json.dumps({"schema": "other", "activations": {}}), 'expected an object with "schema"'),
        (json.dumps({"schema": spec.SCHEMA, "activations": {}}), "must be a non-empty object"),
        (json.dumps({"schema": spec.SCHEMA, "activations": {"Bad-Name": GOOD}}), "lower-case Python"),
        (json.dumps({"schema": spec.SCHEMA, "activations": {"a": GOOD | {"patch": {"m.S": "x"}}},
                     "skipped": {"m.S": "no"}}), "m.S is also in skipped"),
        (json.dumps({"schema": spec.SCHEMA, "activations": {"a": GOOD | {"patch": {"m.S": "x"}},
                                                            "b": GOOD | {"patch": {"m.S": "x"}}}}),
         "m.S is claimed by 'a' too"),
        (json.dumps({"schema": spec.SCHEMA, "activations": {"a": GOOD, "b": GOOD}}),
         "module InvActSiLU: entries ['a', 'b'] have the same kwargs"),
        (json.dumps({"schema": spec.SCHEMA, "activations": {
            "a": GOOD | {"module": {"class": "InvActG", "kwargs": {"k": 1}}},
            "b": GOOD | {"module": {"class": "InvActG", "kwargs": {"j": 1}}}}}),
         "activation 'b': module: InvActG takes other arguments in 'a'"),
        (json.dumps({"schema": spec.SCHEMA, "activations": {
            "a": GOOD | {"module": {"class": "InvActG", "kwargs": {"k": 1}}},
            "b": GOOD | {"torch": {"function": "mish"},
                         "module": {"class": "InvActG", "kwargs": {"k": 2}}}}}),
         "activation 'b': InvActG's entries must share one torch function"),
        (json.dumps({"schema": spec.SCHEMA, "activations": {
            "a": GOOD, "b": GOOD | {"module": {"class": "InvActOther"}}}}),
         "module InvActOther: its functional form 'silu' is InvActSiLU's too"),
    ],
)  # fmt: skip
def test_a_bad_file_is_one_line(text, message):
    """(the last rows: a class both replaced and skipped, one claimed twice without a when, and module
    classes whose entries cannot be told apart, take different arguments or clash in functional name)"""
    with pytest.raises(spec.SpecError) as info:
        spec.loads(text)
    assert message in str(info.value)
