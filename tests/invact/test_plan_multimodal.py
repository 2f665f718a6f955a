"""`invact plan` on vision-language models with images and on encoder-decoders (invact/planner/,
invact/cli.py): the planned bytes equal those a real CPU forward of the same inputs saves
(invact.memory.count_saved, random weights), eager and patched, for six VLM families, T5 and BART; the
vision tower's rows; the --images and --image-size errors; and every committed config plans, as the
class its released model is."""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path

import pytest
import torch

import invact
from invact.loss import op as loss_op
from invact.memory import count_saved

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "benchmarks" / "configs").glob("*.json"))
BATCH, SEQ, IMAGES = 2, 64, 2  # two images per sample: their token blocks must stay apart
COMMITTED_SEQ = 512  # the committed configs' plans: room for a 256-token image, and fast (meta device)
SMALL_QWEN_SIDE = 112  # their Qwen tower's images there: an 8 x 8 grid of patches, 16 tokens
BF16, FP32, INT64 = 2, 4, 8  # bytes per element

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
              patch_size=14)  # fmt: skip
QWEN_SIDE = 56  # Qwen's towers take any size: a 4 x 4 grid of 14-pixel patches, 4 tokens after the merge
MROPE = {"type": "mrope", "mrope_section": [2, 3, 3]}
QWEN_IDS = dict(image_token_id=151655, vision_start_token_id=151652, video_token_id=151656)
# Tiny configs of the six families (2 text layers of 64, 2 tower layers), their own vocabularies and
# image token ids: Qwen2-VL's and Qwen2.5-VL's towers (windowed, gated MLP), SigLIP (Gemma 3,
# PaliGemma), CLIP (LLaVA), Idefics3's (pixel mask, pixel shuffle).
TINY = {
    "qwen2-vl": dict(
        model_type="qwen2_vl", text_config=dict(**TEXT, vocab_size=151936, rope_scaling=MROPE),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        **QWEN_IDS,
    ),
    "qwen2.5-vl": dict(
        model_type="qwen2_5_vl", text_config=dict(**TEXT, vocab_size=151936, rope_scaling=MROPE),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=28,
                           fullatt_block_indexes=[1]),
        **QWEN_IDS,
    ),
    "gemma3": dict(
        model_type="gemma3", text_config=dict(**TEXT, head_dim=16, vocab_size=262208, sliding_window=16),
        vision_config=dict(**VISION), mm_tokens_per_image=4, image_token_index=262144, boi_token_index=255999,
        eoi_token_index=256000,
    ),
    "llava": dict(
        model_type="llava", vision_config=dict(model_type="clip_vision_model", **VISION, projection_dim=32),
        text_config=dict(model_type="llama", **TEXT, vocab_size=32064), image_token_id=32000,
        vision_feature_layer=-1,
    ),
    "idefics3": dict(
        model_type="idefics3", text_config=dict(model_type="llama", **TEXT, vocab_size=49280),
        vision_config=dict(**VISION), scale_factor=2, image_token_id=49190,
    ),
    "paligemma": dict(
        model_type="paligemma", vision_config=dict(model_type="siglip_vision_model", **VISION,
                                                   projection_dim=64),
        text_config=dict(model_type="gemma", head_dim=16, **TEXT, vocab_size=257216), image_token_id=257152,
        projection_dim=64,
    ),
}  # fmt: skip
# encoder-decoders: T5 (relative position bias, ReLU, dropout 0.1) and BART (learned positions, GELU)
SEQ2SEQ = {
    "t5": dict(model_type="t5", d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=128,
               decoder_start_token_id=0, pad_token_id=0),
    "bart": dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=128,
                 max_position_embeddings=SEQ),
}  # fmt: skip
TINY_LLAMA = dict(model_type="llama", **TEXT, vocab_size=128)


def _model(config: dict):
    """The model invact plan builds for `config` (its image-text-to-text or seq2seq LM), on CPU in fp32
    with random weights (seed 0), in training mode."""
    torch.manual_seed(0)
    built = transformers.AutoConfig.for_model(**config)
    seq2seq = built.is_encoder_decoder
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForImageTextToText
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_config(built, dtype=torch.float32, attn_implementation="sdpa").train()


