"""The inputs of one training forward, on the meta device (`training_inputs`): input_ids (batch, seq),
labels, an encoder-decoder's masks, and for a vision-language model its images (`image_inputs`):
pixel values at its tower's image size, image grids and token types, the images' tokens taking their
part of seq. Meta tensors, but for what the forward reads the values of (the token ids where images
are, Qwen's image grids, Idefics3's pixels and masks), which are CPU tensors."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from invact.planner.as_on_device import tensors_in, values_as_on_device
from invact.planner.options import DEFAULT_IMAGE_SIDE, PlanError, check_positive, one_line


def _image_family(model: nn.Module) -> str | None:
    """How `model`'s image inputs are built: "grid" where its forward takes image_grid_thw (Qwen2-VL,
    Qwen2.5-VL: flattened patches of any image size, and each image's (t, h, w) grid of patches),
    "tiles" where it takes pixel_attention_mask (Idefics3, SmolVLM: pixel values (batch, images,
    channels, side, side), each image one tile at the tower's image_size), "fixed" for other forwards
    that take pixel_values (LLaVA, Gemma 3, PaliGemma: (batch x images, channels, side, side) at the
    tower's image_size); None for a model without a vision tower or whose forward takes no pixel_values."""
    if getattr(model.config, "vision_config", None) is None:
        return None
    parameters = inspect.signature(model.forward).parameters
    if "pixel_values" not in parameters:
        return None
    if "image_grid_thw" in parameters:
        return "grid"
    return "tiles" if "pixel_attention_mask" in parameters else "fixed"


def _image_side(model: nn.Module, family: str, image_size: int | None) -> int:
    """The side in pixels of the square images `model` gets: its tower's image_size, or for a grid
    tower (any size) `image_size` or DEFAULT_IMAGE_SIDE, a multiple of its patch x merge size."""
    vision = model.config.vision_config
    if family == "grid":
        side = DEFAULT_IMAGE_SIDE if image_size is None else image_size
        step = vision.patch_size * vision.spatial_merge_size
        if side % step:
            patch, merge = vision.patch_size, vision.spatial_merge_size
            raise PlanError(f"image size {side} is not a multiple of {step} pixels ({patch}-pixel patches "
                            f"merged {merge} x {merge})")  # fmt: skip
        return side
    side = getattr(vision, "image_size", None)
    if not isinstance(side, int):
        raise PlanError(f"{type(model).__name__}'s vision config has no image_size")
    if image_size is not None and image_size != side:
        raise PlanError(f"{type(model).__name__}'s tower takes images of {side} x {side} pixels, not "
                        f"{image_size}")  # fmt: skip
    return side


def _pixels(model: nn.Module, family: str, batch: int, images: int, side: int, dtype: torch.dtype) -> dict:
    """The pixel inputs of `images` images per sample of `batch`, each `side` x `side` (_image_family
    says which). Meta tensors, but for what the forward reads the values of: the image grids (real
    (t, h, w) rows) and Idefics3's pixels and pixel mask (ones: no image is an all-zero padding image,
    no pixel padding), which are CPU tensors."""
    vision = model.config.vision_config
    channels = next((getattr(vision, n) for n in ("num_channels", "in_channels", "in_chans")
                     if isinstance(getattr(vision, n, None), int)), 3)  # fmt: skip
    count = batch * images
    if family == "grid":
        patch, frames, grid = vision.patch_size, vision.temporal_patch_size, side // vision.patch_size
        # an image is one temporal patch: its frame repeated temporal_patch_size times, as the processor does
        return {
            "pixel_values": torch.empty(count * grid * grid, channels * frames * patch * patch, dtype=dtype,
                                        device="meta"),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * count),
        }  # fmt: skip
    if family == "tiles":
        return {
            "pixel_values": torch.ones(batch, images, channels, side, side, dtype=dtype),
            "pixel_attention_mask": torch.ones(batch, images, side, side, dtype=torch.bool),
        }
    return {"pixel_values": torch.empty(count, channels, side, side, dtype=dtype, device="meta")}


def _tokens_per_image(model: nn.Module, family: str, side: int, dtype: torch.dtype) -> int:
    """How many tokens of the language model's sequence one image takes: the rows of the features the
    model's get_image_features gives for one image, run on the meta device (shapes only)."""
    with torch.no_grad(), values_as_on_device():
        output = model.get_image_features(**_pixels(model, family, 1, 1, side, dtype))
    features = tensors_in(getattr(output, "pooler_output", output))
    return sum(t.numel() // t.shape[-1] for t in features)


def image_inputs(model: nn.Module, batch: int, seq: int, images: int | None, image_size: int | None,
                 dtype: torch.dtype) -> tuple[dict, dict | None]:  # fmt: skip
    """(the inputs of a training forward of `model` whose samples of `seq` tokens each carry `images`
    images, besides input_ids and labels: pixel values, image grids, token types; a description of the
    images for the report, None for a model without a vision tower).

    `images` None: 1 per sample where the model has a tower whose inputs this builds, else 0 (the
    description's note says why). Each image's tokens (as many as its features have rows) followed by
    one text token (where processors put an end-of-image token or a newline: it parts one image from
    the next) take the start of every sample's `seq`, one image after another; text tokens the rest.
    Token ids other than the image token's are 0: their values change nothing saved. Returned under
    "input_ids": the token ids, a CPU tensor (the forward reads where the image tokens are). Token
    types where the forward takes them: Qwen's mm_token_type_ids and Gemma 3's token_type_ids 1 at
    the image tokens; PaliGemma's token_type_ids 0 there (the images are the prefix) and 1 at the text
    (the suffix, which the loss learns). PlanError for images that cannot be built or do not fit."""
    if images is not None and (isinstance(images, bool) or not isinstance(images, int) or images < 0):
        raise PlanError(f"images must be a non-negative integer, got {images!r}")
    if image_size is not None:
        check_positive("image size", image_size)
    family = _image_family(model)
    name = type(model).__name__
    if family is None:
        if images:
            raise PlanError(f"{name} takes no images (its config has no vision tower, or its forward no "
                            "pixel_values): plan it without --images")  # fmt: skip
        if image_size is not None:
            raise PlanError(f"{name} takes no images: plan it without --image-size")
        return {}, None
    described = {"per_sample": 0, "side": None, "tokens_per_image": 0, "image_tokens": 0, "text_tokens": seq,
                 "note": None}  # fmt: skip
    token = getattr(model.config, "image_token_id", None)
    asked = images is not None or image_size is not None  # else images are the default's: 1 if they can be
    try:
        side = _image_side(model, family, image_size)
        if not isinstance(token, int):
            raise PlanError(f"{name}'s config has no image_token_id: where its image tokens go is unknown")
    except PlanError as e:
        if asked:
            raise
        described["note"] = f"invact plan cannot build image inputs for {name}: {e}"
        return {}, described
    try:
        per_image = _tokens_per_image(model, family, side, dtype)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError, ValueError) as e:
        reason = (f"invact plan cannot build image inputs for {name}: its get_image_features fails: "
                  f"{one_line(e)}")  # fmt: skip
        if asked:
            raise PlanError(reason) from None
        described["note"] = reason
        return {}, described
    images = 1 if images is None else images
    if not images:
        return {}, described
    tokens = images * per_image
    if tokens + images > seq:
        raise PlanError(f"{images} image(s) of {per_image} tokens, each followed by a text token, take "
                        f"{tokens + images} tokens per sample: more than --seq {seq}")  # fmt: skip
    ids = torch.zeros(batch, seq, dtype=torch.long)
    for start in range(0, images * (per_image + 1), per_image + 1):
        ids[:, start : start + per_image] = token
    is_image = (ids == token).long()
    inputs = {"input_ids": ids, **_pixels(model, family, batch, images, side, dtype)}
    parameters = inspect.signature(model.forward).parameters
    if "mm_token_type_ids" in parameters:
        inputs["mm_token_type_ids"] = is_image
    if "token_type_ids" in parameters:
        inputs["token_type_ids"] = 1 - is_image if "paligemma" in model.config.model_type else is_image
    pixels = inputs["pixel_values"]
    described.update(per_sample=images, side=side, tokens_per_image=per_image, image_tokens=tokens,
                     text_tokens=seq - tokens, pixel_values=list(pixels.shape),
                     pixel_bytes=pixels.numel() * pixels.element_size())  # fmt: skip
    return inputs, described


def training_inputs(model: nn.Module, batch: int, seq: int, images: int | None, image_size: int | None,
                    dtype: torch.dtype, *, labels: bool = True) -> tuple[dict, dict | None]:  # fmt: skip
    """(the keyword inputs of one training forward of `model` on the meta device: input_ids (batch,
    seq), use_cache off, labels = input_ids where the forward takes labels and `labels` is set, the
    images of image_inputs, an encoder-decoder's all-ones masks; image_inputs' description). The
    shapes forward_saved documents."""
    parameters = inspect.signature(model.forward).parameters
    pictured, described = image_inputs(model, batch, seq, images, image_size, dtype)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, **pictured}
    if "use_cache" in parameters:
        inputs["use_cache"] = False
    labels = labels and "labels" in parameters
    if labels:  # input_ids themselves where they are meta; with images a meta tensor beside the CPU ids
        inputs["labels"] = ids
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    if encoder_decoder and not labels and "decoder_input_ids" in parameters:
        inputs["decoder_input_ids"] = ids
    if encoder_decoder:  # all-ones masks, as a tokenizer gives them (on CPU: BART's forward reads them)
        for name in ("attention_mask", "decoder_attention_mask"):
            if name in parameters:
                inputs[name] = torch.ones(batch, seq, dtype=torch.long)
    return inputs, described
