"""Training curves of torch against InvAct and FewBit-style k-bit gradients, across seeds: does InvAct
change training?

Models (transformers configs, random init, nothing downloaded), on data every machine has:
- `gpt2`: a GPT-2-style byte-level LM (tanh-GELU) on the source text of Python's standard library;
- `llama`: a Llama-style byte-level LM (SwiGLU) on the same text;
- `vit`: a ViT-style classifier (GELU) on scikit-learn's bundled 8x8 digits.
Variants, with the same initial weights and the same batches for a given seed: `torch`; `bits`
(invact.patch, the default family); `precision_bit`; `fewbit1` and `fewbit4` (benchmarks/fewbit.py, a
baseline); and `perturbed`, a control: torch with a relative noise of one rounding (the dtype's eps)
on the activation's gradient, which shows how far a negligible change moves a model's curves.
Each run logs the training loss and, every --eval-every steps, the validation loss (LMs:
--val-batches random windows of the held-out bytes; digits: all 297 held-out images).

The statistic, per model, dtype, variant and logged step: the mean over seeds of the paired
difference to torch, in units of the spread (standard deviation) of torch's own loss across seeds.
|that| <= 1 means the variant's curve stays within torch's seed spread there. Writes
benchmarks/results/training_<device>.json, prints a markdown summary and (with matplotlib) plots the
validation curves to benchmarks/results/training_<model>.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch
from fewbit import patch_fewbit
from torch import nn

import invact

from timing import device_name, write_result

# The control: torch's activation with its incoming gradient scaled by (1 + eps N(0, 1)), eps the
# machine epsilon of the gradient's dtype: one rounding's size. Where a model's training is chaotic,
# even this moves a seed's curve; InvAct's differences are then to be read against the control's.


class _Perturbed(nn.Module):
    def __init__(self, act: nn.Module, seed: int):
        super().__init__()
        self.act, self.gen = act, torch.Generator().manual_seed(seed)

    def forward(self, x):
        y = self.act(x)
        if y.requires_grad:
            noise = torch.randn(y.shape, generator=self.gen)
            y.register_hook(lambda g: (g.float() * (1 + torch.finfo(g.dtype).eps * noise)).to(g.dtype))
        return y


def perturb(model: nn.Module) -> list[str]:
    names = [d.name for d in invact.plan(model) if d.replace]
    for i, name in enumerate(names):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, _Perturbed(getattr(parent, attr), seed=i))
    return names


VARIANTS: dict[str, Callable[[nn.Module], object]] = {
    "torch": lambda m: None,
    "perturbed": perturb,
    "bits": lambda m: invact.patch(m, mode="bits"),
    "precision_bit": lambda m: invact.patch(m, mode="precision_bit"),
    "fewbit1": lambda m: patch_fewbit(m, 1),
    "fewbit4": lambda m: patch_fewbit(m, 4),
}


def stdlib_bytes(n: int) -> torch.Tensor:
    """The first n bytes of the standard library's .py sources, in sorted path order, as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= n:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:n]), dtype=torch.uint8).clone()


class ByteLM:
    """Random windows of `seq` + 1 bytes: train from the first 90%, validation from the rest."""

    def __init__(self, n_bytes: int, seq: int):
        data = stdlib_bytes(n_bytes).long()
        split = int(0.9 * len(data))
        self.train, self.val, self.seq = data[:split], data[split:], seq

    def batch(self, split: str, size: int, gen: torch.Generator) -> dict:
        data = self.train if split == "train" else self.val
        start = torch.randint(0, len(data) - self.seq - 1, (size,), generator=gen)
        ids = torch.stack([data[s : s + self.seq] for s in start.tolist()])
        return {"input_ids": ids, "labels": ids}

    def validation(self, count: int, size: int, gen: torch.Generator) -> list[dict]:
        return [self.batch("val", size, gen) for _ in range(count)]


class Digits:
    """scikit-learn's 1797 8x8 digits, pixels scaled to [0, 1]; the last 297 are validation."""

    def __init__(self):
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(digits.target)
        self.train, self.val = (x[:1500], y[:1500]), (x[1500:], y[1500:])

    def batch(self, split: str, size: int, gen: torch.Generator) -> dict:
        x, y = self.train
        idx = torch.randint(0, len(y), (size,), generator=gen)
        return {"pixel_values": x[idx], "labels": y[idx]}

    def validation(self, count: int, size: int, gen: torch.Generator) -> list[dict]:
        return [{"pixel_values": self.val[0], "labels": self.val[1]}]  # all 297, the same for every run


def build(model: str, small: bool) -> nn.Module:
    import transformers

    width = 32 if small else 128
    if model == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=256, n_positions=128, n_embd=width, n_layer=2, n_head=4, attn_implementation="sdpa"
            )
        )
    if model == "llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=256,
                hidden_size=width,
                intermediate_size=int(2.75 * width),
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=128,
                attn_implementation="sdpa",
            )
        )
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=width, intermediate_size=4 * width,
        num_hidden_layers=2, num_attention_heads=4, num_labels=10, attn_implementation="sdpa"))  # fmt: skip


MODELS = ("gpt2", "llama", "vit")


