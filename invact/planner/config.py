"""A model from its config, on the meta device: a Hugging Face config JSON read (`read_config`), built
into a transformers config (`build_config`, `load_config`) and into its model with shapes only
(`build_model`: no weights, nothing allocated; remote code is never run, nothing downloads), and what
the config says of its positions (`positions`). Imports transformers only when called."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from invact.planner.options import DTYPE_NAMES, PlanError, one_line

# dtype names the planner takes -> torch dtype
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A DTYPES name (or a torch dtype among them) as a torch dtype; PlanError otherwise."""
    if isinstance(name, torch.dtype) and name in DTYPES.values():
        return name
    if isinstance(name, str) and name.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[name.lower().removeprefix("torch.")]
    raise PlanError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")


def read_config(path: str | os.PathLike) -> dict:
    """The dict of a Hugging Face config JSON file (or of `config.json` in a folder); PlanError for a
    missing or unreadable file or invalid JSON."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.exists():
        raise PlanError(f"{file}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"{file}: cannot read it: {one_line(e)}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{file}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{file}: a config is a JSON object, got {type(data).__name__}")
    return data


def build_config(data: dict):
    """A transformers config from a config dict (its `model_type` picks the class); PlanError where
    transformers cannot build one."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = dict(data)
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str):
        raise PlanError("the config has no model_type: transformers cannot tell which model it describes")
    if model_type not in CONFIG_MAPPING:
        raise PlanError(f"transformers cannot build a config of model_type {model_type!r}: it knows no such "
                        "model type (remote code is not run)")  # fmt: skip
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as e:  # transformers raises ValueError, TypeError, KeyError... for bad fields
        raise PlanError(f"transformers cannot build a {model_type!r} config: {one_line(e)}") from None


def load_config(config) -> tuple:
    """(the transformers config of `config`: a config object, a config dict, or the path of a config
    JSON file or of a folder holding config.json; the path as given, or None)."""
    path = None
    if isinstance(config, (str, os.PathLike)):
        path = str(config)
        config = read_config(config)
    if isinstance(config, dict):
        config = build_config(config)
    return config, path


def _auto_classes(config) -> list:
    """The transformers auto classes build_model tries, in order: the image-text-to-text class for a
    config with a vision tower, the sequence-to-sequence LM for an encoder-decoder (the class with the
    LM head, so the head and the loss are in the plan), then the causal LM, then the base model."""
    import transformers

    autos = []
    if getattr(config, "vision_config", None) is not None:
        autos.append(transformers.AutoModelForImageTextToText)
    if getattr(config, "is_encoder_decoder", False):
        autos.append(transformers.AutoModelForSeq2SeqLM)
    return [*autos, transformers.AutoModelForCausalLM, transformers.AutoModel]


def build_model(config, dtype: torch.dtype) -> tuple[nn.Module, str]:
    """(the model of `config` with its LM head: its image-text-to-text class where it has a vision
    tower, its sequence-to-sequence LM where it is an encoder-decoder, else its causal LM, else its base
    model; on the meta device in `dtype`; the attention implementation: "sdpa", or "eager" where the
    model has no SDPA path). Remote code is never run or fetched. PlanError where transformers cannot
    build it."""
    failure = None
    for auto in _auto_classes(config):
        for attention in ("sdpa", "eager"):
            try:
                with torch.device("meta"):
                    model = auto.from_config(config, dtype=dtype, attn_implementation=attention,
                                             trust_remote_code=False)  # fmt: skip
                return model, attention
            except Exception as e:  # transformers raises ValueError, also others from model code
                if attention == "sdpa" and "scaled_dot_product_attention" in str(e):
                    continue  # this model has no SDPA path: its eager attention
                if failure is None or "Unrecognized configuration class" not in str(e):
                    failure = e  # the reason, rather than "no such auto class" where there is one
                break  # not this auto class (no causal LM for this config), or it cannot be built
    raise PlanError(f"transformers cannot build a model from this config: {one_line(failure)}")


def positions(config) -> tuple[str, int] | None:
    """(the field's name, its value) of the longest sequence the config's positions take:
    max_position_embeddings (or n_positions) of its text model, else its own; None where it gives none."""
    for source in (getattr(config, "text_config", None), config):
        for name in ("max_position_embeddings", "n_positions"):
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return name, value
    return None
