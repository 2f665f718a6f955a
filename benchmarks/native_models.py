"""What a training forward saves for backward in models written as plain PyTorch, eager against patch()
with the loop's loss as invact.functional.linear_cross_entropy, beside the Hugging Face model of the
same shape (eager against patch()): does a native model get the saving a Hugging Face one gets?

The native models are written here in the style of the code people train (random weights, nothing
downloaded): "native llama" as torchtitan writes its Llama 3 (nn.RMSNorm modules, rotary embeddings,
F.scaled_dot_product_attention, the FeedForward w2(F.silu(w1(x)) * w3(x)), a Linear head, the loop's
F.cross_entropy on the head's output); "native gpt" as nanoGPT and nanochat write GPT (LayerNorm,
a fused c_attn, the MLP c_proj(F.relu(c_fc(x)).square()), the head tied to the embedding). Their
Hugging Face counterparts: LlamaForCausalLM and GPT2LMHeadModel (its MLP's activation relu2 is not one
GPT-2 takes: "gelu_new", its own, there), each at the same hidden size, layers, intermediate size,
heads and vocabulary, with labels (the loss inside its forward), sdpa attention, no dropout.

Saved bytes: invact.memory.count_saved around the forward and the loss (distinct storages autograd
saves; parameters and the loss's early weight gradient excluded), fp32, batch x seq tokens. Writes
benchmarks/results/native_models_cpu.json and its markdown table (.md).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import invact
from invact.functional import linear_cross_entropy

from timing import device_name, write_result

SHAPE = dict(hidden=256, layers=6, intermediate=768, heads=4, vocab=2048)
SMALL = dict(hidden=32, layers=2, intermediate=64, heads=2, vocab=256)
# The cases: both families at SHAPE, and a Llama of 2 layers with a vocabulary of 32000 (Llama 2's),
# where the loss's fp32 logits are most of what the step saves.
CASES = [("llama", SHAPE), ("gpt", SHAPE), ("llama", SHAPE | dict(layers=2, vocab=32000))]


class Rotary(nn.Module):
    """cos and sin of the rotary embedding for `seq` positions (head dim d)."""

    def __init__(self, d: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer("inv", 1.0 / base ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, seq: int):
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), self.inv)
        return angles.cos(), angles.sin()


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(batch, seq, heads x head_dim) -> (batch, heads, seq, head_dim): the heads counted from the
    width, as torchtitan does, so that a tensor parallel projection's local heads split alike."""
    b, s, _ = t.shape
    return t.view(b, s, -1, head_dim).transpose(1, 2)


