"""The planner: what training a model takes in memory, from its config alone, on the meta device
(shapes, no values, nothing allocated or downloaded), eager and after invact.patch(). The engine of the
`invact plan` command (invact.cli parses its arguments and prints with report).

Its rooms, each importing only those above it (and invact's op kinds):

- options: what a plan accepts (dtypes, recipes' names, sizes such as 24GiB) and PlanError, without
  torch;
- config: a Hugging Face config read and its model built on the meta device;
- autocast, as_on_device, meta_outputs: a forward and a step on the meta device as on a device
  (autocast's casts, SDPA's kernel, values the forward reads; each op's output remembered by shape);
- inputs: one training forward's inputs (token ids, labels, images);
- forward: `forward_saved`, what one training forward saves for backward, per kind of module;
- live_bytes: `LiveBytes`, a step's live bytes and their peak, op by op;
- recipes: bf16, mixed precision, LoRA, with and without gradient checkpointing;
- sharding: FSDP2 on one rank of N;
- fits: the search for the longest sequence (or largest batch) that fits;
- step: `Step` and `step_peaks`, a whole training step's peak per recipe;
- report: the answers as tables for a person (standard library alone).

`from invact.planner import forward_saved` (and the other names below) loads the room that holds it
when asked: importing invact.planner alone loads no torch, so the command answers bad input at once.
"""

from __future__ import annotations

import importlib

# public name -> the room that holds it
_HOMES = {
    "PlanError": "options",
    "parse_size": "options",
    "load_config": "config",
    "build_model": "config",
    "forward_saved": "forward",
    "KINDS": "forward",
    "LiveBytes": "live_bytes",
    "RECIPES": "recipes",
    "Recipe": "recipes",
    "TERMS": "options",
    "Step": "step",
    "step_peaks": "step",
    "format_forward": "report",
    "format_step": "report",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = list(_HOMES)  # noqa: PLE0604 - the names __getattr__ gives
