"""patch() and plan() through invact.kinds: each op kind's home is visited once per phase, in order,
and no home calls back into invact.patch."""

from __future__ import annotations

import sys

import pytest
import torch

import invact
from invact.kinds import Decision, Kind
from invact.patch import KINDS, _options
from tests.invact.test_import import _import_graph

transformers = pytest.importorskip("transformers")

HOMES = {kind.decide.__module__ for kind in KINDS}


def _tiny_llama():
    """A causal LM with every kind: SiLU activations in gated MLPs, RMSNorms, a head with a loss."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=64)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _follow(call):
    """(the home module of each function invact.patch calls directly, in order; the calls any frame
    outside invact.patch makes into it) while `call()` runs."""
    visits, back = [], []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_globals.get("__name__"), frame.f_back.f_globals.get("__name__")
        if caller == "invact.patch" and callee in HOMES:
            visits.append(callee)
        elif callee == "invact.patch" and caller in HOMES:
            back.append(f"{caller} -> {frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return visits, back


def test_the_kinds_are_the_activation_the_mlp_the_norm_and_the_loss_in_that_order():
    # the MLP's decision refines the activations' (it hooks the parents of those replaced)
    assert [kind.name for kind in KINDS] == ["activation", "mlp", "norm", "loss"]
    assert all(isinstance(kind, Kind) for kind in KINDS)
    assert len(HOMES) == len(KINDS)  # one home per kind


def test_patch_visits_each_home_once_per_phase_in_order():
    model = _tiny_llama()
    planned = [d for d in invact.plan(model) if d.replace]
    replaced = []
    visits, back = _follow(lambda: replaced.extend(invact.patch(model)))
    homes = [kind.decide.__module__ for kind in KINDS]
    assert visits == homes + homes  # decide in each, then apply in each
    assert not back
    assert replaced == [d.name for d in planned]
    assert {d.kind for d in planned} == {"activation", "norm", "loss"}  # each kind replaced something


def test_plan_visits_each_home_once_and_changes_nothing():
    model = _tiny_llama()
    before = [type(m) for m in model.modules()]
    visits, back = _follow(lambda: invact.plan(model))
    assert visits == [kind.decide.__module__ for kind in KINDS]  # no apply
    assert not back
    assert [type(m) for m in model.modules()] == before


def test_each_kind_adds_decisions_of_its_own_kind_only():
    model = _tiny_llama()
    options = _options(None, None, "bits", None, True, True, True)
    plan: list[Decision] = []
    for kind in KINDS:
        plan_before = list(plan)
        plan, _ = kind.decide(model, options, plan)
        added = plan[len(plan_before) :]
        assert [d.name for d in plan[: len(plan_before)]] == [d.name for d in plan_before]
        assert {d.kind for d in added} <= {kind.name}
    assert {d.kind for d in plan} == {"activation", "norm", "loss"}  # the MLP kind refines, adds none
    assert any(d.gated for d in plan)  # ... and names the modules to hook


def test_no_home_imports_invact_patch():
    """A home reaches patch() only through invact.kinds' interface: it cannot import the loop."""
    graph = _import_graph()

    def closure(name: str, seen: set[str]) -> set[str]:
        for dep in graph.get(name, ()):
            if dep not in seen:
                seen.add(dep)
                closure(dep, seen)
        return seen

    for home in (*HOMES, "invact.kinds"):
        assert home in graph
        assert "invact.patch" not in closure(home, set()), home


@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_under_a_memory_budget_every_kind_traces_as_torchs_ops(budget):
    """AOTAutograd's partitioner recomputes only aten's ops (invact._budget): under a budget below 1 the
    activation, the MLP and the norm trace as torch's ops, which it may recompute; without one, as
    invact's. Both train: every parameter gets a gradient."""
    import torch._functorch.config as functorch_config

    from tests.invact._stack_workers import _recording

    model = _tiny_llama()
    assert invact.patch(model, loss=False)
    ids = torch.randint(0, 64, (2, 8))
    ops: set[str] = set()
    traced: set[str] = set()
    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=budget):
        compiled = torch.compile(model, backend=_recording(ops, traced), fullgraph=True)
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    torch._dynamo.reset()
    ours = {op.removesuffix(".default") for op in traced if op.startswith("invact.")}
    if budget < 1:
        assert not ours, sorted(ours)
        assert {"aten.silu.default", "aten.rsqrt.default"} <= ops, sorted(ops)
    else:
        assert {"invact.forward", "invact.gated_linear", "invact.norm_forward"} <= ours
    # either way, what runs is aten's ops: invact's are traced as their bodies (invact._traced)
    assert not [op for op in ops if op.startswith("invact.")], sorted(ops)
    assert all(p.grad is not None for p in model.parameters())


def test_budgeted_carries_dynamos_constant_mark():
    """invact._budget marks budgeted() as torch.compiler.assume_constant_result would, without importing
    torch._dynamo at `import invact`: the mark must be the one that function sets."""
    from invact._budget import budgeted

    marked = torch.compiler.assume_constant_result(lambda: None)
    marks = {k for k in vars(marked) if k.startswith("_dynamo")}
    assert marks and all(getattr(budgeted, k, None) == vars(marked)[k] for k in marks)


def test_invacts_source_digest_is_in_compiles_cache_key():
    """torch.compile's on-disk caches key a graph by what Dynamo traced, where invact's ops are single
    calls: `import invact` puts invact's source digest into torch.compiler.config's cache key tag, once,
    after a tag of the user's own, so a graph cached with other bodies is not loaded."""
    import torch.compiler.config as compile_config

    from invact import _traced

    digest = _traced._source_digest()
    assert len(digest) == 16 and f"invact-{digest}" in compile_config.cache_key_tag.split()
    # The config's own patch(), not monkeypatch: pytest's undo deletes an attribute it did not find in
    # the module's __dict__, and a deleted torch config entry stays hidden for the rest of the session.
    with compile_config.patch(cache_key_tag="mine"):
        _traced.tag_compile_cache()
        _traced.tag_compile_cache()
        assert compile_config.cache_key_tag == f"mine invact-{digest}"
    assert f"invact-{digest}" in compile_config.cache_key_tag.split()
