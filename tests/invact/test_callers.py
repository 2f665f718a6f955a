"""invact.callers: an in-place use of a module's output, read from its caller's forward source, and
patch() leaving such a norm alone (transformers' XLM: `tensor = self.layer_norm2[i](tensor)` then
`tensor *= mask`, which failed the backward with the norm inverted)."""

import linecache

import pytest
import torch
from torch import nn

import invact
from invact.callers import inplace_use
from invact.norm import InvNorm


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.norms = nn.ModuleList([nn.LayerNorm(8)])
        self.proj = nn.Linear(8, 8)


def _forward_of(body: str) -> type:
    """A module class whose forward is `body` (indented under `def forward(self, x, mask):`)."""
    namespace: dict = {"nn": nn, "torch": torch}
    source = "def forward(self, x, mask):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    path = f"<callers-test-{abs(hash(body))}>"
    # inspect reads forward's source through linecache, as it would from a file on disk
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    exec(compile(source, path, "exec"), namespace)
    return type("Caller", (_Block,), {"forward": namespace["forward"]})


MODIFIES = {
    "augmented": "x = self.norm(x)\nx *= mask\nreturn self.proj(x)",
    "method": "x = self.norm(x)\nx.mul_(mask)\nreturn self.proj(x)",
    "subscript": "x = self.norm(x)\nx[0] = 0\nreturn self.proj(x)",
    "through dropout": "x = self.norm(x)\nx = nn.functional.dropout(x, 0.0)\nx *= mask\nreturn self.proj(x)",
    "through a view": "x = self.norm(x)\nx = x.view(-1, 8)\nx += 1\nreturn self.proj(x)",
    "after a branch": "if mask is not None:\n    x = self.norm(x)\nx *= mask\nreturn self.proj(x)",
    "module list": "for n in range(1):\n    x = self.norms[n](x)\n    x *= mask\nreturn self.proj(x)",
}
LEAVES = {
    "rebound first": "x = self.norm(x)\nx = x + 1\nx *= mask\nreturn self.proj(x)",
    "rebound in both arms": "x = self.norm(x)\nif mask is None:\n    x = x + 1\nelse:\n    x = x * mask\n"
    "x *= mask\nreturn self.proj(x)",
    "another name": "y = self.norm(x)\nx *= mask\nreturn self.proj(y)",
    "out of place": "x = self.norm(x)\nx = x * mask\nreturn self.proj(x)",
}


@pytest.mark.parametrize("body", list(MODIFIES.values()), ids=list(MODIFIES))
def test_an_in_place_use_is_found_with_its_line(body):
    model = _forward_of(body)()
    name = "norms.0" if "norms" in body else "norm"
    where = inplace_use(model, name)
    assert where is not None and where.startswith("Caller.forward, line ")


@pytest.mark.parametrize("body", list(LEAVES.values()), ids=list(LEAVES))
def test_no_in_place_use_where_the_name_is_rebound_or_another(body):
    assert inplace_use(_forward_of(body)(), "norm") is None


def test_a_module_without_readable_source_has_none():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    assert inplace_use(model, "1") is None


def test_patch_leaves_the_norm_alone_and_the_step_runs():
    body = MODIFIES["augmented"]
    model = _forward_of(body)()
    decisions = {d.name: d for d in invact.plan(model) if d.kind == "norm"}
    assert not decisions["norm"].replace and "modified in place" in decisions["norm"].reason
    invact.patch(model)
    assert not isinstance(model.norm, InvNorm)
    model(torch.randn(4, 8, requires_grad=True), torch.ones(4, 8)).sum().backward()


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("make", ["XLMModel", "FlaubertModel"])
def test_xlm_style_models_train_after_patch(make):
    config = {"XLMModel": transformers.XLMConfig, "FlaubertModel": transformers.FlaubertConfig}[make](
        emb_dim=32, n_layers=2, n_heads=4, vocab_size=64, dropout=0.0, attention_dropout=0.0
    )
    model = getattr(transformers, make)(config).train()
    invact.patch(model)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids).last_hidden_state.sum().backward()


def test_an_activation_whose_output_is_modified_in_place_is_left_alone():
    body = "x = self.act(self.proj(x))\nx *= mask\nreturn x"
    cls = _forward_of(body)
    model = cls()
    model.act = nn.GELU()
    (decision,) = [d for d in invact.plan(model) if d.kind == "activation"]
    assert not decision.replace and "modified in place" in decision.reason
