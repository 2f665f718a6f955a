"""patch() never adds memory and never breaks a model that worked: dropout or a reduction after the
activation, an in-place op on its output, activation functions kept as attributes, include/exclude
given as one string, a second patch in another mode."""

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import invact
from invact.activation import RISK_HINT

WIDTH, HIDDEN, BATCH = 64, 256, 32
N = BATCH * HIDDEN  # elements through the activation per forward


def _mlp(p: float, inplace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Dropout(p, inplace=inplace), nn.Linear(HIDDEN, WIDTH)
    )


def _saved(model, *args, **kwargs) -> int:
    model.train()
    return invact.memory.saved_tensors(model, *args, **kwargs).saved_bytes


X = torch.randn(BATCH, WIDTH)


@pytest.mark.parametrize("measured", [False, True], ids=["static", "example_inputs"])
@pytest.mark.parametrize(("p", "inplace"), [(0.1, False), (0.5, True), (0.0, False)])
def test_dropout_after_the_activation_never_adds_memory(p, inplace, measured):
    model = _mlp(p, inplace)
    before = _saved(model, X)
    invact.patch(model, example_inputs=X if measured else None)
    after = _saved(model, X)
    if p == 0:  # dropout(p=0) returns its input: fc2 saves GELU's output, so InvAct saves the input
        assert before - after == 4 * N - N // 8
        assert isinstance(model[1], invact.InvActGELU)
    else:  # fc2 saves the dropped-out tensor: replacing would add the bits (or break backward)
        assert after == before and type(model[1]) is nn.GELU  # left alone: not even in place
    model(X.clone().requires_grad_()).sum().backward()  # the model still trains (in place: no version error)


@pytest.mark.parametrize("mode", ["bits", "precision_bit"])
def test_plan_reports_the_measured_saving(mode):
    (d,) = invact.plan(_mlp(0.0), mode=mode, example_inputs=X)
    bits = 0 if mode == "precision_bit" else N // 8
    assert d.replace and d.spared_bytes == 4 * N - bits and str(d.spared_bytes) in d.reason
    (d,) = invact.plan(_mlp(0.1), mode=mode, example_inputs=X)
    assert not d.replace and d.spared_bytes == -bits and "would add" in d.reason


def test_a_reduction_after_the_activation_is_left_alone():
    class SumAct(nn.Module):  # y.sum(): nothing saves y, so InvAct would hold it in addition
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(WIDTH, HIDDEN), nn.SiLU()

        def forward(self, x):
            return self.act(self.fc(x)).sum(dim=-1)

    model = SumAct()
    before = _saved(model, X)
    (d,) = invact.plan(model, example_inputs=X)
    assert not d.replace and d.spared_bytes == -(N // 8)
    assert invact.patch(model, example_inputs=X) == [] and _saved(model, X) == before


def test_measuring_restores_modes_and_random_state():
    model = _mlp(0.1).eval()
    model[2].train()  # a mixed state must come back as it was
    torch.manual_seed(1)
    invact.plan(model, example_inputs=X)
    after_plan = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(after_plan, torch.rand(4))  # the example forward's dropout drew no numbers for us
    assert [m.training for m in model] == [False, False, True, False] and not model.training


def test_an_example_forward_without_gradients_is_an_error():
    model = _mlp(0.0).requires_grad_(False)
    with pytest.raises(ValueError, match="the example forward saved nothing for backward"):
        invact.plan(model, example_inputs=X)


def test_patterns_are_strings_and_must_match():
    layers = {"fc": nn.Linear(4, 4), "head_act": nn.GELU(), "fc2": nn.Linear(4, 4), "act2": nn.SiLU()}
    model = nn.Sequential(OrderedDict(layers))
    assert invact.patch(model, exclude="head_act") == ["act2"]  # one string is one pattern, not letters
    with pytest.raises(ValueError, match="include pattern 'x' matches no activation's or norm's name"):
        invact.patch(model, include="x")
    with pytest.raises(ValueError, match="exclude pattern 'head' matches no activation's or norm's name"):
        invact.plan(model, exclude=["head"])
    with pytest.raises(TypeError, match="include takes glob patterns"):
        invact.plan(model, include=[1])


def _encoder_layer(dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(WIDTH, 4, HIDDEN, dropout=dropout, activation="gelu", batch_first=True)


@pytest.mark.parametrize("measured", [False, True], ids=["static", "example_inputs"])
def test_activation_functions_kept_as_attributes(measured):
    x = torch.randn(2, 16, WIDTH)
    example = x if measured else None
    model = _encoder_layer(0.1)  # F.gelu then dropout: left alone, statically or measured
    (d,) = invact.plan(model, example_inputs=example, norms=False)  # its LayerNorms: test_norm_patch.py
    assert d.name == "activation" and d.cls == "torch.nn.functional.gelu" and not d.replace
    assert d.reason.endswith(RISK_HINT) if not measured else "would add" in d.reason
    model = _encoder_layer(0.0)
    want = model(x.clone().requires_grad_())
    before = _saved(model, x)
    assert invact.patch(model, example_inputs=example, norms=False) == ["activation"]
    assert isinstance(model.activation, invact.InvActGELU)
    n = 2 * 16 * HIDDEN
    assert before - _saved(model, x) == 4 * n - n // 8
    xi = x.clone().requires_grad_()
    got = model(xi)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)  # the same function (InvAct's y is torch's)


def test_patching_again_in_another_mode_switches_it():
    model = _mlp(0.0)
    assert invact.patch(model) == ["1"]
    assert invact.patch(model) == []
    assert invact.patch(model, mode="precision_bit") == ["1"] and model[1].mode == "precision_bit"
    (d,) = invact.plan(model, mode="bits")
    assert d.replace and d.reason == "already InvAct: mode 'precision_bit' -> 'bits'"


transformers = pytest.importorskip("transformers")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, d_model=64,
            encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256)  # fmt: skip


