"""Saved bytes per activation: what autograd holds for an activation followed by nn.Linear, beyond
the activation's output (which the Linear saves anyway), in bytes per element, for torch's own
forward and for InvAct (bits mode and precision-bit mode).

One row per generated activation (invact.activation.activations.ACTIVATIONS), fp32 on the CPU. Storages are
counted once (invact.memory.saved_tensors' rule), parameters excluded. Prints a markdown table and
writes benchmarks/results/saved_bytes.{json,md} (or into --out DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

import invact
from invact.activation.activations import ACTIVATIONS
from invact.memory import count_saved

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = (64, 128)  # 8192 elements: ceil(n / 8) bytes of bits is exactly n / 8


class _Forward(nn.Module):
    """torch's own forward of an activation (what the library's module computes) as a module."""

    def __init__(self, name: str):
        super().__init__()
        self.forward_fn = ACTIVATIONS[name].torch_forward

    def forward(self, x):
        return self.forward_fn(x)


def extra_bytes_per_element(act: nn.Module) -> float:
    """Bytes autograd saves per element of the activation's input, beyond its output, with an
    nn.Linear after it (so the output is saved once, by the Linear, in every case)."""
    model = nn.Sequential(act, nn.Linear(SHAPE[1], 8))
    h = torch.randn(SHAPE, requires_grad=True)
    with count_saved(model) as counted:  # distinct storages, parameters excluded
        model(h).sum().backward()
    output_bytes = h.numel() * h.element_size()  # the Linear's input, the activation's output
    return (counted.report.saved_bytes - output_bytes) / h.numel()


def measure() -> dict[str, dict[str, float]]:
    return {
        name: {
            "torch": extra_bytes_per_element(_Forward(name)),
            "invact_bits": extra_bytes_per_element(invact.InvAct(name)),
            "invact_precision_bit": extra_bytes_per_element(invact.InvAct(name, mode="precision_bit")),
            "monotone": ACTIVATIONS[name].monotone,
        }
        for name in sorted(ACTIVATIONS)
    }


def markdown(rows: dict[str, dict[str, float]]) -> str:
    lines = [
        "| activation | branches | torch | InvAct bits | InvAct precision-bit |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        branches = "1 (monotone)" if r["monotone"] else "2"
        bits, precision_bit = r["invact_bits"], r["invact_precision_bit"]
        lines.append(f"| {name} | {branches} | {r['torch']:g} | {bits:g} | {precision_bit:g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=RESULTS, metavar="DIR", help="where to write (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    rows = measure()
    print(markdown(rows), end="")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "saved_bytes.json").write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    (args.out / "saved_bytes.md").write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
