"""invact.patch on torch and Hugging Face models: coverage of every activation class, equal outputs,
close gradients, and the saved-memory arithmetic."""

import copy
import logging

import pytest
import torch
from torch import nn

import invact
from invact.activation import REPLACEABLE, SKIPPED, module_for
from invact.activation.activations import ACTIVATIONS
from tests.invact.test_memory_and_compile import saved_storages

transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2CLS  # noqa: E402


def _instantiate(entry):
    cls, kwargs = entry if isinstance(entry, tuple) else (entry, {})
    return cls(**kwargs)


def _qualname(module):
    return f"{type(module).__module__}.{type(module).__qualname__}"


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_the_specs_module_class_computes_its_activation(activation):
    # coeffs/activations.json names each activation's module class and the arguments that select it
    module = module_for(activation, "precision_bit")
    assert module.activation == activation and module.mode == "precision_bit"


@pytest.mark.parametrize("key", sorted(ACT2CLS))
def test_every_transformers_activation_is_handled_or_deliberately_skipped(key):
    module = _instantiate(ACT2CLS[key])
    name = _qualname(module)
    assert name in REPLACEABLE or name in SKIPPED, f"{key}: {name} is neither replaced nor skipped"
    if name not in REPLACEABLE:
        return
    reference = copy.deepcopy(module)  # torch's: patch() changes `module` itself, in place
    holder = nn.Sequential(module)
    assert invact.patch(holder) == ["0"]
    x = torch.randn(4096) * 4
    xt, xi = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = reference(xt), holder[0](xi)
    # The same function: torch's op against a Python composition differs by float rounding only,
    # which x multiplies: measured <= 2.5 eps * max(|x|, 1) over 5 seeds and all classes.
    assert ((got - want).abs() <= 3 * torch.finfo(torch.float32).eps * x.abs().clamp_min(1)).all(), key
    want.sum().backward()
    got.sum().backward()
    assert (xi.grad - xt.grad).abs().max() <= 3.5e-3, key  # the families' error (<= 3.2e-3 in fp32)


def _tiny_models():
    from transformers import (
        BertConfig,
        BertModel,
        CLIPVisionConfig,
        CLIPVisionModel,
        GPT2Config,
        GPT2Model,
        LlamaConfig,
        LlamaModel,
        MistralConfig,
        MistralModel,
        ViTConfig,
        ViTModel,
    )  # fmt: skip

    common = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=2)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return {
        "bert (gelu)": (BertModel(BertConfig(**common, **no_dropout)), "ids"),
        "gpt2 (gelu_new)": (
            GPT2Model(GPT2Config(n_embd=64, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)),
            "ids",
        ),  # fmt: skip
        "vit (gelu)": (ViTModel(ViTConfig(**common, **no_dropout, image_size=32, patch_size=8)), "pixels"),
        "clip vision (quick_gelu)": (
            CLIPVisionModel(CLIPVisionConfig(**common, image_size=32, patch_size=8)),
            "pixels",
        ),  # fmt: skip
        "llama (silu)": (LlamaModel(LlamaConfig(**common, num_key_value_heads=2, vocab_size=128)), "ids"),
        "mistral (silu)": (
            MistralModel(MistralConfig(**common, num_key_value_heads=2, vocab_size=128)),
            "ids",
        ),
    }


