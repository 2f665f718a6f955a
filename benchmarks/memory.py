"""Saved-activation memory of transformer models: torch eager, InvAct (bits, precision-bit, gated,
and patch()'s default with inverted norms) and torch.compile (default, with activation_memory_budget,
and on the patched model), against the ideal saving and the paper.

Every model is built from a transformers config with random weights (nothing is downloaded), in
train mode, batch 1, fp32 (or --dtype bfloat16), SDPA attention, all dropout probabilities 0 (with
attention dropout > 0 CPU attention keeps its probability matrix, and the share saved falls). Bytes
are what autograd saves in one forward pass (invact.memory.saved_tensors: distinct storages,
parameters excluded). The torch.compile columns use invact.memory.inductor_partition: inductor's
decompositions, joint-graph passes and min-cut partitioner (the same decision of what to save), without
inductor's code generation.

The ideal: per activation call, its input (n * 4 bytes) is no longer saved and ceil(n / 8) bytes of
bits are. "InvAct gated" is invact.patch's default, which also keeps a gated MLP's down projection from
saving the product act(g) * u (recomputed in backward from the y and u the multiply saves; invact.mlp.gated):
its ideal adds the bytes of every such product a down projection is given. Where g and u are halves of
one fused gate_up output (Phi-3, MoE experts) the activation-only patch frees nothing (u keeps that
output saved; "InvAct bits" adds the bits there) and the gated path moves y and u into that output
(freeing y's own storage), so the ideal holds for it alone. The gated families beyond Llama and
Mistral are scaled down (4 layers of 512, seq 512).
"InvAct gated" replaces activations only (norms=False); "patch()" is invact.patch's default, which
also inverts the norms (invact.norm: each keeps its output and rstd, not its input). "norms held" is
what the eager norms save beyond their outputs (inside the norm modules, parameters excluded);
"Liger RMSNorm (computed)" is eager with each norm keeping, instead, its input (in its dtype) and an
fp32 rstd per row, as Liger-Kernel's RMSNorm saves X and rstd (computed from the same forward, not run).
invact.memory counts what it saves exactly (a test checks it against the profiler's net memory held
after the forward). Prints a markdown table and writes benchmarks/results/memory_<device>.{json,md}.

--lm: causal LMs with real vocabularies called with labels (measure_lm), as a training step calls them,
so the loss is computed: eager, patch(loss=False) and patch(), the head and loss as `invact plan`
attributes them, and Liger-Kernel's fused loss, RMSNorm and SwiGLU computed from the eager forward;
writes benchmarks/results/memory_lm_cpu[_bfloat16].{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import invact
from invact.activation import REPLACEABLE
from invact.memory import inductor_partition, saved_tensors

RESULTS = Path(__file__).resolve().parent / "results"
# The paper's memory table: share of saved activation memory InvAct removes.
PAPER = {"BERT-base": -22.9, "AST": -24.0, "ViT-B/16": -23.8, "CLIP ViT-L/14": -23.4}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@dataclass
class Case:
    name: str
    setup: str  # what the input is
    build: Callable[[bool], tuple[nn.Module, dict]]  # small -> (model, inputs)
    # g and u are halves of one gate_up output (some MLP of the model): there the activation alone
    # frees nothing, and only the gated path reaches the ideal
    fused_gate_up: bool = False


def _bert(small):
    from transformers import BertConfig, BertModel

    seq = 64 if small else 1024
    cfg = BertConfig(max_position_embeddings=seq, **NO_DROPOUT, attn_implementation="sdpa",
                     **(_TINY if small else {}))  # fmt: skip
    return BertModel(cfg), {"input_ids": torch.randint(0, 1000, (1, seq))}


def _ast(small):
    from transformers import ASTConfig, ASTModel

    length, bins = (128, 32) if small else (1024, 128)
    cfg = ASTConfig(max_length=length, num_mel_bins=bins, **NO_DROPOUT, attn_implementation="sdpa",
                    **(_TINY if small else {}))  # fmt: skip
    return ASTModel(cfg), {"input_values": torch.randn(1, length, bins)}


def _vit(small):
    from transformers import ViTConfig, ViTModel

    size = 32 if small else 224
    shape = {"image_size": size, "patch_size": 8 if small else 16, **(_TINY if small else {})}
    cfg = ViTConfig(**shape, **NO_DROPOUT, attn_implementation="sdpa")
    return ViTModel(cfg), {"pixel_values": torch.randn(1, 3, size, size)}


def _clip(small):
    from transformers import CLIPConfig, CLIPModel

    if small:
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      image_size=32, patch_size=8)  # fmt: skip
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    else:  # ViT-L/14 at 224 and CLIP's text tower; both use quick_gelu
        vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      image_size=224, patch_size=14)  # fmt: skip
        text = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    cfg = CLIPConfig(text_config={**text, "max_position_embeddings": 77}, vision_config=vision,
                     projection_dim=64 if small else 768, attn_implementation="sdpa")  # fmt: skip
    size = vision["image_size"]
    inputs = {"input_ids": torch.randint(0, 1000, (1, 77)), "pixel_values": torch.randn(1, 3, size, size)}
    return CLIPModel(cfg), inputs


def _gpt2(small):
    from transformers import GPT2Config, GPT2Model

    seq = 64 if small else 1024
    shape = {"n_positions": seq, **({"n_embd": 64, "n_layer": 2, "n_head": 4} if small else {})}
    cfg = GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return GPT2Model(cfg), {"input_ids": torch.randint(0, 1000, (1, seq))}


def _decoder(kind):
    def build(small):
        from transformers import LlamaConfig, LlamaModel, MistralConfig, MistralModel

        config_cls, model_cls = (
            (LlamaConfig, LlamaModel) if kind == "llama" else (MistralConfig, MistralModel)
        )
        size = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2) if small else
                dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4))  # fmt: skip
        seq = 64 if small else 1024
        cfg = config_cls(**size, vocab_size=32000, attn_implementation="sdpa")
        return model_cls(cfg), {"input_ids": torch.randint(0, 1000, (1, seq))}

    return build


# The other gated-MLP families, scaled down (4 layers of 512; real sizes do not fit a CPU run): their
# config class, model class and the keywords that shape their MLPs.
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 704}
_MIXTRAL = {"num_local_experts": 8, "num_experts_per_tok": 2}
FUSED = (  # the families with a fused gate_up output in some MLP (the MoE experts compute one)
    "Phi-3 (fused gate_up_proj)",
    "Mixtral (8 experts, top-2)",
    "Qwen2-MoE (8 experts, top-2, shared expert)",
    "Qwen3-MoE (8 experts, top-2)",
)
GATED_FAMILIES = {
    "Qwen2": ("Qwen2Config", "Qwen2Model", {}),
    "Qwen3": ("Qwen3Config", "Qwen3Model", {"head_dim": 64}),
    "Gemma (GeGLU, tanh-GELU)": ("GemmaConfig", "GemmaModel", {"head_dim": 64}),
    # transformers runs Gemma2's soft-capped attention in eager mode only (no SDPA)
    "Gemma2 (GeGLU, tanh-GELU, eager attention)": (
        "Gemma2Config",
        "Gemma2Model",
        {"head_dim": 64, "attn_implementation": "eager"},
    ),
    "Phi-3 (fused gate_up_proj)": ("Phi3Config", "Phi3Model", {"pad_token_id": 0}),
    "Mixtral (8 experts, top-2)": ("MixtralConfig", "MixtralModel", _MIXTRAL),
    "Qwen2-MoE (8 experts, top-2, shared expert)": (
        "Qwen2MoeConfig",
        "Qwen2MoeModel",
        {**_MOE, "shared_expert_intermediate_size": 1408},
    ),
    "Qwen3-MoE (8 experts, top-2)": ("Qwen3MoeConfig", "Qwen3MoeModel", {**_MOE, "head_dim": 64}),
}


def _gated_family(label):
    def build(small):
        import transformers

        config_cls, model_cls, extra = GATED_FAMILIES[label]
        size = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2) if small else
                dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4))  # fmt: skip
        if small:  # shrink the MoE and head sizes with the rest
            shrink = ("intermediate_size", "head_dim")
            extra = {k: min(v, 64) if k.endswith(shrink) else v for k, v in extra.items()}
        seq = 64 if small else 512
        extra = {"attn_implementation": "sdpa", **extra}
        cfg = getattr(transformers, config_cls)(**size, **extra, vocab_size=32000)
        return getattr(transformers, model_cls)(cfg), {"input_ids": torch.randint(0, 1000, (1, seq))}

    return build


def _t5(small):
    from transformers import T5Config, T5EncoderModel

    size = (dict(d_model=64, d_ff=176, num_layers=2, num_heads=4, d_kv=16) if small else
            dict(d_model=512, d_ff=1408, num_layers=4, num_heads=8, d_kv=64))  # fmt: skip
    seq = 64 if small else 512
    cfg = T5Config(**size, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    return T5EncoderModel(cfg), {"input_ids": torch.randint(0, 1000, (1, seq))}


_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}

CASES = [
    Case("BERT-base", "seq 1024", _bert),
    Case("AST", "1024 x 128 spectrogram", _ast),
    Case("ViT-B/16", "224 x 224", _vit),
    Case("CLIP ViT-L/14", "224 x 224 image + 77 tokens", _clip),
    Case("GPT-2 (gelu_new)", "seq 1024", _gpt2),
    Case("Llama-style SwiGLU (8 x 1024)", "seq 1024", _decoder("llama")),
    Case("Mistral-style SwiGLU (8 x 1024)", "seq 1024", _decoder("mistral")),
    *(Case(f"{name} (4 x 512)", "seq 512", _gated_family(name), name in FUSED) for name in GATED_FAMILIES),
    Case("T5 encoder, gated-gelu (4 x 512)", "seq 512", _t5),
]


class _Call(nn.Module):
    """model(**inputs) as a module of no arguments, so saved_tensors() can run it."""

    def __init__(self, model: nn.Module, inputs: dict):
        super().__init__()
        self.model, self.inputs = model, inputs

    def forward(self):
        out = self.model(**self.inputs)
        if getattr(out, "loss", None) is not None:  # a causal LM called with labels
            return out.loss
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits_per_image


def _ideal_saving(model: nn.Module, inputs: dict) -> int:
    sizes = []
    activations = [
        m for m in model.modules() if f"{type(m).__module__}.{type(m).__qualname__}" in REPLACEABLE
    ]
    hooks = [m.register_forward_hook(lambda mod, i, o: sizes.append((o.numel(), o.element_size())))
             for m in activations]  # fmt: skip
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    return sum(n * size - (n + 7) // 8 for n, size in sizes)  # its input no longer, ceil(n / 8) bytes of bits


def _norms(model: nn.Module, inputs: dict) -> tuple[int, int]:
    """(bytes the eager norms save beyond their outputs, bytes Liger's RMSNorm would keep instead: each
    call's input in its dtype and an fp32 rstd per row), from one training forward."""
    from invact.memory import parameter_storages, storage_id
    from invact.norm import is_candidate

    params = parameter_storages(model)
    inside, outputs, saved, liger = [], {}, {}, []

    def enter(_module, args) -> None:
        inside.append(1)
        x = args[0]
        liger.append(x.numel() * x.element_size() + 4 * (x.numel() // x.shape[-1]))

    def leave(_module, _args, y) -> None:
        inside.pop()
        outputs[storage_id(y)] = y  # held to the end: no later tensor takes its address

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside:
            saved[storage_id(t)] = t.untyped_storage().nbytes()
        return t

    hooks = []
    for m in model.modules():
        if is_candidate(m):
            hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _Call(model, inputs)()
    finally:
        for h in hooks:
            h.remove()
    return sum(n for ptr, n in saved.items() if ptr not in params and ptr not in outputs), sum(liger)


def _gated_products(model: nn.Module, inputs: dict) -> int:
    """Bytes of the gated products act(g) * u that ops of the model, patched with gated=False, save
    (one training forward, each storage once): what the gated path stops saving."""
    from invact.mlp.gated import _product_node

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _product_node(t) is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _Call(model, inputs)()
    del out
    return sum(seen.values())


def _compiled_bytes(model: nn.Module, inputs: dict, budget: float | None = None) -> int:
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=1.0 if budget is None else budget):
        compiled = torch.compile(_Call(model, inputs), backend=inductor_partition)
        saved_tensors(compiled)  # compile outside the measurement
        return saved_tensors(compiled).saved_bytes


def measure(case: Case, small: bool, compile_columns: bool, budget: float, dtype=torch.float32) -> dict:
    torch.manual_seed(0)
    model, inputs = case.build(small)
    model.to(dtype).train()
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    row = {"model": case.name, "setup": case.setup if not small else "tiny config (smoke run)"}
    row["fused_gate_up"] = case.fused_gate_up
    row["torch_eager"] = saved_tensors(_Call(model, inputs)).saved_bytes
    row["ideal_saving"] = _ideal_saving(model, inputs)
    if compile_columns:
        row["compile_default"] = _compiled_bytes(model, inputs, None)
        row["compile_budget"] = _compiled_bytes(model, inputs, budget)
    row["norms_held"], liger = _norms(model, inputs)
    row["liger_rmsnorm"] = row["torch_eager"] - row["norms_held"] + liger
    row["replaced"] = len(invact.patch(model, gated=False, norms=False))  # activations only
    row["invact_bits"] = saved_tensors(_Call(model, inputs)).saved_bytes
    row["ideal_gated_saving"] = row["ideal_saving"] + _gated_products(model, inputs)
    invact.patch(model, mode="precision_bit", gated=False, norms=False)
    row["invact_precision_bit"] = saved_tensors(_Call(model, inputs)).saved_bytes
    invact.patch(model, norms=False)  # bits mode, and the gated products recomputed
    row["invact_gated"] = saved_tensors(_Call(model, inputs)).saved_bytes
    # the default, norms inverted too: patch() names the norms alone (the activations are InvAct in bits
    # mode already, so nothing switches)
    row["norms_replaced"] = len(invact.patch(model))
    row["invact_patch"] = saved_tensors(_Call(model, inputs)).saved_bytes
    if compile_columns:
        row["compile_patch"] = _compiled_bytes(model, inputs)
        row["compile_patch_budget"] = _compiled_bytes(model, inputs, budget)
    row["paper_percent"] = PAPER.get(case.name)
    del model
    gc.collect()
    return row


# Causal LMs called with labels, as a training step calls them: the loss is computed, and eager's
# fp32 log-softmax over the vocabulary is saved. Real vocabularies, small widths (4 layers of 256, seq
# 512): label -> (config class, model class, config keywords).
LM_FAMILIES = {
    "Llama-3-style (vocabulary 128256)": ("LlamaConfig", "LlamaForCausalLM", {"vocab_size": 128256}),
    "Qwen2.5-style (vocabulary 151936, tied)": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"vocab_size": 151936, "tie_word_embeddings": True},
    ),
    "Gemma-2-style (vocabulary 256000, softcap 30, eager attention)": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "vocab_size": 256000,
            "head_dim": 64,
            "final_logit_softcapping": 30.0,
            "attn_implementation": "eager",
        },
    ),
}