def _pixels(model, count: int, batch: int = 1) -> dict:
    """Real pixel inputs of `count` images per sample (seed 2), each as the planner documents them."""
    vision, seeded = model.config.vision_config, torch.Generator().manual_seed(2)
    if hasattr(vision, "spatial_merge_size"):  # Qwen: flattened patches of a temporal patch, and the grids
        grid, patch = QWEN_SIDE // vision.patch_size, vision.patch_size
        size = 3 * vision.temporal_patch_size * patch * patch
        return {"pixel_values": torch.randn(batch * count * grid * grid, size, generator=seeded),
                "image_grid_thw": torch.tensor([[1, grid, grid]] * (batch * count))}  # fmt: skip
    side = vision.image_size
    if "pixel_attention_mask" in inspect.signature(model.forward).parameters:  # Idefics3: (batch, images, .)
        return {"pixel_values": torch.randn(batch, count, 3, side, side, generator=seeded),
                "pixel_attention_mask": torch.ones(batch, count, side, side, dtype=torch.bool)}  # fmt: skip
    return {"pixel_values": torch.randn(batch * count, 3, side, side, generator=seeded)}


def _tokens_per_image(model) -> int:
    """Rows of the features the model's get_image_features gives for one real image."""
    with torch.no_grad():
        features = model.get_image_features(**_pixels(model, 1)).pooler_output
    features = features if isinstance(features, torch.Tensor) else torch.cat(list(features))
    return features.numel() // features.shape[-1]


def _image_step(model, per_image: int) -> dict:
    """A training step's inputs as the planner documents them: IMAGES images per sample, each image's
    tokens then one text token at the start of every sample, random text ids (seed 1) after; the token
    types each family's forward takes; labels = input_ids."""
    config = model.config
    ids = torch.randint(0, 1000, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    for image in range(IMAGES):
        start = image * (per_image + 1)
        ids[:, start : start + per_image] = config.image_token_id
    is_image = (ids == config.image_token_id).long()
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False, **_pixels(model, IMAGES, BATCH)}
    parameters = inspect.signature(model.forward).parameters
    if "mm_token_type_ids" in parameters:
        inputs["mm_token_type_ids"] = is_image
    if "token_type_ids" in parameters:  # PaliGemma: the images are the prefix (0), the text the suffix (1)
        inputs["token_type_ids"] = 1 - is_image if config.model_type == "paligemma" else is_image
    return inputs


def _real_saved(model, inputs: dict, monkeypatch) -> dict[str, int]:
    """{eager_saved_bytes, patched_saved_bytes} of one real CPU forward of `inputs`, before and after
    invact.patch(model). The loss's chunks are CUDA's size, as on the meta device (the planner plans for a
    GPU), so that both forwards take the same path through the loss."""
    monkeypatch.setitem(loss_op.BLOCK_BYTES, "cpu", loss_op.BLOCK_BYTES["cuda"])
    saved = {}
    for key in ("eager_saved_bytes", "patched_saved_bytes"):
        if key == "patched_saved_bytes":
            invact.patch(model)
        torch.manual_seed(3)  # the dropout masks (T5's): their bytes, not their values, count
        with count_saved(model) as counter:
            model(**inputs)
        saved[key] = counter.report.saved_bytes
    return saved


def _forward_parameters(data: dict):
    """The parameters of the forward of the class a config JSON's "architectures" names."""
    return inspect.signature(getattr(transformers, data["architectures"][0]).forward).parameters


def _plan(config: dict, *args, **kwargs) -> dict:
    from invact.planner.forward import forward_saved

    return forward_saved(config, *args, **kwargs)


@pytest.mark.parametrize("family", sorted(TINY))
def test_planned_image_step_saves_what_a_real_forward_saves(family, monkeypatch):
    """fp32, batch 2 x seq 64, two images per sample: the meta plan equals a real CPU forward to the
    byte, eager and patched (the inputs whose values the forward reads, token ids, grids and Idefics3's
    pixels, are real on CPU in the plan; the rest shapes only)."""
    model = _model(TINY[family])
    per_image = _tokens_per_image(model)
    side = QWEN_SIDE if family.startswith("qwen") else None
    plan = _plan(TINY[family], BATCH, SEQ, "float32", images=IMAGES, image_size=side)
    assert plan["model_class"] == type(model).__name__  # the *ForConditionalGeneration, with the LM head
    images = plan["image_inputs"]
    assert (images["per_sample"], images["tokens_per_image"]) == (IMAGES, per_image)
    assert images["image_tokens"] + images["text_tokens"] == SEQ
    real = _real_saved(model, _image_step(model, per_image), monkeypatch)
    assert {key: plan[key] for key in real} == real


