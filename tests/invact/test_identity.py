"""patch() where tools outside invact meet a patched model: models built on the meta device (as
from_pretrained and accelerate build them), Hugging Face's weight initialization, selection by class
(FSDP's wrap policies) and by class name (PEFT targets, Hugging Face's norm init). invact.identity
says how a patched module keeps its class's identity."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import invact
from invact import norm
from invact.activation.modules import InvAct
from invact.identity import original_class
from invact.mlp import FusedMLP
from invact.norm import InvNorm
from tests.invact.test_norm_patch import FP32_GRADIENT_REL

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB, WIDTH = 16, 2, 128, 64


def _configs() -> dict:
    t = transformers
    width = dict(hidden_size=WIDTH, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=VOCAB, max_position_embeddings=SEQ)  # fmt: skip
    small = dict(width, num_key_value_heads=2)
    return {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**small)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**small)),
        "gemma": lambda: t.GemmaForCausalLM(t.GemmaConfig(**small, head_dim=16)),  # weight 0: (1 + w)
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(n_embd=WIDTH, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ)
        ),
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(**width)),  # LayerNorm with a bias
    }


MODELS = list(_configs())


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    """Every test probes each norm class anew: the formula check is remembered per class, so a probe
    made by an earlier test on CPU would hide one that fails under a meta-device context."""
    monkeypatch.setattr(norm, "_MATCHED", {})


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _patched_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (InvAct, InvNorm, FusedMLP))}


def _plain_and_patched(label: str) -> tuple[nn.Module, nn.Module]:
    """The model of `label` from seed 0, and a patched deep copy of it."""
    torch.manual_seed(0)
    plain = _configs()[label]()
    patched = copy.deepcopy(plain)
    invact.patch(patched)
    return plain, patched


def _loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.train()
    ids = _ids()
    torch.manual_seed(2)  # the same dropout masks for every model compared
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), [p.grad for p in model.parameters()]


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"differ after materializing: {different[:5]}"


def _on_meta(make, patch_inside: bool) -> nn.Module:
    """The model built in `with torch.device("meta")` (patched there if asked), then materialized on
    CPU and initialized by Hugging Face's init_weights from seed 0."""
    with torch.device("meta"):
        model = make()
        if patch_inside:
            invact.patch(model)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