def _rotate(x, cos, sin):
    a, b = x[..., ::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # fp32 tables: the model's dtype, as torchtitan casts them
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (_heads(w(x), self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, hidden)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class NativeLlama(nn.Module):
    def __init__(self, hidden: int, layers: int, intermediate: int, heads: int, vocab: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.rotary = Rotary(hidden // heads)
        self.layers = nn.ModuleList(LlamaBlock(hidden, heads, intermediate) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.output = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        cos, sin = self.rotary(tokens.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


class GPTAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (_heads(t, self.head_dim) for t in self.c_attn(x).split(d, 2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = GPTAttention(dim, heads), MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NativeGPT(nn.Module):
    def __init__(self, hidden: int, layers: int, intermediate: int, heads: int, vocab: int, positions: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.h = nn.ModuleList(GPTBlock(hidden, heads, intermediate) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT's
        for module in self.modules():  # nanoGPT's initialisation: N(0, 0.02), biases 0
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _hf(kind: str, shape: dict, seq: int) -> nn.Module:
    import transformers

    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
            intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["heads"], vocab_size=shape["vocab"], tie_word_embeddings=False,
            attn_implementation="sdpa",
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        n_embd=shape["hidden"], n_layer=shape["layers"], n_inner=shape["intermediate"], n_head=shape["heads"],
        vocab_size=shape["vocab"], n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _native(kind: str, shape: dict, seq: int) -> nn.Module:
    if kind == "torchtitan llama":
        return _torchtitan()
    return NativeLlama(**shape) if kind == "llama" else NativeGPT(**shape, positions=seq)


# torchtitan's own Llama 3 "debugmodel" (hidden 256, 6 layers, FFN 768, vocabulary 2048, 16 heads), where
# torchtitan is importable (--torchtitan; no dependency of invact's: `pip install --no-deps torchtitan
# spmd-types tyro docstring-parser` into a path of its own serves): built from its registry, its weights
# set by its own init_weights, each FlexAttention (no CPU backward in torch) replaced by its own
# ScaledDotProductAttention (is_causal); the loop's loss on the head's output as its trainer computes it,
# or, patched, on the hidden states its `_skip_lm_head` switch returns.
TORCHTITAN_SHAPE = dict(hidden=256, layers=6, intermediate=768, heads=16, vocab=2048)


def _torchtitan() -> nn.Module:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    model = model_registry("debugmodel").model.build()
    model.init_weights()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FlexAttention):
                setattr(module, name, ScaledDotProductAttention(ScaledDotProductAttention.Config()))
    return model


def _head(model: nn.Module) -> str:
    return "output" if isinstance(model, NativeLlama) else "lm_head"


def _call(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "_skip_lm_head"):  # torchtitan's forward takes the positions (RoPE)
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    return model(tokens)


def _body(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's hidden states before its head: the loop's one-line change."""
    if hasattr(model, "_skip_lm_head"):  # torchtitan's own switch
        model._skip_lm_head = True
        try:
            return _call(model, tokens)
        finally:
            model._skip_lm_head = False
    head = getattr(model, _head(model))
    setattr(model, _head(model), nn.Identity())
    try:
        return model(tokens)
    finally:
        setattr(model, _head(model), head)


def _saved(model: nn.Module, tokens: torch.Tensor, native: bool, patched: bool) -> tuple[int, float]:
    """(bytes saved by one training forward with its loss, the loss): the Hugging Face model with labels;
    a native model with its loop's loss (eager: F.cross_entropy on the head's fp32 output; patched: the
    loop's one-line change, linear_cross_entropy on the head's input and weight)."""
    labels = tokens.roll(-1, 1)
    with invact.memory.count_saved(model) as counted:
        if not native:
            loss = model(input_ids=tokens, labels=tokens).loss
        elif not patched:
            loss = F.cross_entropy(_call(model, tokens).flatten(0, 1).float(), labels.flatten(0, 1))
        else:
            hidden = _body(model, tokens)
            weight = getattr(model, _head(model)).weight
            loss = linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(0, 1))
    loss.backward()
    return counted.report.saved_bytes, loss.item()


def run(cases: list[tuple[str, dict]], batch: int, seq: int) -> list[dict]:
    rows = []
    for kind, shape in cases:
        for native in (True,) if kind == "torchtitan llama" else (True, False):
            torch.manual_seed(0)
            model = (_native if native else _hf)(kind, shape, seq).train()
            tokens = torch.randint(0, shape["vocab"], (batch, seq))
            eager, eager_loss = _saved(model, tokens, native, False)
            patched_model = copy.deepcopy(model)
            invact.patch(patched_model)
            patched, patched_loss = _saved(patched_model, tokens, native, True)
            label = kind if kind == "torchtitan llama" else f"{'native' if native else 'Hugging Face'} {kind}"
            rows.append(dict(model=label, shape=shape, eager_bytes=eager, patched_bytes=patched,
                             ratio=patched / eager, losses=[eager_loss, patched_loss],
                             kinds=sorted({d.kind for d in invact.plan(model) if d.replace})))  # fmt: skip
    return rows


def markdown(rows: list[dict], batch: int, seq: int) -> str:
    lines = [
        f"## Saved for backward, native PyTorch against Hugging Face ({batch} x {seq} tokens, fp32)",
        "",
        "`python benchmarks/native_models.py --torchtitan`: one training forward and its loss, eager against "
        "`patch()` (native: with the loop's loss as `invact.functional.linear_cross_entropy`).",
        "",
        "| model | hidden, layers, FFN, vocabulary | eager MiB | patch() MiB | ratio | loss eager, patched "
        "| what patch() took |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, mib, loss = r["shape"], (r["eager_bytes"] / 2**20, r["patched_bytes"] / 2**20), r["losses"]
        lines.append(f"| {r['model']} | {s['hidden']}, {s['layers']}, {s['intermediate']}, {s['vocab']} | "
                     f"{mib[0]:.1f} | {mib[1]:.1f} | {r['ratio']:.3f} | {loss[0]:.6f}, {loss[1]:.6f} | "
                     f"{', '.join(r['kinds'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="small shapes (a check that it runs)")
    parser.add_argument("--torchtitan", action="store_true", help="also torchtitan's own Llama 3 debugmodel")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--out", default=None, help="the JSON file (default: results/native_models_cpu.json)")
    args = parser.parse_args(argv)
    cases, seq = ([("llama", SMALL), ("gpt", SMALL)], 16) if args.small else (CASES, args.seq)
    if args.torchtitan:
        cases = [*cases, ("torchtitan llama", TORCHTITAN_SHAPE)]
    rows = run(cases, args.batch, seq)
    table = markdown(rows, args.batch, seq)
    print(table)
    result = dict(device=device_name("cpu"), versions=f"torch {torch.__version__}", batch=args.batch, seq=seq,
                  rows=rows)  # fmt: skip
    path = write_result(result, "native_models", "cpu", out=Path(args.out) if args.out else None)
    path.with_suffix(".md").write_text(table)  # the table the docs include


if __name__ == "__main__":
    main()
