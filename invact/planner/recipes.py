"""The ways people fine-tune, as a step is planned for them (RECIPES): "bf16", the model and AdamW's
state in bf16; "mixed", fp32 weights and AdamW state, the forward under autocast to bf16 (on the meta
device invact.planner.autocast's rules for the device planned for); "lora", a frozen bf16 base with
PEFT's LoRA adapters (bf16, rank `rank`, dropout 0) on every Linear but the output head, AdamW on them;
"qlora", the base in bitsandbytes' 4-bit NormalFloat with double quantization and the rest in float32
(invact.planner.quantized: as transformers loads it and PEFT's prepare_model_for_kbit_training leaves
it), PEFT's LoRA adapters in float32 (PEFT's default for a 16-bit or quantized base) on every Linear but
the head, the forward under autocast to bf16 (a Trainer's bf16=True). Each with or without Hugging
Face's gradient checkpointing (`enable_checkpointing`: torch's non-reentrant checkpoint around every
decoder layer). Imports peft (and bitsandbytes) only when a recipe needs it."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from invact.planner.options import RECIPE_LABELS, PlanError


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A way people fine-tune: the dtype the model is built in, whether the base is frozen under LoRA
    adapters, the dtype autocast computes in (None: no autocast), whether the base is quantized to 4
    bits (QLoRA: invact.planner.quantized; the adapters then in float32)."""

    name: str
    label: str
    dtype: torch.dtype
    lora: bool = False
    autocast: torch.dtype | None = None
    quantized: bool = False


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("bf16", RECIPE_LABELS["bf16"], torch.bfloat16),
        Recipe(
            "mixed",
            RECIPE_LABELS["mixed"],
            torch.float32,
            autocast=torch.bfloat16,
        ),  # fmt: skip
        Recipe(
            "lora",
            RECIPE_LABELS["lora"],
            torch.bfloat16,
            lora=True,
        ),  # fmt: skip
        Recipe(
            "qlora",
            RECIPE_LABELS["qlora"],
            torch.bfloat16,
            lora=True,
            autocast=torch.bfloat16,
            quantized=True,
        ),
    )
}


def enable_checkpointing(model: nn.Module, context_fn=None) -> None:
    """Hugging Face's gradient checkpointing as training code turns it on (transformers 5:
    activation_checkpointing_enable; before: gradient_checkpointing_enable), torch's non-reentrant
    checkpoint around each decoder layer; `context_fn` checkpoint's, where given."""
    kwargs = {"use_reentrant": False, **({"context_fn": context_fn} if context_fn else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(kwargs)
        else:
            model.gradient_checkpointing_enable(kwargs)


def disable_checkpointing(model: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()


def add_lora(model: nn.Module, rank: int, *, float32: bool = False) -> nn.Module:
    """`model` with PEFT's LoRA adapters of `rank` (alpha 2 x rank, dropout 0, in the base's dtype, or
    with `float32` in float32 as PEFT makes them by default) on every Linear but the output head (PEFT's
    "all-linear"), the base frozen. PlanError without peft."""
    try:
        import peft
    except ImportError:
        raise PlanError("the lora recipe needs PEFT: pip install peft") from None
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, config, autocast_adapter_dtype=float32)