def _lm(label: str, small: bool) -> tuple[nn.Module, dict]:
    import transformers

    config_cls, model_cls, extra = LM_FAMILIES[label]
    size = (dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if small else
            dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2))  # fmt: skip
    if small:
        extra = (
            {**extra, "vocab_size": 4000, "head_dim": 16}
            if "head_dim" in extra
            else {**extra, "vocab_size": 4000}
        )
    seq = 64 if small else 512
    cfg = getattr(transformers, config_cls)(**size, **{"attn_implementation": "sdpa", **extra})
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    return getattr(transformers, model_cls)(cfg), {"input_ids": ids, "labels": ids}


def _by_kind(model: nn.Module, inputs: dict) -> tuple[int, dict[str, int]]:
    """(bytes saved, bytes per kind) of one training forward, attributed as invact plan attributes them
    (invact.planner: the head and the loss are their own kind)."""
    from invact.planner.forward import _Attributed

    counter = _Attributed(model)
    try:
        with counter:
            out = model(**inputs)
            kinds = counter.by_kind()
        del out
    finally:
        counter.remove()
    return counter.report.saved_bytes, kinds


def measure_lm(label: str, small: bool, dtype=torch.float32, compile_columns: bool = True) -> dict:
    """A causal LM with labels: eager, patch(loss=False), patch(); what the head and loss hold; and
    Liger-Kernel's FusedLinearCrossEntropy + RMSNorm + SwiGLU/GeGLU computed from the eager forward:
    its fused loss keeps grad_input (tokens x hidden) and grad_weight (vocab x hidden), in the model's
    dtype, from forward to backward (liger_kernel/ops/fused_linear_cross_entropy.py computes both in
    the forward) instead of eager's head and loss; its RMSNorm keeps each call's input and an fp32
    rstd per row (_norms); its SiLU/GELU-mul keeps g and u and recomputes act(g), so act(g) * u's
    factor act(g) is no longer saved. With compile_columns, torch.compile of the model and of the
    patched model (the loss as invact's op where the head feeds the loss function, straight or
    through the soft-cap or scale invact.loss reads from the forward's source)."""
    torch.manual_seed(0)
    model, inputs = _lm(label, small)
    model.to(dtype).train()
    cfg = model.config
    tokens = inputs["input_ids"].numel()
    row = {"model": label, "setup": f"seq {tokens}" if not small else "tiny config (smoke run)"}
    row["torch_eager"], kinds = _by_kind(model, inputs)
    row["eager_head_loss"] = kinds["head_loss"]
    row["norms_held"], liger_norms = _norms(model, inputs)
    size = torch.finfo(dtype).bits // 8
    activation_outputs = cfg.num_hidden_layers * tokens * cfg.intermediate_size * size
    flce = (tokens + cfg.vocab_size) * cfg.hidden_size * size
    eager = row["torch_eager"]
    row["liger_computed"] = (
        eager - row["eager_head_loss"] + flce - row["norms_held"] + liger_norms - activation_outputs
    )
    if compile_columns:
        row["compile_default"] = _compiled_bytes(model, inputs)
    invact.patch(model, loss=False)
    row["invact_no_loss"], _ = _by_kind(model, inputs)
    invact.patch(model)
    row["invact_patch"], kinds = _by_kind(model, inputs)
    row["patch_head_loss"] = kinds["head_loss"]
    if compile_columns:
        row["compile_patch"] = _compiled_bytes(model, inputs)
    row["fp32_logits"] = tokens * cfg.vocab_size * 4
    del model
    gc.collect()
    return row


