"""patch() across transformers' text models: every model type of the causal-LM and masked-LM auto
mappings, built from its default config shrunk to a tiny one (2 layers, width 64, 4 heads, vocabulary
128; random weights, nothing downloaded), fp32, train mode, every dropout probability 0, SDPA where
the model offers it. For each: what patch() replaced (activations, norms), the output's largest
difference from the unpatched model's (relative to its largest value; 0 means bitwise), the gradient's
difference (norm of the difference over the norm, all parameters), and the profiler's net memory held
after the forward, patched against unpatched. A model whose default config cannot be built small
(multimodal towers of fixed size, custom kernels), or that takes longer than --timeout seconds, is
listed as skipped with the reason. Prints a markdown table and writes
benchmarks/results/architectures_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import logging
import signal
import sys
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from timing import cpu_model, version, write_result

# Every integer config field of these names is set to the tiny value (a field the config lacks is left
# alone): one width for all families, 2 layers, 4 heads of 16 (GQA: 2 key/value heads), 4 experts.
TINY = dict(
    hidden_size=64, n_embd=64, d_model=64, intermediate_size=128, d_ff=128, encoder_ffn_dim=128,
    decoder_ffn_dim=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_hidden_layers=2, n_layer=2, num_layers=2, encoder_layers=2, decoder_layers=2,
    num_attention_heads=4, n_head=4, num_heads=4, encoder_attention_heads=4, decoder_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, rotary_dim=8, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16,
    vocab_size=128, max_position_embeddings=64, n_positions=64,
)  # fmt: skip
# Token ids a default config sets beyond the tiny vocabulary (an embedding's padding_idx must lie
# inside it): set to 0.
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
             "cls_token_id", "mask_token_id")  # fmt: skip
BATCH, SEQ = 2, 16
# A tiny model here has 0.1-1 M parameters; a default config whose towers the TINY fields do not reach
# (vision encoders of fixed size) keeps billions, which would take this machine's memory: such a model is
# counted on the meta device first and skipped above this many.
MAX_PARAMETERS = 20_000_000


class _Timeout(Exception):
    pass


def model_types() -> list[str]:
    """The causal-LM and masked-LM model types of the installed transformers, sorted."""
    from transformers.models.auto import modeling_auto as auto

    return sorted(set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES))


class TooLarge(Exception):
    pass


def build(model_type: str) -> torch.nn.Module:
    """The base model of `model_type` from its default config made tiny (TINY), dropout 0, seeded;
    TooLarge where it still has over MAX_PARAMETERS (counted on the meta device, nothing allocated) or
    cannot be counted there."""
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.for_model(model_type)
    for key, value in TINY.items():
        if isinstance(getattr(cfg, key, None), int):
            setattr(cfg, key, value)
    for key, value in list(vars(cfg).items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("_pdrop")):
            setattr(cfg, key, 0.0)
    for key in TOKEN_IDS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value >= TINY["vocab_size"]:
            setattr(cfg, key, 0)
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModel.from_config(cfg).parameters())
    except Exception as e:  # then not built for real either
        why = f"{type(e).__name__}: {_first_line(e)}"
        raise TooLarge(f"it does not build on the meta device: {why}") from None
    if n > MAX_PARAMETERS:
        raise TooLarge(f"{n / 1e6:.1f} M parameters at the tiny settings (over {MAX_PARAMETERS / 1e6:.0f} M)")
    torch.manual_seed(0)
    return AutoModel.from_config(cfg).train()


def _output(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for key in ("last_hidden_state", "logits"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    return out[0]


def _forward(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(output, bytes the forward left allocated), by the profiler's net memory."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = _call(model, ids)
    return out, sum(e.self_cpu_memory_usage for e in prof.events())


def _call(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's output on ids, without a cache where its forward takes use_cache (hybrid models'
    caches refuse a forward without attention layers in them)."""
    takes = "use_cache" in inspect.signature(model.forward).parameters
    return _output(model(input_ids=ids, use_cache=False) if takes else model(input_ids=ids))


