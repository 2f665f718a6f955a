"""Vision- and audio-language models take the loss path: a training step with an image (Voxtral: with
audio) on tiny configs (2 text layers of 64, 1-2 tower layers, the families' own vocabularies), the
tower and the language model patched, against the unpatched model: loss and every parameter's
gradient within the fp32 bound, no logits kept, the fp32 (tokens x vocab) log-softmax no longer
saved; and under torch.compile the loss is invact's op."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import invact
from tests.invact.test_loss import _fp32_bound, _on_demand

transformers = pytest.importorskip("transformers")

SEQ = 64
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
              patch_size=14)  # fmt: skip


def _qwen2_vl():
    T = transformers
    config = T.Qwen2VLConfig(
        text_config=dict(
            **TEXT, vocab_size=151936, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=4,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),  # fmt: skip
        image_token_id=151655,
        vision_start_token_id=151652,
        video_token_id=151656,
    )
    return T.Qwen2VLForConditionalGeneration(config), *_qwen_image(config)


def _qwen_image(config) -> tuple[torch.Tensor, dict]:
    """(token ids, image inputs) of Qwen's VL models for one 56 x 56 image: 4 x 4 patches of 14 (2
    frames each: the temporal patch), merged 2 x 2 into 4 image tokens after the vision-start token."""
    ids = _ids(151936, config.image_token_id, 4, start=config.vision_start_token_id)
    types = (ids == config.image_token_id).long()
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))
    return ids, dict(pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=types)


def _llava():
    T = transformers
    config = T.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", **VISION, projection_dim=32),
        text_config=dict(model_type="llama", **TEXT, vocab_size=32064),
        image_token_id=32000,
        vision_feature_layer=-1,
    )
    ids = _ids(32064, config.image_token_id, 4)  # 2 x 2 patches of a 28 x 28 image
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    return T.LlavaForConditionalGeneration(config), ids, dict(pixel_values=pixels)


def _paligemma():
    T = transformers
    config = T.PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", **VISION, projection_dim=64),
        text_config=dict(model_type="gemma", head_dim=16, **TEXT, vocab_size=257216),
        image_token_id=257152,
        projection_dim=64,
    )
    ids = _ids(257216, config.image_token_id, 4)
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    prefix = (torch.arange(SEQ) >= 6).long()[None]  # the image and a prompt, then the suffix it learns
    return T.PaliGemmaForConditionalGeneration(config), ids, dict(pixel_values=pixels, token_type_ids=prefix)


def _qwen2_5_vl():
    T = transformers
    config = T.Qwen2_5_VLConfig(
        text_config=dict(
            **TEXT, vocab_size=151936, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),  # fmt: skip
        image_token_id=151655,
        vision_start_token_id=151652,
        video_token_id=151656,
    )
    return T.Qwen2_5_VLForConditionalGeneration(config), *_qwen_image(config)


def _gemma3():
    T = transformers
    config = T.Gemma3Config(
        text_config=dict(**TEXT, head_dim=16, vocab_size=262208, sliding_window=16),
        vision_config=dict(**VISION),
        mm_tokens_per_image=4,
        image_token_index=262144,
        boi_token_index=255999,
        eoi_token_index=256000,
    )
    ids = _ids(262208, config.image_token_index, 4)
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    types = (ids == config.image_token_index).long()
    return T.Gemma3ForConditionalGeneration(config), ids, dict(pixel_values=pixels, token_type_ids=types)


def _idefics3():
    T = transformers
    config = T.Idefics3Config(
        text_config=dict(model_type="llama", **TEXT, vocab_size=49280),
        vision_config=dict(**VISION),
        scale_factor=2,
        image_token_id=49190,
    )
    ids = _ids(49280, config.image_token_id, 1)  # 2 x 2 patches merged 2 x 2 into one token
    pixels = torch.randn(1, 1, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, 1, 28, 28, dtype=torch.bool)
    return (
        T.Idefics3ForConditionalGeneration(config),
        ids,
        dict(pixel_values=pixels, pixel_attention_mask=mask),
    )


def _voxtral():
    T = transformers
    config = T.VoxtralConfig(
        audio_config=dict(d_model=32, intermediate_size=128, encoder_layers=1, encoder_attention_heads=4,
                          encoder_ffn_dim=128, num_mel_bins=8, max_source_positions=16, dropout=0.0),
        text_config=dict(model_type="llama", **TEXT, head_dim=16, vocab_size=131072),
        audio_token_id=24,
    )  # fmt: skip
    # 32 mel frames: 16 encoder positions of 32, merged 4 at a time into 4 audio tokens
    ids = _ids(131072, config.audio_token_id, 4)
    features = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
    return T.VoxtralForConditionalGeneration(config), ids, dict(input_features=features)


# six vision-language families people fine-tune (SmolVLM is Idefics3's architecture), and an
# audio-language one with audio
MODELS = {"qwen2-vl": _qwen2_vl, "qwen2.5-vl": _qwen2_5_vl, "gemma3": _gemma3, "llava": _llava,
          "idefics3": _idefics3, "paligemma": _paligemma, "voxtral (audio)": _voxtral}  # fmt: skip


def _ids(vocab: int, image: int, count: int, start: int | None = None) -> torch.Tensor:
    """One sequence of SEQ text tokens (ids below 1000: none is special) with `count` image tokens near
    its start (after `start`, the vision-start token, where the model has one)."""
    ids = torch.randint(0, 1000, (1, SEQ), generator=torch.Generator().manual_seed(1))
    at = 1
    if start is not None:
        ids[0, 0] = start
    ids[0, at : at + count] = image
    return ids


def _build(label):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, ids, inputs = MODELS[label]()
    labels = ids.clone()
    labels[0, :6] = -100  # the image and the prompt do not count
    return model.float().train(), dict(input_ids=ids, labels=labels, **inputs)


def _step(model, inputs):
    model.zero_grad()
    out = model(**inputs)
    out.loss.backward()
    return (
        out,
        out.loss.detach().double(),
        [p.grad.double() for p in model.parameters() if p.grad is not None],
    )


@pytest.mark.parametrize("label", sorted(MODELS))
def test_a_vlm_step_with_an_image_takes_the_loss_and_matches_eager(label):
    plain, inputs = _build(label)
    decisions = invact.plan(plain)
    (d,) = [d for d in decisions if d.kind == "loss"]
    assert d.replace, d.reason
    norms = [d.name for d in decisions if d.kind == "norm" and d.replace]
    tower = [n for n in norms if any(word in n for word in ("vision", "visual", "audio"))]
    assert tower and len(tower) < len(norms), (
        norms
    )  # the vision or audio tower's norms and the language model's
    patched = copy.deepcopy(plain)
    invact.patch(patched)
    want_out, want_loss, want_grads = _step(plain, inputs)
    out, loss, grads = _step(patched, inputs)
    _on_demand(out, want_out, None)  # of eager's shape and dtype; the layers below differ in rounding
    vocab = plain.get_output_embeddings().weight.shape[0]
    bound = _fp32_bound(SEQ, TEXT["hidden_size"], vocab)  # the head's and the loss's sums, as test_loss
    assert abs(loss - want_loss) <= bound * abs(want_loss)
    assert len(grads) == len(want_grads)
    # A vision tower's key biases have a gradient that vanishes exactly (each row of attention scores
    # shifts by one constant, which softmax ignores): what either side computes for them is rounding
    # noise, so a gradient within the bound of zero, relative to the whole model's, is held to that
    # absolute level; every other parameter's to the relative bound.
    whole = torch.cat([w.flatten() for w in want_grads]).norm()
    for g, w in zip(grads, want_grads, strict=True):
        assert (g - w).norm() <= bound * max(w.norm(), bound * whole) + 1e-30
    eager = invact.memory.saved_tensors(plain, **inputs)
    ours = invact.memory.saved_tensors(patched, **inputs)
    assert eager.saved_bytes - ours.saved_bytes >= SEQ * vocab * 4  # at least the fp32 log-softmax


def test_under_torch_compile_a_vlm_loss_is_the_op():
    plain, inputs = _build("qwen2-vl")
    patched = copy.deepcopy(plain)
    invact.patch(patched)
    _, want, _ = _step(plain, inputs)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    try:
        out, loss, _ = _step(torch.compile(patched, backend=backend), inputs)
    finally:
        torch._dynamo.reset()
    assert any("linear_cross_entropy" in op for op in ops) and out.logits is None
    vocab = plain.get_output_embeddings().weight.shape[0]
    assert abs(loss - want) <= _fp32_bound(SEQ, TEXT["hidden_size"], vocab) * abs(want)
