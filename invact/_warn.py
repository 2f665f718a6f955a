"""Warnings at the user's line: invact's warnings name the first frame outside invact (and outside the
libraries a user's call passes through on its way to invact, e.g. transformers' resize_token_embeddings
calling the head's setter), so that Python prints the user's file and line under a one-line message."""

from __future__ import annotations

import os
import sys
import types
import warnings

_OWN = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _folder(package: str) -> str | None:
    """The folder of an imported package (None where it is not imported: no frame can be in it)."""
    module = sys.modules.get(package)
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def caller(through: tuple[str, ...] = ()) -> types.FrameType | None:
    """The first frame on the stack outside invact, Python's import machinery and the packages named in
    `through` (top-level names, e.g. "transformers"); None where there is none."""
    skipped = (_OWN, "<frozen importlib", *filter(None, map(_folder, through)))
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    return frame


def warn(message: str, category: type[Warning] = UserWarning, through: tuple[str, ...] = ()) -> None:
    """warnings.warn at caller(through)'s line: Python's filters and its once-per-line registry apply
    as to a warning raised there."""
    frame = caller(through)
    if frame is None:
        warnings.warn_explicit(message, category, "invact", 0, module="invact")
        return
    globals_ = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=globals_.get("__name__", "invact"),
        registry=globals_.setdefault("__warningregistry__", {}),
    )  # no module_globals, as warnings.warn passes none: a loader without sources (`python -c`) would raise