def run(model_name: str, variant: str, seed: int, dtype: str, data, args) -> dict:
    """One training run: the seed fixes the initial weights and every batch, for all variants alike."""
    torch.manual_seed(seed)
    model = build(model_name, args.small)
    VARIANTS[variant](model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(seed)
    val_gen = torch.Generator().manual_seed(10_000 + seed)
    val_batches = data.validation(args.val_batches, args.batch, val_gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    train, val = [], []
    for step in range(1, args.steps + 1):
        with autocast:
            loss = model(**data.batch("train", args.batch, gen)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        train.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad(), autocast:
                val.append((step, statistics.fmean(model(**b).loss.item() for b in val_batches)))
            model.train()
    return {"train": train, "val": val}


def summarize(runs: dict, variants: list[str]) -> list[dict]:
    """Per model, dtype and variant: the largest |mean paired difference to torch| / torch's seed spread
    over the logged validation steps, and the final mean validation loss."""
    rows = []
    for (model, dtype), by_variant in runs.items():
        base = by_variant["torch"]  # seed -> run
        seeds = sorted(base)
        steps = [s for s, _ in base[seeds[0]]["val"]]
        torch_at = [[base[s]["val"][i][1] for s in seeds] for i in range(len(steps))]
        spread = [statistics.stdev(v) if len(v) > 1 else float("nan") for v in torch_at]
        for variant in variants:
            runs_v = by_variant[variant]
            worst, worst_step = 0.0, steps[0]
            for i, step in enumerate(steps):
                diff = statistics.fmean(runs_v[s]["val"][i][1] - base[s]["val"][i][1] for s in seeds)
                ratio = abs(diff) / spread[i] if spread[i] > 0 else float("inf") if diff else 0.0
                if ratio > worst:
                    worst, worst_step = ratio, step
            final = statistics.fmean(runs_v[s]["val"][-1][1] for s in seeds)
            rows.append({"model": model, "dtype": dtype, "variant": variant, "final_val_loss": final,
                         "max_diff_over_spread": worst, "at_step": worst_step})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["model", "dtype", "variant", "final val loss (mean of seeds)",
            "max over steps of |mean diff to torch| / torch's seed spread", "at step"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['variant']} | {r['final_val_loss']:.4f} | "
                     f"{r['max_diff_over_spread']:.2f} | {r['at_step']} |")  # fmt: skip
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for model in result["settings"]["models"]:
        dtypes = result["settings"]["dtypes"]
        fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
        for ax, dtype in zip(axes[0], dtypes, strict=True):
            for variant, seeds in result["runs"][f"{model}/{dtype}"].items():
                curves = [[v for _, v in run["val"]] for run in seeds.values()]
                steps = [s for s, _ in next(iter(seeds.values()))["val"]]
                mean = [statistics.fmean(c) for c in zip(*curves, strict=True)]
                lo = [min(c) for c in zip(*curves, strict=True)]
                hi = [max(c) for c in zip(*curves, strict=True)]
                (line,) = ax.plot(steps, mean, label=variant)
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
            ax.set(title=f"{model}, {dtype}: validation loss (mean, min-max over seeds)", xlabel="step",
                   ylabel="loss")  # fmt: skip
            ax.legend()
        path = out_dir / f"training_{model}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"],
                        help="bf16: CPU autocast to bfloat16")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=4, help="seeds per variant (default 4)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--eval-every", type=int, default=20, help="validation every N steps (default 20)")
    parser.add_argument("--val-batches", type=int, default=4, help="validation batches (default 4)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument("--seq", type=int, default=64, help="LM context in bytes (default 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--small", action="store_true", help="a smoke run: tiny models, 2 seeds, 4 steps")
    parser.add_argument("--out", type=Path, help="JSON path (default results/training_<device>.json)")
    args = parser.parse_args(argv)
    if args.small:
        args.seeds, args.steps, args.eval_every, args.val_batches, args.batch, args.seq = 2, 4, 2, 1, 4, 16
    for name in ("seeds", "steps", "eval_every", "val_batches", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.seeds < 2:
        parser.error("--seeds must be at least 2: the statistic is the spread across seeds")
    variants = ["torch"] + [v for v in args.variants if v != "torch"]
    lm = (
        ByteLM(200_000 if args.small else 2_000_000, args.seq)
        if {"gpt2", "llama"} & set(args.models)
        else None
    )
    digits = Digits() if "vit" in args.models else None
    runs: dict = {}
    t0 = time.perf_counter()
    total = len(args.models) * len(args.dtypes) * len(variants) * args.seeds
    done = 0
    for model in args.models:
        for dtype in args.dtypes:
            by_variant = runs.setdefault((model, dtype), {})
            for variant in variants:
                for seed in range(args.seeds):
                    data = digits if model == "vit" else lm
                    by_variant.setdefault(variant, {})[seed] = run(model, variant, seed, dtype, data, args)
                    done += 1
                    print(f"[{done}/{total}] {model} {dtype} {variant} seed {seed}: final val "
                          f"{by_variant[variant][seed]['val'][-1][1]:.4f} ({time.perf_counter() - t0:.0f} s)",
                          flush=True)  # fmt: skip
    rows = summarize(runs, variants)
    print("\n" + markdown(rows))
    result = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - t0,
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"variants": variants},
        "summary": rows,
        "runs": {
            f"{m}/{d}": {v: {str(s): r for s, r in seeds.items()} for v, seeds in by.items()}
            for (m, d), by in runs.items()
        },  # fmt: skip
    }
    out = write_result(result, "training", "cpu", out=args.out)
    for path in plot(result, out.parent):
        print(f"plotted {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