def markdown_lm(rows: list[dict]) -> str:
    compiled = all("compile_patch" in r for r in rows)
    head = ["model", "input", "torch eager", "head + loss, eager", "patch(loss=False)", "patch()",
            "head + loss, patch()", "Liger FLCE + RMSNorm + SwiGLU (computed)"]  # fmt: skip
    head += ["torch.compile", "torch.compile + patch()"] if compiled else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = r["torch_eager"]
        cells = [r["model"], r["setup"], f"{base / 2**20:.0f} MiB", f"{r['eager_head_loss'] / 2**20:.1f} MiB",
                 _pct(r["invact_no_loss"], base), _pct(r["invact_patch"], base),
                 f"{r['patch_head_loss'] / 2**10:.1f} KiB", _pct(r["liger_computed"], base)]  # fmt: skip
        cells += [_pct(r["compile_default"], base), _pct(r["compile_patch"], base)] if compiled else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(new: int, old: int) -> str:
    return f"{100 * (new / old - 1):+.1f}%"


def markdown(rows: list[dict], budget: float) -> str:
    head = ["model", "input", "torch eager", "InvAct bits", "InvAct precision-bit", "InvAct gated", "patch()",
            "norms held", "Liger RMSNorm (computed)"]  # fmt: skip
    has_compile = "compile_default" in rows[0]
    if has_compile:
        head += [
            "torch.compile",
            f"torch.compile, budget {budget}",
            "torch.compile + patch()",
            f"torch.compile + patch(), budget {budget}",
        ]
    head += ["ideal", "achieved / ideal", "gated ideal", "gated achieved / ideal", "paper"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = r["torch_eager"]
        cells = [r["model"], r["setup"], f"{base / 2**20:.0f} MiB", _pct(r["invact_bits"], base),
                 _pct(r["invact_precision_bit"], base), _pct(r["invact_gated"], base),
                 _pct(r["invact_patch"], base), f"{100 * r['norms_held'] / base:.1f}%",
                 _pct(r["liger_rmsnorm"], base)]  # fmt: skip
        if has_compile:
            cells += [_pct(r["compile_default"], base), _pct(r["compile_budget"], base),
                      _pct(r["compile_patch"], base), _pct(r["compile_patch_budget"], base)]  # fmt: skip
        achieved = (base - r["invact_bits"]) / r["ideal_saving"] if r["ideal_saving"] else float("nan")
        paper = f"{r['paper_percent']:+.1f}%" if r["paper_percent"] is not None else ""
        gated_ideal = _pct(base - r["ideal_gated_saving"], base)
        ideal_gated = r["ideal_gated_saving"]
        gated = (base - r["invact_gated"]) / ideal_gated if ideal_gated else float("nan")
        cells += [_pct(base - r["ideal_saving"], base), f"{100 * achieved:.0f}%", gated_ideal]
        cells += [f"{100 * gated:.1f}%", paper]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The rows the README's memory table shows (the paper's models, GPT-2 and one of each decoder family).
