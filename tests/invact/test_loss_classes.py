"""Which of transformers' language-model classes take the loss path (invact.loss.class_decision over
every exported *ForCausalLM, *LMHeadModel, *ForConditionalGeneration and *ForSpeechSeq2Seq class, as
benchmarks/loss_classes.py enumerates them), and that the decision read from a class's source is the one
patch() makes on an instance."""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import invact
import invact.loss as L
from invact.loss import source as loss_source
from tests.invact.test_loss import _families

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import loss_classes  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "loss_classes.json"

# The families people fine-tune whose loss the path must take: decoder LMs whose loss type is not
# "ForCausalLM" (GPT-2's None), vision- and audio-language models ("ForConditionalGeneration", which
# transformers maps to its causal-LM loss) and encoder-decoders (their own cross-entropy).
FINE_TUNED = [
    "GPT2LMHeadModel",
    "BertLMHeadModel",
    "CTRLLMHeadModel",
    "OpenAIGPTLMHeadModel",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Gemma3nForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
    "PaliGemmaForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "InternVLForConditionalGeneration",
    "AyaVisionForConditionalGeneration",
    "VoxtralForConditionalGeneration",
    "Qwen2_5OmniThinkerForConditionalGeneration",
    "T5ForConditionalGeneration",
    "MT5ForConditionalGeneration",
    "BartForConditionalGeneration",
    "MBartForConditionalGeneration",
    "PegasusForConditionalGeneration",
    "WhisperForConditionalGeneration",
    "M2M100ForConditionalGeneration",
    "Speech2TextForConditionalGeneration",
]


@pytest.fixture(scope="module")
def decided():
    return loss_classes.decisions()


def test_every_class_is_taken_or_left_alone_with_what_it_does_instead(decided):
    assert len(decided) > 100  # the enumeration found transformers' classes
    for name, row in decided.items():
        assert row["reason"], name
        if not row["taken"] and "hands the head's output to no cross-entropy" in row["reason"]:
            assert "`" in row["reason"] and "(line " in row["reason"], (name, row["reason"])  # quotes it


@pytest.mark.parametrize("name", FINE_TUNED)
def test_the_families_people_fine_tune_are_taken(decided, name):
    if name not in decided:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    assert decided[name]["taken"], decided[name]["reason"]


def test_the_committed_enumeration_is_this_transformers_one(decided):
    committed = json.loads(RESULT.read_text())
    if committed["transformers"] != transformers.__version__:
        pytest.skip(f"{RESULT.name} is of transformers {committed['transformers']}")
    assert committed["classes"] == decided
    assert committed["counts"] == loss_classes.counts(decided)


def _tiny():
    """label -> a tiny model: test_loss's families beyond causal LMs (GPT-2, BERT's LM head, T5, BART,
    Whisper), a Llama, and OPT (whose head's output goes to the loss through `.contiguous()`)."""
    T = transformers
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=300)
    return {label: make for label, (make, _) in _families().items()} | {
        "llama": lambda: T.LlamaForCausalLM(
            T.LlamaConfig(**small, intermediate_size=64, num_key_value_heads=2)
        ),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(**small, ffn_dim=64, word_embed_proj_dim=32)),
    }


@pytest.mark.parametrize("label", sorted(_tiny()))
def test_the_class_decision_is_the_instances(label):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _tiny()[label]()
    from transformers.loss.loss_utils import LOSS_MAPPING

    # transformers' own naming
    assert loss_source._class_loss_type(type(model), LOSS_MAPPING) == model.loss_type
    (d,) = [d for d in invact.plan(model) if d.kind == "loss"]
    assert d.replace == L.class_decision(type(model))[0] is True, d.reason


def test_a_module_that_keeps_the_labels_is_where_the_host_search_stops():
    """A multimodal model that takes labels and computes its loss on its language model's output
    (calling it without labels) is decided there: its language model's forward, which would take the
    labels, never gets them."""

    class Outer(transformers.LlamaPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.language_model = transformers.LlamaForCausalLM(config)

        def get_output_embeddings(self):
            return self.language_model.get_output_embeddings()

        def get_input_embeddings(self):
            return self.language_model.get_input_embeddings()

        def forward(self, input_ids=None, labels=None):
            logits = self.language_model(input_ids=input_ids).logits
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=300)  # fmt: skip
    (d,) = [d for d in invact.plan(Outer(config)) if d.kind == "loss"]
    assert not d.replace and "self.language_model" in d.reason


def test_the_docs_counts_are_the_committed_enumerations():
    c = json.loads(RESULT.read_text())["counts"]
    text = " ".join((ROOT / "docs" / "results" / "architectures.md").read_text().split())
    section = text[text.index("## Which classes take the loss path") :]
    by_reason = list(c["by_reason"].values())
    assert f"Of {c['classes']} classes, {c['taken']} are taken: {by_reason[0]} whose" in section
    assert f", {by_reason[1]} that compute a cross-entropy" in section
    assert f'was "ForCausalLM": {c["taken_before"]} classes' in section
    left = sorted(by_reason[2:], reverse=True)
    said = [int(n) for n in re.findall(r"(\d+) (?:whose|that do|with no)", section.split("Left alone:")[1])]
    assert sorted(said, reverse=True) == left
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{c['taken']} of transformers' {c['classes']} LM classes" in readme
