"""The planner's answers as tables for a person: `format_forward` (what one forward saves, per kind, with
patch()'s decisions) and `format_step` (a step's peaks, or what fits, per recipe and checkpointing,
with --explain each peak's terms). Standard library alone: invact.cli prints with it."""

from __future__ import annotations

import re
import textwrap

from invact.planner.options import SEQ_MULTIPLE, TERMS


def _bytes(n: int) -> str:
    """n bytes in GiB, MiB or KiB (binary units), as a person reads them."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _change(eager: int, patched: int) -> str:
    if patched == eager:
        return "="
    if not eager:
        return "new"
    return f"{patched / eager - 1:+.1%}"


def _pattern(name: str) -> str:
    """A module name with its layer indices as *: one line for every layer's copy."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _decision_lines(decisions: list[dict]) -> list[str]:
    groups: dict[tuple, int] = {}
    for d in decisions:
        gated = _pattern(d["gated"]) if d["gated"] else None
        key = (d["replace"], _pattern(d["name"]) or "(the model)", d["class"], d["reason"], gated)
        groups[key] = groups.get(key, 0) + 1
    replaced = sum(1 for d in decisions if d["replace"])
    norms = sum(1 for d in decisions if d.get("kind") == "norm" and d["replace"])
    losses = sum(1 for d in decisions if d.get("kind") == "loss" and d["replace"])
    replaced -= norms + losses
    left = sum(1 for d in decisions if not d["replace"])
    loss = ", the loss from hidden states" if losses else ""
    lines = [f"patch(): {replaced} activation(s) and {norms} norm(s) replaced{loss}, {left} left alone"]
    for (replace, name, cls, reason, gated), count in groups.items():
        times = f" (x{count})" if count > 1 else ""
        verb = "replaced" if replace else "left alone"
        hooked = f"; gated-product hook on {gated or '(the model)'}" if gated is not None else ""
        text = f"{verb}: {name}{times}, {cls}: {reason}{hooked}"
        lines += textwrap.wrap(text, width=100, initial_indent="  ", subsequent_indent="      ")
    if not decisions:
        lines.append("  (no activation or norm module found)")
    return lines


def _input_lines(result: dict) -> list[str]:
    """What the forward's inputs hold besides input_ids (batch, seq): the images, the decoder's tokens."""
    lines = []
    images = result.get("image_inputs")
    if images and images["per_sample"]:
        side, each = images["side"], images["tokens_per_image"]
        lines.append(
            f"images: {images['per_sample']} per sample, {side} x {side} pixels, {each} tokens each: "
            f"{images['image_tokens']} image + {images['text_tokens']} text tokens per sample"
        )
    elif images:
        lines += textwrap.wrap(f"images: none ({images['note'] or '--images 0: text only'})", width=100,
                               subsequent_indent="  ")  # fmt: skip
    if result.get("encoder_decoder"):
        lines.append(f"encoder-decoder: the encoder and the decoder each run seq {result['seq']} tokens")
    return lines