def _gradient(model: torch.nn.Module, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    (out * weights).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def measure(model_type: str) -> dict:
    """One row: status "ok" with the figures, or "skipped" / "error" with the reason."""
    import invact

    row: dict = {"model_type": model_type}
    try:
        base = build(model_type)
        ids = torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            _call(base, ids)
    except _Timeout:
        raise
    except TooLarge as e:
        return row | {"status": "skipped", "reason": str(e)}
    except Exception as e:  # the model itself does not run small here: not patch()'s doing
        return row | {"status": "skipped", "reason": f"unpatched model: {type(e).__name__}: {_first_line(e)}"}
    row["class"] = type(base).__name__
    try:
        plain, patched = copy.deepcopy(base), copy.deepcopy(base)
        decisions = [d for d in invact.plan(patched) if d.replace]
        invact.patch(patched)
        out_plain, mem_plain = _forward(plain, ids)
        out_patched, mem_patched = _forward(patched, ids)
        weights = torch.randn(out_plain.shape, generator=torch.Generator().manual_seed(2))
        a, b = _gradient(plain, out_plain, weights), _gradient(patched, out_patched, weights)
    except _Timeout:
        raise
    except Exception as e:
        return row | {"status": "error", "reason": f"{type(e).__name__}: {_first_line(e)}"}
    return row | {
        "status": "ok",
        "activations": sum(d.kind == "activation" for d in decisions),
        "norms": sum(d.kind == "norm" for d in decisions),
        "output_rel": float((out_plain - out_patched).abs().max() / out_plain.abs().max()),
        "gradient_rel": float((a - b).norm() / a.norm()) if a.shape == b.shape else float("nan"),
        "eager_bytes": mem_plain,
        "memory_change": (mem_patched - mem_plain) / mem_plain,
    }


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:160]


def markdown(rows: list[dict]) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    lines = ["| model type | class | activations, norms replaced | output diff | gradient diff | "
             "eager KiB | patch() |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in ok:
        out = "bitwise" if r["output_rel"] == 0 else f"{r['output_rel']:.1e}"
        lines.append(f"| {r['model_type']} | {r['class']} | {r['activations']}, {r['norms']} | {out} | "
                     f"{r['gradient_rel']:.1e} | {r['eager_bytes'] / 1024:.0f} | "
                     f"{100 * r['memory_change']:+.1f}% |")  # fmt: skip
    others = [r for r in rows if r["status"] != "ok"]
    if others:
        lines += ["", "| model type | status | reason |", "|---|---|---|"]
        lines += [f"| {r['model_type']} | {r['status']} | {r['reason'].replace('|', '/')} |" for r in others]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="these model types (default: all)")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per model before it is skipped "
                        "(default 60)")  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON path (default results/architectures_cpu.json; the "
                        "markdown beside it)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.timeout < 1:
        parser.error("--timeout must be positive")
    try:
        types = model_types()
    except ImportError:
        parser.error("transformers is not installed (pip install -e '.[hf]')")
    if args.only:
        unknown = sorted(set(args.only) - set(types))
        if unknown:
            parser.error(f"not a causal-LM or masked-LM model type here: {', '.join(unknown)}")
        types = [t for t in types if t in args.only]
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    def timeout(*_):
        raise _Timeout

    signal.signal(signal.SIGALRM, timeout)
    rows = []
    for i, model_type in enumerate(types):
        signal.alarm(args.timeout)
        try:
            row = measure(model_type)
        except _Timeout:
            row = {"model_type": model_type, "status": "skipped", "reason": f"over {args.timeout} s"}
        finally:
            signal.alarm(0)
        rows.append(row)
        gc.collect()
        print(f"[{i + 1}/{len(types)}] {model_type}: {row['status']}", file=sys.stderr, flush=True)
    table = markdown(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    up = [r["model_type"] for r in ok if r["memory_change"] > 0]
    print(f"\n{cpu_model()}, torch {torch.__version__}, transformers {version('transformers')}: "
          f"{len(ok)} of {len(rows)} model types patched and compared; memory up on {len(up)}"
          f"{': ' + ', '.join(up) if up else ''}\n")  # fmt: skip
    print(table)
    result = {"device": "cpu", "cpu": cpu_model(), "torch": torch.__version__,
              "transformers": version("transformers"), "batch": BATCH, "seq": SEQ, "rows": rows}  # fmt: skip
    out = write_result(result, "architectures", "cpu", out=Path(args.out) if args.out else None)
    out.with_suffix(".md").write_text(table)
    return 1 if any(r["status"] == "error" for r in rows) or up else 0


if __name__ == "__main__":
    raise SystemExit(main())