@pytest.mark.parametrize("labels", [True, False], ids=["labels", "decoder_input_ids"])
@pytest.mark.parametrize("family", sorted(SEQ2SEQ))
def test_planned_encoder_decoder_step_saves_what_a_real_forward_saves(family, labels, monkeypatch):
    """The encoder gets input_ids (batch, seq), the decoder labels (shifted right by the model) or,
    without labels, decoder_input_ids = input_ids, both all-ones attention masks; both models keep
    their dropout (0.1): the masks count by their bytes, and T5's attention takes SDPA's math kernel."""
    config = SEQ2SEQ[family]
    plan = _plan(config, BATCH, SEQ, "float32", labels=labels)
    model = _model(config)
    assert plan["model_class"] == type(model).__name__  # the *ForConditionalGeneration, with the LM head
    assert plan["encoder_decoder"] and plan["labels"] == labels
    ids = torch.randint(0, config["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ones = torch.ones(BATCH, SEQ, dtype=torch.long)
    decoder = {"labels": ids} if labels else {"decoder_input_ids": ids}
    inputs = {"input_ids": ids, "attention_mask": ones, "decoder_attention_mask": ones, "use_cache": False,
              **decoder}  # fmt: skip
    real = _real_saved(model, inputs, monkeypatch)
    assert {key: plan[key] for key in real} == real


def _kinds(plan: dict, which: str) -> dict[str, int]:
    return {k["kind"]: k[f"{which}_bytes"] for k in plan["kinds"]}


def test_the_vision_tower_has_its_own_rows():
    from invact.planner.forward import KINDS, VISION
    from invact.planner.report import format_forward

    plan = _plan(TINY["qwen2.5-vl"], BATCH, SEQ, "bfloat16", image_size=QWEN_SIDE)
    assert plan["images"] == 1  # the default: one image per sample
    vision = [kind for kind in KINDS if kind.startswith(VISION)]
    for which in ("eager", "patched"):
        kinds = _kinds(plan, which)
        assert sum(kinds.values()) == plan[f"{which}_saved_bytes"]  # the kinds split the total exactly
        assert sum(kinds[k] for k in vision) == plan[f"vision_{which}_bytes"]
        text = kinds["attention"], kinds["mlp_activations"], kinds["norms"]
        assert all(text)  # the language model keeps its rows
    eager, patched = _kinds(plan, "eager"), _kinds(plan, "patched")
    # Qwen2.5-VL's tower: attention, a gated SiLU MLP, RMSNorms, the patch embedding and the merger
    assert all(eager[k] for k in vision), {k: eager[k] for k in vision}
    assert patched[VISION + "gated_products"] == 0 < eager[VISION + "gated_products"]  # recomputed
    assert patched[VISION + "norms"] < eager[VISION + "norms"]
    table = format_forward(plan).splitlines()
    rows = [line for line in table if line.startswith(("vision:", "attention", "total"))]
    assert len(rows) == len(vision) + 2 and len({len(line) for line in rows}) == 1  # one aligned table
    assert any(line.startswith("images: 1 per sample, 56 x 56 pixels") for line in table)
    assert any(line.startswith("of which the vision tower and projector") for line in table)


def test_a_text_model_has_no_vision_rows_and_images_zero_plans_text_only():
    from invact.planner.forward import VISION

    text = _plan(TINY_LLAMA, 1, 16, "bfloat16")
    assert (text["images"], text["image_inputs"], text["vision_eager_bytes"]) == (0, None, 0)
    assert not any(v for k, v in _kinds(text, "eager").items() if k.startswith(VISION))
    none = _plan(TINY["gemma3"], 1, 16, "bfloat16", images=0)
    assert none["images"] == 0 and none["image_inputs"]["text_tokens"] == 16
    assert none["vision_eager_bytes"] == none["vision_patched_bytes"] == 0


@pytest.mark.parametrize(
    "case, args",
    [
        ("negative", ["--images", "-1"]),
        ("not a number", ["--images", "two"]),
        ("text model", ["--images", "1"]),
        ("do not fit", ["--images", str(SEQ)]),
        ("size not a multiple", ["--image-size", str(QWEN_SIDE + 1)]),
        ("size of a fixed tower", ["--image-size", str(QWEN_SIDE)]),
        ("size zero", ["--image-size", "0"]),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_images_are_one_line_and_status_2(tmp_path, capsys, case, args):
    from invact.cli import main

    config = {"text model": TINY_LLAMA, "size of a fixed tower": TINY["gemma3"]}.get(case, TINY["qwen2-vl"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", str(path), "--batch", "1", "--seq", str(SEQ), *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("invact plan: error:"), err


def test_help_explains_images_and_encoder_decoders(capsys):
    from invact.cli import main
    from invact.planner.options import DEFAULT_IMAGE_SIDE

    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--images", "--image-size", f"{DEFAULT_IMAGE_SIDE} x {DEFAULT_IMAGE_SIDE}", "vision:",
                 "Encoder-decoders", "--images 0"):  # fmt: skip
        assert text in out, text


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_committed_config_plans(path):
    """Each committed config plans as the class its released model is (its "architectures"), with one
    image per sample where it has a vision tower; the kinds add up and patch() saves less."""
    data = json.loads(path.read_text())
    # Qwen's towers take any size: a small image here (docs/patching.md's plan runs the default one)
    size = SMALL_QWEN_SIDE if "image_grid_thw" in _forward_parameters(data) else None
    plan = _plan(path, 1, COMMITTED_SEQ, "bfloat16", image_size=size)
    assert [plan["model_class"]] == data["architectures"]
    vision = "vision_config" in data
    assert plan["images"] == int(vision) and bool(plan["vision_eager_bytes"]) == vision
    assert plan["encoder_decoder"] == data.get("is_encoder_decoder", False)
    for which in ("eager", "patched"):
        assert sum(_kinds(plan, which).values()) == plan[f"{which}_saved_bytes"]
    assert 0 < plan["patched_saved_bytes"] < plan["eager_saved_bytes"]
    assert 0 < _kinds(plan, "patched")["head_loss"] < _kinds(plan, "eager")["head_loss"]


def test_t5_base_shaped_head_and_loss():
    """T5-base-shaped, batch 1, seq 512 (encoder and decoder), bf16, with labels: T5 scales the decoder's
    output by d_model ** -0.5 before its tied head, and that product, the head's input, is first saved
    by the head (eager); patch()'s loss keeps its gradient instead (computed in the forward: the head's
    weight gradient, held as the parameter's, is not counted); eager's loss also keeps the log-softmax
    of the logits in bf16 (T5's loss does not upcast them) and nll_loss's total weight in bf16. The
    targets are the labels, first saved by the decoder's embedding (other)."""
    path = ROOT / "benchmarks" / "configs" / "t5-base-shaped.json"
    cfg = json.loads(path.read_text())
    tokens = COMMITTED_SEQ
    plan = _plan(path, 1, tokens, "bfloat16")
    head = _kinds(plan, "eager")["head_loss"], _kinds(plan, "patched")["head_loss"]
    hidden = tokens * cfg["d_model"] * BF16
    assert head == (tokens * cfg["vocab_size"] * BF16 + hidden + BF16, hidden)
    loss = [d for d in plan["decisions"] if d["kind"] == "loss"]
    assert [(d["name"], d["replace"]) for d in loss] == [("lm_head", True)]
    assert plan["patched_output_bytes"] == FP32  # the loss alone: no logits
    # docs/patching.md shows these lines of the command's table (its text block names no command: the
    # command runs here, in process, not again by test_plan_command's check of the documented plans)
    from invact.planner.report import format_forward

    shown = (ROOT / "docs" / "patching.md").read_text().splitlines()
    printed = format_forward(plan).splitlines()
    for start in ("encoder-decoder:", "saved for backward:", "attention ", "head and loss "):
        (line,) = [p for p in printed if p.startswith(start)]
        assert line in shown, f"docs/patching.md does not show {line!r}"
