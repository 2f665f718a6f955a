"""invact.planner.meta_outputs.MetaOutputs, which a planned step calls its meta ops through: each call it
answers from memory returns what the op returns (shapes, strides, dtypes, fresh storages of the same
bytes), views and calls it cannot describe run the op, and a whole planned step's peak, terms, phase and
op are the same with it as without it."""

from __future__ import annotations

import pytest
import torch

from invact.planner.meta_outputs import MetaOutputs

aten = torch.ops.aten


def _meta(*shape, dtype=torch.bfloat16, **kw):
    return torch.empty(*shape, dtype=dtype, device="meta", **kw)


def _twice(func, args, kwargs=None):
    """(the op's own output, MetaOutputs' first and second answers) for one signature, the second
    from memory where it answers."""
    outputs = MetaOutputs()
    first = outputs(func, args, kwargs or {})
    second = outputs(func, args, kwargs or {})
    return func(*args, **(kwargs or {})), first, second, outputs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.dtype, a.device, a.untyped_storage().nbytes()) == (
        b.shape,
        b.stride(),
        b.dtype,
        b.device,
        b.untyped_storage().nbytes(),
    )


CALLS = {
    "binary": (aten.mul.Tensor, (_meta(8, 16), _meta(8, 16))),
    "broadcast, promoted": (aten.add.Tensor, (_meta(8, 1), _meta(16, dtype=torch.float32))),
    "scalar": (aten.mul.Tensor, (_meta(8, 16), 0.5)),
    "transposed input": (aten.exp.default, (_meta(16, 8).t(),)),
    "reduction with kwargs": (aten.sum.dim_IntList, (_meta(8, 16), [1]), {"keepdim": True}),
    "two outputs": (aten.native_layer_norm.default, (_meta(4, 8), [8], _meta(8), _meta(8), 1e-5)),
    "foreach": (aten._foreach_sqrt.default, ([_meta(3), _meta(5, 2)],)),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_answer_from_memory_is_the_ops_output(name):
    func, args, *kwargs = CALLS[name]
    want, first, second, outputs = _twice(func, args, kwargs[0] if kwargs else None)
    flat = lambda v: [v] if isinstance(v, torch.Tensor) else [t for x in v for t in flat(x)]  # noqa: E731
    assert outputs.hits == 1
    pairs = list(zip(flat(want), flat(first), flat(second), strict=True))
    assert pairs and all(_same(w, f) and _same(w, s) for w, f, s in pairs)
    storages = {t.untyped_storage()._cdata for t in flat(first) + flat(second)}
    assert len(storages) == 2 * len(pairs)  # every answer fresh


@pytest.mark.parametrize(
    "func, args",
    [
        (aten.view.default, (_meta(8, 16), [128])),  # an alias in the schema
        (aten._unsafe_view.default, (_meta(8, 16), [128])),  # none in the schema, yet a view
        (aten.unsqueeze_.default, (_meta(8, 16), 0)),  # in place, changing metadata
        (aten.mul.Tensor, (_meta(8, 16), torch.ones(()))),  # a CPU tensor among the arguments
    ],
    ids=["view", "unsafe view", "unsqueeze_", "cpu scalar tensor"],
)
def test_views_metadata_changes_and_other_devices_run_the_op(func, args):
    outputs = MetaOutputs()
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    outputs(func, args, {})
    out = outputs(func, args, {})
    assert outputs.hits == 0
    if func is not aten.mul.Tensor:  # the view's storage is its input's
        assert out.untyped_storage()._cdata == args[0].untyped_storage()._cdata


def test_an_inplace_op_returns_its_input_from_memory_and_raises_while_unknown():
    outputs = MetaOutputs()
    x, y = _meta(8, 16), _meta(8, 16)
    assert outputs(aten.mul_.Tensor, (x, y), {}) is x
    assert outputs(aten.mul_.Tensor, (x, y), {}) is x and outputs.hits == 1
    with pytest.raises(RuntimeError):  # a shape the op refuses: never remembered
        outputs(aten.mul_.Tensor, (_meta(8, 1), y), {})
    with pytest.raises(RuntimeError):
        outputs(aten.mul_.Tensor, (_meta(8, 1), y), {})
    assert outputs.hits == 1


LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)  # fmt: skip
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=1024)


@pytest.mark.parametrize("recipe", ["bf16", "mixed", "lora"])
@pytest.mark.parametrize(
    ("config", "device"), [(LLAMA, "cuda"), (GPT2, "cpu")], ids=["llama-cuda", "gpt2-cpu"]
)
def test_a_planned_step_is_the_same_with_and_without_remembered_outputs(config, device, recipe):
    pytest.importorskip("transformers")
    if recipe == "lora":
        pytest.importorskip("peft")
    from invact.planner.step import Step

    remembered, plain = Step(dict(config), recipe, device=device), Step(dict(config), recipe, device=device)
    plain._outputs = None  # every op runs its meta kernel
    peaks = []
    for patched in (False, True):
        if patched:
            remembered.patch()
            plain.patch()
        for checkpointing in (False, True):
            for seq in (64, 256, 64):  # 64 again: answered from memory
                peaks.append(
                    (
                        remembered.peak(2, seq, checkpointing=checkpointing),
                        plain.peak(2, seq, checkpointing=checkpointing),
                    )
                )
    assert remembered._outputs.hits > remembered._outputs.calls // 4
    assert all(a == b for a, b in peaks), [(a, b) for a, b in peaks if a != b][:1]


def _aten_overloads() -> list:
    found = []
    for name in dir(aten):
        packet = getattr(aten, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            found += [getattr(packet, overload) for overload in packet.overloads()]
    return found


@pytest.mark.skipif(not hasattr(torch.Tag, "inplace"), reason="torch.Tag.inplace: torch 2.13 and later")
def test_inplace_by_schema_agrees_with_torchs_tag():
    """invact.planner.meta_outputs.inplace reads the schema (torch.Tag.inplace is absent before torch 2.13):
    every op torch tags in-place is in-place by the schema, and each op only the schema calls in-place
    writes its first argument and returns it or nothing (aten::copy_.int, index_put_.hacked_twin:
    untagged overloads of in-place ops), which is all MetaOutputs relies on."""
    from invact.planner.meta_outputs import inplace

    overloads = _aten_overloads()
    assert len(overloads) > 1000  # aten's whole registry was read, not a part of it
    tagged = {f for f in overloads if torch.Tag.inplace in f.tags}
    assert tagged and {f for f in tagged if not inplace(f)} == set()
    for f in (f for f in overloads if inplace(f) and f not in tagged):
        written = f._schema.arguments[0].alias_info.before_set
        returns = f._schema.returns
        assert not returns or (len(returns) == 1 and returns[0].alias_info.before_set == written), f