README_ROWS = (
    "BERT-base",
    "AST",
    "ViT-B/16",
    "CLIP ViT-L/14",
    "GPT-2 (gelu_new)",
    "Llama-style SwiGLU (8 x 1024)",
    "Qwen3 (4 x 512)",
    "Gemma2 (GeGLU, tanh-GELU, eager attention) (4 x 512)",
    "Phi-3 (fused gate_up_proj) (4 x 512)",
    "Mixtral (8 experts, top-2) (4 x 512)",
    "Qwen3-MoE (8 experts, top-2) (4 x 512)",
)


def readme_table(rows: list[dict], budget: float) -> str:
    """The README's memory table, from a result's rows (README_ROWS, in their order)."""
    head = ["model", "input", "torch eager", "invact", "invact, no norms", "torch.compile",
            "torch.compile + invact", f"torch.compile, budget {budget}",
            f"torch.compile + invact, budget {budget}", "paper"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_name = {r["model"]: r for r in rows}
    for name in README_ROWS:
        r = by_name[name]
        base = r["torch_eager"]
        paper = f"{r['paper_percent']:+.1f}%" if r["paper_percent"] is not None else ""
        cells = [name, r["setup"], f"{base / 2**20:.0f} MiB", _pct(r["invact_patch"], base),
                 _pct(r["invact_gated"], base), _pct(r["compile_default"], base),
                 _pct(r["compile_patch"], base), _pct(r["compile_budget"], base),
                 _pct(r["compile_patch_budget"], base), paper]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny configs: a smoke run for CI")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    parser.add_argument("--budget", type=float, default=0.5, help="activation_memory_budget (default 0.5)")
    parser.add_argument("--only", nargs="*", help="run only models whose name contains one of these words")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the models' dtype (default float32)")  # fmt: skip
    parser.add_argument("--out", type=Path,
                        help="output stem (default benchmarks/results/memory_cpu[_bfloat16])")  # fmt: skip
    parser.add_argument(
        "--lm",
        action="store_true",
        help="the causal LMs called with labels instead (default stem memory_lm_cpu[_bfloat16])",
    )
    parser.add_argument("--update", action="store_true",
                        help="measure the --only rows again and replace them in the existing result, "
                             "which notes them as re-measured")  # fmt: skip
    parser.add_argument("--readme", action="store_true",
                        help="print the README's table from the existing result and exit")  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 1:
        parser.error("--budget must be in (0, 1]")
    if args.lm:
        if args.update or args.readme:
            parser.error("--update and --readme are for the models' table, not --lm")
        return _main_lm(args)
    stem = args.out or RESULTS / ("memory_cpu" if args.dtype == "float32" else f"memory_cpu_{args.dtype}")
    if args.readme:
        result = json.loads(stem.with_suffix(".json").read_text())
        print(readme_table(result["rows"], result["settings"]["budget"]))
        return 0
    cases = [c for c in CASES if not args.only or any(w.lower() in c.name.lower() for w in args.only)]
    if not cases:
        parser.error(f"--only {args.only} matches none of: {', '.join(c.name for c in CASES)}")
    if args.update and not (args.only and stem.with_suffix(".json").exists()):
        parser.error(f"--update needs --only and an existing {stem.with_suffix('.json')}")
    dtype = getattr(torch, args.dtype)
    rows = _each(
        cases, lambda c: c.name, lambda c: measure(c, args.small, not args.no_compile, args.budget, dtype)
    )
    import transformers

    from timing import device_name

    remeasured = []
    if args.update:
        earlier = json.loads(stem.with_suffix(".json").read_text())
        if earlier["settings"]["budget"] != args.budget or earlier["settings"]["small"] != args.small:
            parser.error("--update: the existing result has another --budget or --small")
        fresh = {r["model"]: r for r in rows}
        remeasured = sorted(set(earlier["settings"].get("remeasured", [])) | set(fresh))
        rows = [fresh.get(r["model"], r) for r in earlier["rows"]]
    table = markdown(rows, args.budget)
    print("\n" + table)
    result = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "settings": {
            "small": args.small,
            "budget": args.budget,
            "dtype": args.dtype,
            "batch": 1,
            "attention": "sdpa",
            "dropout": 0.0,
            "compile_backend": "invact.memory.inductor_partition",
            **({"remeasured": remeasured} if remeasured else {}),
        },  # fmt: skip
        "rows": rows,
    }
    return _write(stem, result, table)