@pytest.mark.parametrize("label", MODELS)
def test_patch_inside_a_meta_device_context_materializes_as_unpatched(label):
    make = _configs()[label]
    plain = _on_meta(make, patch_inside=False)
    patched = _on_meta(make, patch_inside=True)
    assert _patched_modules(patched), "nothing was patched on the meta device"
    _assert_same_state(patched, plain)
    # and trains exactly as the unpatched model patched once materialized: the same modules, the same
    # decisions, bitwise the same loss and gradients
    later = copy.deepcopy(plain)
    invact.patch(later)
    assert list(_patched_modules(later)) == list(_patched_modules(patched))
    (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(patched), _loss_and_grads(later)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


@pytest.mark.parametrize("label", ["llama", "bert"])
def test_plan_on_meta_parameters_outside_a_meta_context(label):
    make = _configs()[label]
    torch.manual_seed(0)
    on_cpu = make()
    on_meta = copy.deepcopy(on_cpu).to("meta")
    want = [(d.name, d.replace, d.reason) for d in invact.plan(on_cpu)]
    assert [(d.name, d.replace, d.reason) for d in invact.plan(on_meta)] == want


def _save_without(model: nn.Module, folder, missing: list[str]) -> None:
    state = {k: v for k, v in model.state_dict().items() if k not in missing}
    model.save_pretrained(folder, state_dict=state)


@pytest.mark.parametrize("label", ["llama", "gpt2"])
def test_from_pretrained_patching_while_it_loads(label, tmp_path, monkeypatch):
    """Patched inside from_pretrained (in post_init, on its meta-device model), with two norm weights
    missing from the checkpoint: the loaded weights and the missing ones' initialization are the
    unpatched model's."""
    make = _configs()[label]
    torch.manual_seed(0)
    source = make()
    norms = [n for n, m in source.named_modules() if norm.is_candidate(m)]
    missing = [f"{norms[0]}.weight", f"{norms[-1]}.weight"]
    _save_without(source, tmp_path, missing)
    cls = type(source)
    plain = cls.from_pretrained(tmp_path)
    original = cls.post_init

    def post_init(self):
        original(self)
        invact.patch(self)

    monkeypatch.setattr(cls, "post_init", post_init)
    patched = cls.from_pretrained(tmp_path)
    assert set(_patched_modules(patched)) >= set(norms)
    _assert_same_state(patched, plain)
    weight = patched.get_submodule(norms[0]).weight
    assert torch.equal(weight, plain.get_submodule(norms[0]).weight) and weight.abs().sum() > 0


@pytest.mark.parametrize("label", MODELS)
def test_hugging_faces_init_weights_reaches_patched_modules(label):
    plain, patched = _plain_and_patched(label)
    for model in (plain, patched):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        torch.manual_seed(0)
        model.apply(model._init_weights)
    _assert_same_state(patched, plain)


@pytest.mark.parametrize("label", MODELS)
def test_patched_modules_keep_class_name_and_keys(label):
    plain, patched = _plain_and_patched(label)
    changed = _patched_modules(patched)
    assert changed
    for name, module in changed.items():
        was = plain.get_submodule(name)
        assert isinstance(module, type(was)) and original_class(module) is type(was), name
        assert (type(module).__name__, type(module).__qualname__, type(module).__module__) == (
            type(was).__name__, type(was).__qualname__, type(was).__module__,
        )  # fmt: skip
        assert "invact=" in repr(module) and "invact=" not in repr(was)
        first, was_first = repr(module).splitlines()[0], repr(was).splitlines()[0]
        assert first.startswith(was_first.rstrip(")"))  # the original's repr, then invact's
    assert list(patched.state_dict()) == list(plain.state_dict())


def test_a_patched_class_built_anew_builds_the_unpatched_module():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    invact.patch(model)
    assert (
        isinstance(model[1], InvAct)
        and isinstance(model[3], InvNorm)
        and isinstance(model, FusedMLP) is False
    )
    assert type(type(model[1])(approximate="tanh")) is nn.GELU
    assert type(type(model[3])(4)) is nn.LayerNorm
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    invact.patch(mlp)
    assert isinstance(mlp, FusedMLP) and type(mlp[:2]) is nn.Sequential  # Sequential slices build anew


def test_pickled_and_copied_models_stay_patched():
    torch.manual_seed(0)
    model = _configs()["llama"]()
    invact.patch(model)
    loss, _ = _loss_and_grads(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = (pickle.loads(pickle.dumps(model)), copy.deepcopy(model), torch.load(buffer, weights_only=False))
    for other in copies:
        assert list(_patched_modules(other)) == list(_patched_modules(model))
        assert torch.equal(_loss_and_grads(other)[0], loss)


def test_fsdp2_wrap_policy_by_class_selects_and_shards_patched_modules(tmp_path):
    """FSDP's ModuleWrapPolicy selects by isinstance: the patched model's decoder layers and norms are
    selected as the unpatched model's, and fully_shard (one gloo rank) on them trains it bitwise as
    the unsharded patched model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    plain, patched = _plain_and_patched("llama")
    policy = ModuleWrapPolicy({LlamaDecoderLayer, LlamaRMSNorm})

    def selected(model: nn.Module) -> list[str]:
        return [n for n, m in model.named_modules() if policy(module=m, recurse=False, nonwrapped_numel=0)]

    assert selected(patched) == selected(plain) and len(selected(plain)) == 2 * 3 + 1
    sharded = copy.deepcopy(patched)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for name in reversed(selected(sharded)):  # innermost first, the root last
            fully_shard(sharded.get_submodule(name))
        fully_shard(sharded)
        norms = [m for m in sharded.modules() if isinstance(m, LlamaRMSNorm)]
        assert norms and all(isinstance(m, InvNorm) for m in norms)
        (loss_a, grads_a), (loss_b, grads_b) = _loss_and_grads(sharded), _loss_and_grads(patched)
        grads_a = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads_a]
    finally:
        dist.destroy_process_group()
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_peft_targets_chosen_by_class_name_are_the_unpatched_models():
    """PEFT's LayerNorm tuning on the norms picked by class name (`type(m).__name__`): the same targets
    and the same trained gradients, within the inverted norm's fp32 bound (test_norm_patch.py)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = _configs()["llama"]()
    models = {}
    for norms in (False, True):
        model = copy.deepcopy(base)
        invact.patch(model, norms=norms)  # activations inverted in both: the norms are compared
        targets = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
        models[norms] = (peft.get_peft_model(model, peft.LNTuningConfig(target_modules=targets)), targets)
    (plain, plain_targets), (patched, targets) = models[False], models[True]
    assert targets == plain_targets and len(targets) == 2 * 2 + 1
    assert sum(isinstance(m, InvNorm) for m in patched.modules()) >= 2 * len(targets)  # base and tuned copy
    _, _ = _loss_and_grads(plain), _loss_and_grads(patched)
    a = torch.cat([p.grad.flatten() for p in plain.parameters() if p.requires_grad])
    b = torch.cat([p.grad.flatten() for p in patched.parameters() if p.requires_grad])
    assert a.numel() == len(targets) * WIDTH
    assert (a - b).norm() <= FP32_GRADIENT_REL * a.norm()