def format_forward(result: dict) -> str:
    """The planner's result as a compact table for a person: totals and the relative change on top."""
    eager, patched = result["eager_saved_bytes"], result["patched_saved_bytes"]
    source = result["config"] or "a config"
    attention = result["attention"]
    kernels = ", ".join(attention["kernels"])
    used = attention["implementation"] + (f" ({kernels} kernel)" if kernels else "")
    lines = [
        f"invact plan: {result['model_class']} from {source}",
        f"batch {result['batch']} x seq {result['seq']}, {result['dtype']}, one training forward"
        f"{' with labels (the loss)' if result['labels'] else ', no labels'}; "
        f"attention: {used}",
        *_input_lines(result),
        "",
        f"saved for backward: eager {_bytes(eager)} -> patch() {_bytes(patched)}: "
        f"{_change(eager, patched)} ({_bytes(patched - eager)})",
        "",
    ]
    rows = [(k["label"], k["eager_bytes"], k["patched_bytes"]) for k in result["kinds"]]
    rows = [r for r in rows if r[1] or r[2]]
    header = ("", "eager", "patch()", "change")
    table = [header] + [(label, _bytes(e), _bytes(p), _change(e, p)) for label, e, p in rows]
    table.append(("total", _bytes(eager), _bytes(patched), _change(eager, patched)))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for i, (label, *figures) in enumerate(table):
        if i == len(table) - 1:
            lines.append("-" * (sum(widths) + 2 * 3))
        cells = [f"{label:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(figures, widths[1:], strict=True)]
        lines.append("  ".join(cells))
    vision = result.get("vision_eager_bytes", 0), result.get("vision_patched_bytes", 0)
    if any(vision):
        lines += ["", f"of which the vision tower and projector: eager {_bytes(vision[0])} -> patch() "
                      f"{_bytes(vision[1])}: {_change(*vision)}"]  # fmt: skip
    returned = ", image features" if result.get("images") else ""
    lines += [
        "",
        f"not counted: the output (eager's logits{', loss' if result['labels'] else ''}{returned}) "
        f"{_bytes(result['output_bytes'])}, after patch() {_bytes(result['patched_output_bytes'])}; "
        f"parameters and buffers {_bytes(result['parameter_bytes'])}",
        "",
        *_decision_lines(result["decisions"]),
        "",
        *textwrap.wrap(
            "Bytes autograd saves for backward in one training forward of input_ids (batch, seq), each "
            "storage once, parameters and buffers excluded; measured on the meta device (shapes only). "
            "invact plan --help explains the kinds.",
            width=100,
        ),
    ]
    return "\n".join(lines)


_CHECKPOINTING = {False: "off", True: "on"}


def _recipe_label(result: dict, name: str) -> str:
    labels = {"lora": f"LoRA r{result['rank']} (bf16)", "mixed": "full (mixed: fp32 + bf16 autocast)",
              "qlora": f"QLoRA r{result['rank']} (nf4)"}  # fmt: skip
    return labels.get(name, "full (bf16)")


def _step_heading(result: dict) -> list[str]:
    """What a step's table answers: the model, the sharding, what was searched or planned."""
    searched = result["searched"]
    source = result["config"] or "a config"
    lines = [f"invact plan: {result['model_class']} from {source}"]
    ranks, tp = result.get("ranks"), result.get("tp")
    if tp:
        groups = f", FSDP2 over {ranks // tp} such groups" if ranks and ranks > tp else ""
        lines += textwrap.wrap(
            f"per GPU of {tp} training with transformers' tensor parallelism (its tp_plan), all {tp} on the "
            f"batch and sequence below{groups}",
            width=100,
        )
    elif ranks:
        lines += textwrap.wrap(
            f"per GPU of {ranks} training with FSDP2 (fully_shard on each decoder layer, then the root), "
            "each with the batch and sequence below",
            width=100,
        )
    if searched == "seq":
        lines.append(
            f"the longest sequence (a multiple of {SEQ_MULTIPLE}, at most {result['cap']}) at batch "
            f"{result['batch']} whose training step fits in {_bytes(result['fits_bytes'])}"
        )
    elif searched == "batch":
        lines.append(
            f"the largest batch (at most {result['cap']}) at seq {result['seq']} whose training step "
            f"fits in {_bytes(result['fits_bytes'])}"
        )
    else:
        lines.append(f"the peak of one training step at batch {result['batch']} x seq {result['seq']}")
    return lines + [
        f"(forward with labels, loss, backward, AdamW, as on {result['device']}; predicted on the meta "
        "device: peak of live bytes)",
        "",
    ]


def _answer(result: dict, row: dict) -> str:
    """A row's answer: its peak, or what fits ("none", ">=" at the search's cap)."""
    searched = result["searched"]
    if not searched:
        return _bytes(row["peak_bytes"])
    value = row[searched]
    if not value:
        return "none"
    return f">={value}" if value >= result["cap"] else str(value)


def _ratio(result: dict, eager: dict, patched: dict) -> str:
    """patch()'s answer against eager's: the peak's change, or the ratio of what fits."""
    searched = result["searched"]
    if not searched:
        return _change(eager["peak_bytes"], patched["peak_bytes"])
    if not eager[searched]:
        return "-" if not patched[searched] else "new"
    capped = ">=" if patched[searched] >= result["cap"] else ""
    return f"{capped}{patched[searched] / eager[searched]:.2f}x"


def _step_table(result: dict) -> list[str]:
    """One line per recipe and checkpointing: eager's and patch()'s answer and their ratio."""
    searched = result["searched"]
    rows = {(r["recipe"], r["patched"], r["checkpointing"]): r for r in result["rows"]}
    what = {"seq": "seq", "batch": "batch", None: "peak"}[searched]
    change = "patch()/eager" if searched else "change"
    table = [("recipe", "checkpointing", f"eager {what}", f"patch() {what}", change)]
    for name in dict.fromkeys(r["recipe"] for r in result["rows"]):
        for checkpointing in (False, True):
            eager, patched = rows[name, False, checkpointing], rows[name, True, checkpointing]
            table.append((_recipe_label(result, name), _CHECKPOINTING[checkpointing], _answer(result, eager),
                          _answer(result, patched), _ratio(result, eager, patched)))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    return [
        "  ".join(
            [
                f"{row[0]:<{widths[0]}}",
                f"{row[1]:<{widths[1]}}",
                *(f"{c:>{w}}" for c, w in zip(row[2:], widths[2:], strict=True)),
            ]
        )  # fmt: skip
        for row in table
    ]


def _explained(result: dict) -> list[str]:
    """--explain's lines: each peak's terms (TERMS), live at the peak."""
    lines = ["", "where each peak's bytes are (live at the peak):"]
    for r in result["rows"]:
        head = (
            f"{_recipe_label(result, r['recipe'])}, checkpointing {_CHECKPOINTING[r['checkpointing']]}, "
            f"{'patch()' if r['patched'] else 'eager'}: batch {r['batch']} x seq {r['seq']}, peak "
            f"{_bytes(r['peak_bytes'])} in the {r['phase']} (last op {r['op']})"
        )
        lines += textwrap.wrap(head, width=100, subsequent_indent="    ")
        for key, label in TERMS.items():
            if r["terms"][key]:
                lines.append(f"    {_bytes(r['terms'][key]):>11}  {label}")
    return lines


def format_step(result: dict, explain: bool = False) -> str:
    """step_peaks' result as a table: per recipe and checkpointing, eager's and patch()'s answer (with
    --fits: the longest sequence or the largest batch that fits; else the peak), and the ratio; with
    `explain` each peak's terms."""
    lines = _step_heading(result) + _step_table(result) + (_explained(result) if explain else [])
    lines += [""] + textwrap.wrap(
        "Peak of live bytes: what torch's allocator is asked for at the step's busiest moment (CUDA's "
        "max_memory_allocated, less its rounding to 512-byte blocks and kernels' workspaces); a GPU also "
        "holds the CUDA context and the allocator's cache. invact plan --help says what each recipe is.",
        width=100,
    )
    return "\n".join(lines)