@pytest.mark.parametrize("label", list(_tiny_models()))
def test_patched_model_matches_and_saves_the_ideal(label):
    torch.manual_seed(0)
    model, kind = _tiny_models()[label]
    model.train()
    inputs = (
        {"input_ids": torch.randint(0, 100, (2, 24))}
        if kind == "ids"
        else {"pixel_values": torch.randn(2, 3, 32, 32)}
    )

    def run(m):
        m.zero_grad()
        out = m(**inputs).last_hidden_state
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    class Call(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, _):
            return self.m(**inputs).last_hidden_state

    want_out, want_grads = run(model)
    torch_saved = sum(saved_storages(Call(model), torch.zeros(1)).values())
    calls = []
    hooks = [
        m.register_forward_hook(lambda mod, i, o: calls.append(o.numel()))
        for name, m in model.named_modules()
        if _qualname(m) in REPLACEABLE
    ]
    saved_before = sum(saved_storages(Call(model), torch.zeros(1)).values())
    for h in hooks:
        h.remove()
    # the activations alone, their ideal below (the gated path's saving is test_gated.py's)
    replaced = invact.patch(model, norms=False, gated=False)
    assert replaced and len(replaced) == 2  # one activation per layer, two layers
    got_out, got_grads = run(model)
    # Forward: the same function; float rounding through two layers, measured <= 2e-6.
    assert torch.allclose(got_out, want_out, atol=1e-5, rtol=0)
    # Gradients: the families' error (<= 3.2e-3 relative to dy) through two layers. Measured over
    # these six models: the whole gradient vector within 1.6e-3 relative (gpt2), and each parameter
    # whose gradient is not negligible (norm > 1e-3 of the largest) within 5.8e-3 (gpt2's ln_2).
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    assert (flat(got_grads) - flat(want_grads)).norm() <= 3e-3 * flat(want_grads).norm()
    largest = max(b.norm() for b in want_grads)
    for a, b in zip(got_grads, want_grads, strict=True):
        if b.norm() > 1e-3 * largest:
            assert (a - b).norm() <= 1e-2 * b.norm()
    invact_saved = sum(saved_storages(Call(model), torch.zeros(1)).values())
    # The ideal: per activation call, its fp32 input (n * 4 bytes) is no longer saved, and
    # ceil(n / 8) bytes of bits are. For torch's single-op activations exactly that; Python
    # compositions (gelu_new, quick_gelu) saved intermediates too, which InvAct also drops.
    ideal = sum(4 * n - (n + 7) // 8 for n in calls)
    assert torch_saved == saved_before
    if label.startswith(("gpt2", "clip")):
        assert torch_saved - invact_saved > ideal
    else:
        assert torch_saved - invact_saved == ideal


def test_include_exclude_shared_and_idempotent(caplog):
    act = nn.GELU()
    model = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act, nn.SiLU(), nn.ReLU())
    assert invact.plan(model, exclude=["4"])[2].reason == "excluded by include/exclude"
    with caplog.at_level(logging.INFO, logger="invact"):
        assert invact.patch(model, include=["1", "3", "5"]) == ["1", "3"]
    assert model[1] is model[3] and isinstance(model[1], invact.InvActGELU)  # still one shared module
    assert type(model[4]) is nn.SiLU  # left alone (a patched SiLU is an nn.SiLU too: invact.identity)
    assert (
        "left 5 (torch.nn.modules.activation.ReLU) alone: ReLU's backward needs only its output"
        in caplog.text
    )
    assert invact.patch(model, include=["1", "3"]) == []  # already patched, in this mode
    assert invact.patch(model, mode="precision_bit") == ["1", "3", "4"]  # 1 and 3 switch mode
    assert model[1].mode == model[4].mode == "precision_bit" and model[1] is model[3]
    with pytest.raises(ValueError, match="mode must be"):
        invact.patch(model, mode="sign_bit")


def test_softplus_is_replaced_only_where_invact_reproduces_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Softplus(), nn.Linear(4, 4), nn.Softplus(beta=2.0))
    decisions = {d.name: d for d in invact.plan(model)}
    assert decisions["1"].replace
    assert not decisions["3"].replace and "reproduces beta=1 only" in decisions["3"].reason
    assert invact.patch(model) == ["1"]
    assert isinstance(model[1], invact.InvActSoftplus) and type(model[3]) is nn.Softplus


@pytest.mark.parametrize("attribute", ["activation", "mode"])
def test_a_module_with_an_attribute_patching_would_overwrite_is_left_alone(attribute):
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    setattr(model[1], attribute, "its own")
    (decision,) = invact.plan(model, norms=False)
    assert not decision.replace and repr(attribute) in decision.reason
    assert invact.patch(model) == [] and type(model[1]) is nn.GELU
    assert getattr(model[1], attribute) == "its own"


def test_half_precision_model_and_tanh_gelu_module():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 8)).to(torch.bfloat16)
    invact.patch(model)
    assert model[1].approximate == "tanh"
    x = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    model(x).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()


def test_memory_report_is_readable_and_counts_once():
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64)
    before = invact.memory.saved_tensors(model, x)
    invact.patch(model)
    after = invact.memory.saved_tensors(model, x)
    n = 32 * 256
    assert before.saved_bytes - after.saved_bytes == 4 * n - n // 8
    assert after.by_dtype["uint8"] == n // 8
    assert "saved for backward:" in str(after) and "MiB" in str(after)
    assert after.saving_vs(before) < 0


def test_peft_lora_wrapped_model_trains():
    peft = pytest.importorskip("peft")
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    base = BertModel(
        BertConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2)
    )
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["query", "value"]))
    replaced = invact.patch(model, norms=False)
    assert len(replaced) == 2 and all(name.endswith("intermediate_act_fn") for name in replaced)
    out = model(input_ids=torch.randint(0, 100, (2, 16))).last_hidden_state
    out.square().mean().backward()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.grad is not None for p in lora)
    assert any(p.grad.abs().sum() > 0 for p in lora)


def test_timm_classes_are_matched_by_qualified_name():
    # timm cannot be installed here (it needs torchvision); a class with timm's qualified name and
    # timm's formula for QuickGELU stands in for it.
    quick = type("QuickGELU", (nn.Module,), {"forward": lambda self, x: x * torch.sigmoid(1.702 * x)})
    mish = type("Mish", (nn.Module,), {"forward": lambda self, x: x * torch.tanh(nn.functional.softplus(x))})
    hard_mish = type("HardMish", (nn.Module,), {"forward": lambda self, x: 0.5 * x * (x + 2).clamp(0, 2)})
    for cls in (quick, mish, hard_mish):
        cls.__module__ = "timm.layers.activations"
    model = nn.Sequential(nn.Linear(4, 4), quick(), nn.Linear(4, 4), mish(), hard_mish())
    assert invact.patch(model) == ["1", "3"]
    assert isinstance(model[1], invact.InvActQuickGELU) and isinstance(model[3], invact.InvActMish)
    assert invact.plan(model)[0].reason == "no fitted family for hard mish"
