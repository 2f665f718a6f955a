"""One family for one activation, end to end: fit each branch, measure every candidate, pick one.

Candidates per branch: the family's start ("published" where the paper gives coefficients for this
activation), the least-squares fit and the minimax fit. The one with the smallest linf_fp32 (the
error on the values an fp32 kernel sees) is written. A form without coefficients (the 'exact' family)
is not fitted: it is the one candidate, "exact". A derived activation (quick_gelu) is fitted on
its base (silu) and measured on itself, with y -> a*y in the expression, unless the family is
native (built for it directly, see fitting.families).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import numpy as np
import scipy
import sympy

from codegen.coeffs_json import BranchCoeffs, CoeffFile
from fitting.activations import get_activation
from fitting.evaluate import compile_q, count_flops, errors, storage_floors
from fitting.families import Family, get_family
from fitting.fit import FitSettings, Progress, fit_branch

SELECTION_METRIC = "linf_fp32"
DEFAULT_SETTINGS = FitSettings()


@dataclass(frozen=True)
class Candidate:
    label: str  # "published", "start", "lstsq", "minimax"; "exact" for a form without coefficients
    coefficients: dict[str, float]
    errors: dict[str, float]


@dataclass(frozen=True)
class BranchResult:
    candidates: list[Candidate]
    chosen: Candidate
    storage_floor: dict[str, float]
    flops: int


@dataclass(frozen=True)
class FamilyFit:
    activation: str
    family: Family
    threshold: float | None  # None for a monotone activation (one branch, no bit)
    y_min: float
    branches: dict[str, BranchResult]
    settings: FitSettings

    def coeff_file(self, command: str) -> CoeffFile:
        return CoeffFile(
            activation=self.activation,
            family=self.family.name,
            threshold=self.threshold,
            y_min=self.y_min,
            branches={
                name: BranchCoeffs(
                    expression=str(self.family.branches[name].expression),
                    coefficients=r.chosen.coefficients,
                    errors=r.chosen.errors,
                    storage_floor=r.storage_floor,
                    flops=r.flops,
                )
                for name, r in self.branches.items()
            },
            provenance={
                "command": command,
                "package_version": library_version("invact"),
                "libraries": {m: library_version(m) for m in ("numpy", "scipy", "sympy")},
                "seed": 0,  # the fit draws no random numbers; kept for the schema
                "selected": {name: r.chosen.label for name, r in self.branches.items()},
                "selection_metric": SELECTION_METRIC,
                "settings": self.settings.__dict__,
                "source": self.family.source,
            },
        )


def library_version(dist: str) -> str:
    known = {"numpy": np.__version__, "scipy": scipy.__version__, "sympy": sympy.__version__}
    if dist in known:
        return known[dist]
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def fit_family(
    activation: str, family_name: str, settings: FitSettings = DEFAULT_SETTINGS,
    start: dict[str, dict[str, float]] | None = None, progress: Progress | None = None,
) -> FamilyFit:  # fmt: skip
    """Fit `family_name` for `activation`. `start` optionally overrides the start per branch."""
    act = get_activation(activation)
    family = get_family(family_name, activation)
    fit_act = get_activation(family.fit_activation)
    base_family = get_family(family_name, fit_act.name) if fit_act is not act else family
    start_label = "published" if family.published else "start"

    branches = {}
    for branch in act.branches:
        say = (lambda msg, b=branch: progress(f"{activation}/{b}: {msg}")) if progress else None
        form = family.branches[branch]
        if form.start:
            first = (start or {}).get(branch, form.start)
            fitted = fit_branch(fit_act, branch, base_family.branches[branch], first, settings, say)
            options = ((start_label, first), ("lstsq", fitted.lstsq), ("minimax", fitted.minimax))
        else:
            options = (("exact", {}),)
        if say:
            say("measuring errors")
        candidates = [
            Candidate(label, c, errors(act, branch, compile_q(form.substituted(c)))) for label, c in options
        ]
        chosen = min(candidates, key=lambda c: c.errors[SELECTION_METRIC])
        branches[branch] = BranchResult(
            candidates=candidates,
            chosen=chosen,
            storage_floor=storage_floors(act, branch),
            flops=count_flops(form.expression),
        )
    threshold = None if act.monotone else act.threshold
    return FamilyFit(activation, family, threshold, act.y_min, branches, settings)
