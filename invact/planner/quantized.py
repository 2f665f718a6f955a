"""QLoRA's base: every Linear but the output head as bitsandbytes' 4-bit NormalFloat layer, as transformers
loads a model with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16), and then as PEFT's
prepare_model_for_kbit_training leaves it (`quantize_nf4`).

What bitsandbytes stores for a weight of out x in = n elements (bitsandbytes 0.50,
functional.quantize_4bit with compress_statistics): the packed weight, two 4-bit codes a byte (ceil(n /
2) bytes, uint8, the layer's parameter); one absmax constant per block of 64 elements, itself quantized to
8 bits (ceil(n / 64) bytes, uint8); the second level, one float32 constant per 256 of those
(4 x ceil(ceil(n / 64) / 256) bytes), and a float32 offset (4 bytes); the NormalFloat code (16 float32,
64 bytes, a copy per layer) and the second level's 8-bit dynamic code (256 float32, one for the process).
On the meta device the layers get meta tensors of those sizes and dtypes (no values), so a plan's weights
are what a quantized model holds; a real model's weights are quantized by bitsandbytes itself.

The forward of a 4-bit layer (bitsandbytes.matmul_4bit: its op gemm_4bit) dequantizes inside the op, with
no op of its own a dispatch mode sees: the absmax constants back to float32 (4 x ceil(n / 64) bytes) and
the weight to the input's dtype (out x in), freed when the op returns (`gemm_4bit_workspace`: the bytes
a plan adds while it runs; bitsandbytes' default kernel, and CUDA's for more than a few rows). Its
backward calls the dequantization ops itself, which a plan sees. Imports bitsandbytes only when called.
"""

from __future__ import annotations

import torch
from torch import nn

from invact.planner.options import PlanError

BLOCK = 64  # elements per absmax constant (BitsAndBytesConfig's default bnb_4bit_blocksize)
BLOCK2 = 256  # absmax constants per second-level constant (double quantization's block)
_GEMM_4BIT = "bitsandbytes::gemm_4bit"


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError:
        raise PlanError("the qlora recipe needs bitsandbytes: pip install bitsandbytes") from None
    return bitsandbytes


def _meta_state(bnb, out_features: int, in_features: int, dtype: torch.dtype, dynamic: torch.Tensor):
    """(the packed weight, its QuantState) of an (out, in) weight in `dtype` as bitsandbytes stores them,
    on the meta device."""
    n = out_features * in_features
    blocks = -(-n // BLOCK)
    meta = {"device": "meta"}
    state2 = bnb.functional.QuantState(absmax=torch.empty(-(-blocks // BLOCK2), dtype=torch.float32, **meta),
                                       code=dynamic, blocksize=BLOCK2, dtype=torch.float32)  # fmt: skip
    state = bnb.functional.QuantState(
        absmax=torch.empty(blocks, dtype=torch.uint8, **meta), shape=torch.Size((out_features, in_features)),
        code=torch.empty(16, dtype=torch.float32, **meta), blocksize=BLOCK, quant_type="nf4", dtype=dtype,
        offset=torch.empty((), dtype=torch.float32, **meta), state2=state2,
    )  # fmt: skip
    return torch.empty((n + 1) // 2, 1, dtype=torch.uint8, **meta), state


def _as_4bit(bnb, linear: nn.Module, weight: torch.Tensor, compute_dtype: torch.dtype, dynamic) -> nn.Module:
    """`linear` (weight (out, in)) as a Linear4bit: quantized by bitsandbytes on a real device, its
    storages' stand-ins on the meta device."""
    out_features, in_features = weight.shape
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                              device="meta")  # fmt: skip
    if weight.is_meta:
        packed, state = _meta_state(bnb, out_features, in_features, weight.dtype, dynamic)
        layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=BLOCK,
                                         compress_statistics=True, quant_type="nf4", module=layer,
                                         bnb_quantized=True)  # fmt: skip
    else:
        layer.weight = bnb.nn.Params4bit(weight.detach().contiguous(), requires_grad=False, blocksize=BLOCK,
                                         compress_statistics=True, quant_type="nf4",
                                         module=layer).to(weight.device)  # fmt: skip
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return layer


def _linears(
    model: nn.Module, head: nn.Module | None
) -> list[tuple[nn.Module, str, nn.Module, torch.Tensor]]:
    """(parent, attribute, layer, its weight as (out, in)) for every nn.Linear of `model` and every
    transformers Conv1D (GPT-2's projections, weight (in, out)) but `head`."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is head:
                continue
            if isinstance(child, nn.Linear):
                found.append((parent, name, child, child.weight))
            elif type(child).__name__ == "Conv1D" and getattr(child, "weight", None) is not None:
                found.append((parent, name, child, child.weight.t()))
    return found


def quantize_nf4(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """`model` (a transformers model, on the meta device or a real one) with every nn.Linear and Conv1D
    but its output head replaced by bitsandbytes' Linear4bit (nf4, blocks of 64, double quantization,
    computing in `compute_dtype`), flagged as transformers flags a 4-bit model (is_loaded_in_4bit), then
    as PEFT's prepare_model_for_kbit_training leaves it without gradient checkpointing (the planner turns
    that on per step): every parameter frozen, every 16-bit one (embeddings, norms, the head) in float32.
    PlanError without bitsandbytes or PEFT."""
    bnb = _bitsandbytes()
    try:
        import peft
    except ImportError:
        raise PlanError("the qlora recipe needs PEFT: pip install peft") from None
    from invact.loss import output_head

    dynamic = torch.empty(256, dtype=torch.float32, device="meta")  # the 8-bit dynamic code, shared
    for parent, name, child, weight in _linears(model, output_head(model)):
        setattr(parent, name, _as_4bit(bnb, child, weight, compute_dtype, dynamic))
    model.is_loaded_in_4bit = True
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps beside `model`'s 4-bit weights (not parameters or buffers): each
    layer's absmax constants, codes, offset and second-level constants."""
    found = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            found += [t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor)]
            state = state.state2
    return found


def gemm_4bit_workspace(func, args) -> int:
    """Bytes bitsandbytes' gemm_4bit allocates inside itself (0 for any other op): the weight dequantized
    to the input's dtype (shapeB's elements), and with double quantization (absmax_8bit given) the absmax
    constants in float32, one per block of 64."""
    if getattr(func, "name", lambda: None)() != _GEMM_4BIT:
        return 0
    a, shape = args[0], args[2]
    n = shape[0] * shape[1]
    nested = len(args) > 7 and args[7] is not None
    return n * a.element_size() + (4 * -(-n // args[4]) if nested else 0)
