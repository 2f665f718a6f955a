"""What `invact plan` accepts, without torch: the dtype names, the default image side, the recipes'
names and labels, the terms of a step's peak, the devices, the step of the sequence search, how a size
such as 24GiB is read, and PlanError, the planner's one-line refusal. invact.cli checks a command's
arguments against these before torch loads (a bad one answers in one line, at once); the planner's
modules build their torch objects from the same names."""

from __future__ import annotations

import re

# dtype names the planner takes -> the torch dtype's name (invact.planner.config.DTYPES maps them to dtypes)
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# The side, in pixels, of the square images a tower without a fixed image size (Qwen2-VL's and
# Qwen2.5-VL's: any multiple of patch x merge) gets unless image_size says otherwise: 448 x 448 is a
# (1, 32, 32) grid of 14-pixel patches, 256 tokens after the 2 x 2 merge.
DEFAULT_IMAGE_SIDE = 448

# The training recipes a step is planned for: name -> what it trains (invact.planner.recipes.RECIPES
# adds the dtypes).
RECIPE_LABELS: dict[str, str] = {
    "bf16": "full fine-tuning in bf16 (weights, gradients, AdamW state)",
    "mixed": "mixed precision: fp32 weights, autocast to bf16, AdamW in fp32",
    "lora": "LoRA: frozen bf16 base, bf16 adapters on every Linear but the head",
    "qlora": "QLoRA: nf4 base (double quantization), fp32 adapters on every Linear but the head, autocast to "
    "bf16 (needs bitsandbytes)",
}
# The recipes planned unless others are asked for: full fine-tuning and LoRA, in bf16 (mixed precision
# adds half again to --fits' time: 35 s against 24 s for the Llama-3.2-1B shape on a 2-core Xeon)
DEFAULT_RECIPES = ("bf16", "lora")
DEFAULT_RANK = 16  # LoRA rank where none is given: PEFT's LoraConfig default is 8; 16 is common in recipes

# The terms of a peak, in the order --explain lists them: key -> what the bytes are.
TERMS: dict[str, str] = {
    "weights": "weights: the model's parameters and buffers",
    "gradients": "gradients: .grad of the trainable parameters, live at the peak",
    "optimizer": "optimizer state: AdamW's exp_avg, exp_avg_sq and step, per trainable parameter",
    "inputs": "inputs: input_ids and labels (and images)",
    "forward": "forward: what the forward allocated and is still live (saved for backward, the loss)",
    "backward": "backward: what backward allocated and is still live (gradients of activations)",
    "step": "optimizer step: AdamW's temporaries (foreach: one per parameter at once)",
    "sharding": "FSDP2: gathered parameters (the root's, a layer's), all-gather and reduce-scatter buffers",
}

# The device types a step is planned for: what the meta step does where invact's ops pick by device.
DEVICES = ("cuda", "cpu")

# The longest sequence is searched in multiples of this many tokens (a batch in ones).
SEQ_MULTIPLE = 128

# Sizes: binary units (KiB, MiB, GiB, TiB; K, M, G, T taken as binary, as nvidia-smi's MiB), decimal
# ones (KB, MB, GB, TB) and plain bytes
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}  # fmt: skip
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def read_size(text: str) -> int:
    """Bytes of a size such as "24GiB", "80 GB", "24G" (binary), "1.5TiB" or "25769803776"; ValueError,
    in words for a person, for anything else or a size that is not positive."""
    text = str(text)
    if text.strip().startswith("-"):
        raise ValueError(f"must be a positive size like 24GiB, got {text!r}")
    match = _SIZE.fullmatch(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"cannot read {text!r} as a size: write it as 24GiB, 80GB, 24G (binary) or bytes")
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise ValueError(f"must be a positive size like 24GiB, got {text!r}")
    return size


class PlanError(ValueError):
    """Input the planner cannot take (a missing or invalid config file, a config transformers cannot
    build, a bad batch, seq or dtype); its message is one line."""


def check_positive(name: str, value) -> None:
    """PlanError, in one line naming `name`, unless `value` is a positive int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")


def one_line(error: BaseException, limit: int = 240) -> str:
    """An exception's message on one line, cut at `limit` characters (transformers lists every model
    type in some messages)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_size(text: str) -> int:
    """Bytes of a size such as "24GiB", "80 GB", "24G" (binary), "1.5TiB" or "25769803776"
    (read_size); PlanError for anything else or a size that is not positive."""
    try:
        return read_size(text)
    except ValueError as e:
        raise PlanError(str(e)) from None
