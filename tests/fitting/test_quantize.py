"""The FewBit baseline (fitting/quantize.py): the optimizers against brute force, and the optimal
quantizers against a published gradient-descent FewBit table and against each other."""

import itertools
from pathlib import Path

import numpy as np
import pytest

from codegen.coeffs_json import load
from fitting import quantize
from fitting.activations import get_activation
from fitting.evaluate import compile_q, l2
from fitting.quantize import FACTS_FEWBIT_GELU, segment_l2, segment_linf

GELU = get_activation("gelu")
CELLS = 1000  # DP grid for the tests: GELU's k = 8 L2 is 2.4% above the 4000-cell value, k <= 7 < 0.5%
SAMPLES = 2**15  # L-inf samples for the tests (f' moves by <= 5.1e-5 between neighbours)


def _partitions(m: int, n: int):
    """Every partition of range(m) into n non-empty contiguous segments, as edge lists [0, ..., m]."""
    for inner in itertools.combinations(range(1, m), n - 1):
        yield [0, *inner, m]


def test_segment_l2_matches_brute_force():
    rng = np.random.default_rng(0)
    m, points = 9, 3  # 9 cells, each 3 weighted points of a random target
    g = rng.normal(size=(m, points))
    w = rng.uniform(0.1, 2.0, size=(m, points))
    cost, parent = segment_l2(w.sum(1), (w * g).sum(1), (w * g * g).sum(1), n_max=5)
    for n in range(1, 6):
        best = np.inf
        for edges in _partitions(m, n):
            sse = 0.0
            for a, b in itertools.pairwise(edges):
                gs, ws = g[a:b].ravel(), w[a:b].ravel()
                sse += np.sum(ws * (gs - np.sum(ws * gs) / np.sum(ws)) ** 2)
            best = min(best, sse)
        assert cost[n] == pytest.approx(best, rel=1e-12, abs=1e-12)
        edges = quantize._borders(parent, n, m)
        assert len(edges) == n + 1 and edges[0] == 0 and edges[-1] == m and np.all(np.diff(edges) > 0)


def test_segment_linf_matches_brute_force():
    rng = np.random.default_rng(1)
    v = rng.normal(size=10)
    for n in range(1, 7):
        best = min(
            max(0.5 * (v[a:b].max() - v[a:b].min()) for a, b in itertools.pairwise(edges))
            for edges in _partitions(len(v), n)
        )
        err, starts = segment_linf(v, n)
        assert err == pytest.approx(best, rel=1e-10)
        assert len(starts) <= n and starts[0] == 0


@pytest.fixture(scope="module")
def gelu_quantizers():
    return {
        "l2": quantize.l2_optimal(GELU, 7, CELLS, "uniform"),
        "linf": quantize.linf_optimal(GELU, 7, SAMPLES),
    }


def test_optimal_l2_not_worse_than_facts_table(gelu_quantizers):
    # FewBit (gradient quantization, Novikov et al., ICML 2023) as a baseline: L2 of a re-implementation of
    # FewBit's gradient-descent fit, x in [-100, 100]. The optimum over borders cannot be worse.
    # Measured (1000 cells): 0.37556, 0.21155, 0.10950, 0.056238, 0.028953, 0.014666, 0.0074124.
    for k, (facts_l2, _) in FACTS_FEWBIT_GELU.items():
        q = gelu_quantizers["l2"][k]
        assert quantize.x_errors(GELU, q, q.borders)["l2"] <= facts_l2


def test_errors_decrease_with_k(gelu_quantizers):
    l2s = [quantize.x_errors(GELU, q, q.borders)["l2"] for q in gelu_quantizers["l2"].values()]
    linfs = [quantize.x_errors(GELU, q, q.borders)["linf"] for q in gelu_quantizers["linf"].values()]
    # Each extra bit about halves the error (measured ratios 0.50..0.57 for both L2 and L-inf).
    assert np.all(np.diff(l2s) < -0.25 * np.array(l2s[:-1]))
    assert np.all(np.diff(linfs) < -0.25 * np.array(linfs[:-1]))


def test_linf_optimum_is_minimal():
    v = GELU.df(quantize.linf_samples(GELU, SAMPLES))
    for k in range(1, 7):
        n = 2**k
        eps, starts = segment_linf(v, n)
        # n levels reach eps, fewer do not (greedy needs the fewest segments for a given bound) ...
        assert len(quantize.greedy_segments(v, eps, n)) == n
        assert segment_linf(v, n - 1)[0] > eps
        # ... and no n-level quantizer reaches less: the bisection stopped within 1e-12 relative.
        assert len(quantize.greedy_segments(v, eps * (1 - 1e-9), n)) > n


def test_linf_quantizer_error_on_the_line(gelu_quantizers):
    """Between samples the continuous error exceeds the sampled optimum by at most the resolution."""
    v = GELU.df(quantize.linf_samples(GELU, SAMPLES))
    resolution = quantize.linf_resolution(GELU, SAMPLES)
    for k, q in gelu_quantizers["linf"].items():
        sampled = segment_linf(v, 2**k)[0]
        measured = quantize.x_errors(GELU, q, q.borders)["linf"]
        assert sampled <= measured <= sampled + resolution


def test_each_optimum_wins_its_own_metric(gelu_quantizers):
    for k in range(1, 8):
        by_l2 = quantize.x_errors(GELU, gelu_quantizers["l2"][k], gelu_quantizers["l2"][k].borders)
        by_linf = quantize.x_errors(GELU, gelu_quantizers["linf"][k], gelu_quantizers["linf"][k].borders)
        assert by_l2["l2"] < by_linf["l2"]
        assert by_linf["linf"] < by_l2["linf"]


def test_l2_levels_are_stationary(gelu_quantizers):
    """The DP's levels are the segment means: moving any one level either way raises the x-space L2
    (computed independently of the DP, by x_errors' quadrature)."""
    q = gelu_quantizers["l2"][3]
    base = quantize.x_errors(GELU, q, q.borders)["l2"]
    for i in range(len(q.levels)):
        for delta in (-1e-3, 1e-3):
            levels = q.levels.copy()
            levels[i] += delta
            moved = quantize.Quantizer(q.borders, levels, "l2")
            assert quantize.x_errors(GELU, moved, q.borders)["l2"] > base


def test_normal_weighted_quantizer_beats_uniform_on_l2_normal():
    normal = quantize.l2_optimal(GELU, 4, 400, "normal")
    uniform = quantize.l2_optimal(GELU, 4, 400, "uniform")
    for k in range(1, 5):
        assert quantize.l2_normal(GELU, normal[k]) < quantize.l2_normal(GELU, uniform[k])


def test_l2_normal_per_branch_is_the_projects_l2():
    coeffs = load(Path(__file__).resolve().parents[2] / "coeffs" / "gelu" / "paper.json")
    q = {b: compile_q(coeffs.branches[b].sympy_expression()) for b in ("left", "right")}
    g = quantize.invact_of_x(GELU, q["left"], q["right"])
    for b in ("left", "right"):
        assert quantize.l2_normal(GELU, g, b) == pytest.approx(l2(GELU, b, q[b]), rel=1e-12)


def test_quantizer_evaluation():
    q = quantize.Quantizer(np.array([-1.0, 2.0]), np.array([0.0, 0.5, 1.0]), "l2")
    assert q(np.array([-5.0, -1.0, 0.0, 2.0, 7.0])).tolist() == [0.0, 0.5, 0.5, 1.0, 1.0]
    assert quantize.Quantizer(np.zeros(3), np.zeros(4), "l2").bits == 2
