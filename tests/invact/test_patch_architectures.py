"""A sweep over transformers architectures (tiny configs, random weights): every GELU/SiLU-like
activation module is replaced, and everything left alone is left alone for a stated reason."""

import warnings

import pytest

import invact
from invact.activation import RISK_HINT, SKIPPED

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    d_model=64,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    n_embd=64,
    n_layer=2,
    n_head=4,
    num_layers=2,
    d_ff=128,
    num_heads=4,
    vocab_size=256,
    embedding_size=64,
    head_dim=16,
)
# Decoder LMs, encoders, vision and audio models; relu models (opt, t5, mobilebert) check the skips.
ARCHITECTURES = [
    "bert",
    "roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta-v2",
    "xlm-roberta",
    "longformer",
    "layoutlm",
    "gemma",
    "gemma2",
    "phi",
    "qwen2",
    "qwen3",
    "gpt_neox",
    "bloom",
    "mixtral",
    "starcoder2",
    "gptj",
    "codegen",
    "mpt",
    "stablelm",
    "olmo",
    "granite",
    "mamba",
    "bart",
    "mbart",
    "pegasus",
    "wav2vec2",
    "vit",
    "deit",
    "beit",
    "convnext",
    "dinov2",
    "siglip_vision_model",
    "clip_text_model",
    "opt",
    "t5",
    "mobilebert",
]
RELU_MODELS = {"opt", "t5", "mobilebert"}


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_activation_is_replaced_or_deliberately_skipped(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    for key, value in TINY.items():
        if hasattr(config, key):
            setattr(config, key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModel.from_config(config)
    decisions = invact.plan(model, norms=False)  # the activations (norms: tests/invact/test_norm_patch.py)
    # Left alone: a skipped class, or a static rule's risk (dropout on the output: wav2vec2, BART)
    undeliberate = [d for d in decisions if not d.replace and d.reason not in SKIPPED.values()
                    and not d.reason.endswith(RISK_HINT)]  # fmt: skip
    assert not undeliberate, f"{model_type}: not replaced: {[(d.name, d.cls) for d in undeliberate]}"
    replaced = invact.patch(model, norms=False)
    assert (len(replaced) == 0) == (model_type in RELU_MODELS), model_type
    assert not [d for d in invact.plan(model, norms=False) if d.replace]  # nothing left to replace