def _hf(model_type: str, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **TINY, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return transformers.AutoModel.from_config(config)


HF_CASES = {  # model type, config overrides, inputs: the dropout defaults the reliability probe measured
    "bart, activation_dropout 0.1": ("bart", {"activation_dropout": 0.1},
                                     {"input_ids": torch.randint(0, 256, (1, 32))}),
    "bart, default": ("bart", {}, {"input_ids": torch.randint(0, 256, (1, 32))}),
    "wav2vec2, default": ("wav2vec2", {}, {"input_values": torch.randn(1, 4000)}),
}  # fmt: skip


@pytest.mark.parametrize("measured", [False, True], ids=["static", "example_inputs"])
@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_models_with_dropout_never_gain_memory(case, measured):
    model_type, overrides, inputs = HF_CASES[case]
    model = _hf(model_type, **overrides)
    before = _saved(model, **inputs)
    replaced = invact.patch(model, example_inputs=inputs if measured else None)
    after = _saved(model, **inputs)
    assert after <= before, (before, after)
    if measured:  # every replaced activation saves memory, so the total drops unless none was replaced
        assert (after < before) == bool(replaced)
    out = model(**inputs)
    out.last_hidden_state.sum().backward()


def test_a_residual_dropout_registered_after_the_activation_is_not_taken_for_one_on_it():
    # GPT-2's MLP registers c_fc, c_proj, act, dropout, and calls dropout after c_proj: c_proj saves the
    # activation's output, so the static rules must still patch it.
    model = _hf("gpt2", n_embd=64, n_layer=2, n_head=4)
    ids = {"input_ids": torch.randint(0, 256, (1, 32))}
    before = _saved(model, **ids)
    assert len(invact.patch(model, norms=False)) == 2
    assert _saved(model, **ids) < before


def test_timm_style_mlp_with_drop1_is_left_alone_statically():
    class Mlp(nn.Module):  # timm.layers.Mlp's layout: fc1, act, drop1, norm, fc2, drop2
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.drop1 = nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Dropout(0.1)
            self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(HIDDEN, WIDTH), nn.Dropout(0.1)

        def forward(self, x):
            return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))

    model = Mlp()
    (d,) = invact.plan(model)
    assert not d.replace and "drop1" in d.reason and d.reason.endswith(RISK_HINT)
    (d,) = invact.plan(model, example_inputs=X)  # measured: the same decision
    assert not d.replace and d.spared_bytes == -(N // 8)


def test_measured_function_attributes_in_nested_layers():
    # Function attributes are named "<module path>.<attribute>": each layer's F.gelu measured on its own.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(WIDTH, 4, HIDDEN, dropout=0.0, activation="gelu", batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(2, 16, WIDTH)
    decisions = invact.plan(model, example_inputs=x, norms=False)
    assert [d.name for d in decisions] == ["layers.0.activation", "layers.1.activation"]
    n = 2 * 16 * HIDDEN
    assert all(d.replace and d.spared_bytes == 4 * n - n // 8 for d in decisions)