def _each(items: list, name: Callable[[object], str], measure_one: Callable[[object], dict]) -> list[dict]:
    """measure_one(item) for each item, saying how long each took."""
    rows = []
    for item in items:
        t0 = time.perf_counter()
        rows.append(measure_one(item))
        print(f"measured {name(item)} in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def _write(stem: Path, result: dict, table: str) -> int:
    """The result as <stem>.json and its table as <stem>.md; exit status 0."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(table + "\n")
    print(f"\nwritten to {stem.with_suffix('.json')} and .md")
    return 0


def _main_lm(args) -> int:
    import transformers

    from timing import device_name

    labels = [k for k in LM_FAMILIES if not args.only or any(w.lower() in k.lower() for w in args.only)]
    rows = _each(labels, str, lambda label: measure_lm(label, args.small, getattr(torch, args.dtype),
                                                       not args.no_compile))  # fmt: skip
    table = markdown_lm(rows)
    print("\n" + table)
    result = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "settings": {
            "small": args.small,
            "dtype": args.dtype,
            "batch": 1,
            "labels": True,
            "dropout": "config's",
            "compile_backend": "invact.memory.inductor_partition",
        },
        "rows": rows,
    }
    name = "memory_lm_cpu" if args.dtype == "float32" else f"memory_lm_cpu_{args.dtype}"
    stem = args.out or RESULTS / name
    return _write(stem, result, table)


if __name__ == "__main__":
    raise SystemExit(main())
