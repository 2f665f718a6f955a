"""Run a search per branch, refine and measure every candidate, keep the Pareto front, pick one.

The pick per branch: the smallest linf_fp32 among front members with at most `max_flops` flops
(default: the paper family's flops for that branch, when the paper covers the activation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from codegen.coeffs_json import BranchCoeffs, CoeffFile, write_atomic
from fitting.activations import Activation
from fitting.evaluate import compile_q, count_flops, errors, storage_floors
from fitting.families import SEARCH, BranchForm, UnknownFamily, get_family
from fitting.fit import FitSettings, Progress, fit_branch, fit_sample
from fitting.pipeline import SELECTION_METRIC, library_version
from fitting.search import SearchSettings, parametrize, propose

FRONT_SCHEMA = "invact-front/1"
# Candidates are many and cheap: a smaller sample than a family fit (the metrics still use the
# full grids of fitting.evaluate).
CANDIDATE_FIT = FitSettings(
    uniform_x=400, cusp_x=400, uniform_y=400, minimax_iterations=60, exchange_rounds=2
)


@dataclass(frozen=True)
class Measured:
    form: BranchForm
    coefficients: dict[str, float]
    errors: dict[str, float]
    flops: int

    def to_dict(self) -> dict:
        return {"expression": str(self.form.expression), "coefficients": self.coefficients,
                "errors": self.errors, "flops": self.flops}  # fmt: skip


def pareto(candidates: list[Measured]) -> list[Measured]:
    """Members not beaten on both flops and linf_fp32, cheapest first."""
    front, best = [], np.inf
    for m in sorted(candidates, key=lambda m: (m.flops, m.errors[SELECTION_METRIC])):
        if m.errors[SELECTION_METRIC] < best:
            front.append(m)
            best = m.errors[SELECTION_METRIC]
    return front


def measure(act: Activation, branch: str, form: BranchForm) -> Measured:
    """Fit the form's coefficients (when it has any), keep the best of start/lstsq/minimax."""
    options = [form.start]
    if form.start:
        fitted = fit_branch(act, branch, form, settings=CANDIDATE_FIT)
        options += [fitted.lstsq, fitted.minimax]
    scored = [(errors(act, branch, compile_q(form.substituted(c))), c) for c in options]
    errs, coeffs = min(scored, key=lambda s: s[0][SELECTION_METRIC])
    return Measured(form, coeffs, errs, count_flops(form.expression))


def search_branch(
    act: Activation, branch: str, settings: SearchSettings, progress: Progress | None
) -> list[Measured]:
    sample = fit_sample(act, branch, CANDIDATE_FIT)
    u = np.maximum(sample.y - act.y_min, 0.0)
    if progress:
        progress(f"{act.name}/{branch}: {settings.backend} search ({settings.generations} generations)")
    expressions = propose(act, u, sample.target, settings)
    measured = []
    for i, expr in enumerate(expressions):
        if progress:
            progress(f"{act.name}/{branch}: refining candidate {i + 1}/{len(expressions)}")
        m = measure(act, branch, parametrize(expr, act))
        if np.isfinite(m.errors[SELECTION_METRIC]):
            measured.append(m)
    return pareto(measured)


def paper_flops(act: Activation) -> dict[str, int] | None:
    try:
        family = get_family("paper", act.name)
    except UnknownFamily:
        return None
    return {b: count_flops(f.expression) for b, f in family.branches.items()}


def choose(front: list[Measured], max_flops: int | None) -> Measured:
    allowed = [m for m in front if max_flops is None or m.flops <= max_flops] or front[:1]
    return min(allowed, key=lambda m: m.errors[SELECTION_METRIC])


def coeff_file(
    act: Activation, chosen: dict[str, Measured], command: str, settings: SearchSettings
) -> CoeffFile:
    branches = {
        b: BranchCoeffs(str(m.form.expression), m.coefficients, m.errors, storage_floors(act, b), m.flops)
        for b, m in chosen.items()
    }
    return CoeffFile(
        activation=act.name, family=SEARCH, threshold=act.threshold, y_min=act.y_min, branches=branches,
        provenance={"command": command, "package_version": library_version("invact"), "seed": settings.seed,
                    "search": settings.__dict__, "selection_metric": SELECTION_METRIC},
    )  # fmt: skip


def front_json(act: Activation, fronts: dict[str, list[Measured]], settings: SearchSettings) -> str:
    """The Pareto fronts as JSON text (schema FRONT_SCHEMA), sorted keys."""
    doc = {"schema": FRONT_SCHEMA, "activation": act.name, "search": settings.__dict__,
           "branches": {b: [m.to_dict() for m in front] for b, front in fronts.items()}}  # fmt: skip
    return json.dumps(doc, sort_keys=True, indent=2, allow_nan=False) + "\n"


def write_front(path, act: Activation, fronts: dict[str, list[Measured]], settings: SearchSettings) -> None:
    write_atomic(path, front_json(act, fronts, settings))
