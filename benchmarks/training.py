"""Training curves of torch against InvAct and FewBit-style k-bit gradients, across seeds: does InvAct
change training?

Models (transformers configs, random init, nothing downloaded), on data every machine has:
- `gpt2`: a GPT-2-style byte-level LM (tanh-GELU) on the source text of Python's standard library;
- `llama`: a Llama-style byte-level LM (SwiGLU) on the same text;
- `vit`: a ViT-style classifier (GELU) on scikit-learn's bundled 8x8 digits.
Variants, with the same initial weights and the same batches for a given seed: `torch`; `bits`
(invact.patch(norms=False): the activations, the default family); `norms` (invact.patch(loss=False):
the activations and the norms inverted, invact.norm); `loss` (invact.patch's default: also a
language model's loss computed from hidden states, invact.loss; the ViT is patched as by `norms`);
`paper` (InvAct with the paper's formulas, benchmarks/family.py); `precision_bit`; `fewbit1` and
`fewbit4` (benchmarks/fewbit.py, a baseline); and `perturbed`, a control: torch with a relative
noise of one rounding (the dtype's eps) on the activation's gradient, which shows how far a
negligible change moves a model's curves. One model (--trainer, default gpt2) is also trained
through transformers.Trainer, torch against invact.patch: the drop-in path.
Each run logs the training loss and, every --eval-every steps, the validation loss on one fixed
validation set (LMs: --val-batches windows of the held-out bytes; digits: all 297 held-out images).

The statistic, per model, dtype, variant and logged step: the mean over seeds of the paired
difference to torch, in units of the spread (standard deviation) of torch's own loss across seeds.
|that| <= 1 means the variant's curve stays within torch's seed spread there. Writes
benchmarks/results/training_<device>.json and its markdown summary beside it (.md), prints the
summary and (with matplotlib) plots each model to benchmarks/results/training_<model>.png (with
--out, <its stem>_<model>.png).
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
from family import patch_family
from fewbit import patch_fewbit
from swap import replace_activations
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
    seeds = iter(range(1 << 30))
    return replace_activations(model, lambda old, act: _Perturbed(old, seed=next(seeds)))


VARIANTS: dict[str, Callable[[nn.Module], object]] = {
    "torch": lambda m: None,
    "perturbed": perturb,
    "bits": lambda m: invact.patch(m, mode="bits", norms=False, loss=False),
    "norms": lambda m: invact.patch(m, loss=False),  # the activations and the norms inverted
    "loss": lambda m: invact.patch(m),  # patch()'s default: also an LM's loss from hidden states
    "paper": lambda m: patch_family(m, "paper"),
    "precision_bit": lambda m: invact.patch(m, mode="precision_bit", norms=False, loss=False),
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
TRAINER_VARIANTS = ("torch", "bits")  # the drop-in path: Trainer with and without invact.patch
# (batch, learning rate) per model. The ViT on digits at batch 16 and lr 1e-3 trained chaotically: the
# control's one-rounding perturbation moved its mean validation curve by up to 0.44 (fp32) and 1.66
# (bf16) seed spreads over 4 seeds x 200 steps, so any change at all looked large there. At batch 32
# and lr 3e-4 the control moved it by 1.2e-5 spreads (4 seeds, fp32; batch 64 at 5e-4: 8.9e-5), so a
# difference InvAct makes would show.
HYPER = {"gpt2": (16, 1e-3), "llama": (16, 1e-3), "vit": (32, 3e-4)}
_BATCH_HELP = ", ".join(f"{m} {b}" for m, (b, _) in HYPER.items())
_LR_HELP = ", ".join(f"{m} {lr:g}" for m, (_, lr) in HYPER.items())


def hyper(model: str, args) -> tuple[int, float]:
    """(batch, lr): --batch and --lr where given, else the model's HYPER entry."""
    batch, lr = HYPER[model]
    return args.batch or batch, args.lr or lr


VAL_SEED = 10_000  # draws the validation windows: the same for every run, so the spread is the seeds'


def run(model_name: str, variant: str, seed: int, dtype: str, data, args) -> dict:
    """One training run: the seed fixes the initial weights and every batch, for all variants alike."""
    torch.manual_seed(seed)
    model = build(model_name, args.small)
    VARIANTS[variant](model)
    model.train()
    batch, lr = hyper(model_name, args)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    val_gen = torch.Generator().manual_seed(VAL_SEED)  # one validation set for every seed
    val_batches = data.validation(args.val_batches, batch, val_gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    train, val = [], []
    for step in range(1, args.steps + 1):
        with autocast:
            loss = model(**data.batch("train", batch, gen)).loss
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


class _Examples(torch.utils.data.Dataset):
    """Batches as a map-style dataset of single examples, for transformers.Trainer."""

    def __init__(self, batches: list[dict]):
        self.items = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["labels"]))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def run_trainer(model_name: str, variant: str, seed: int, dtype: str, data, args) -> dict:
    """The same model and variant trained by transformers.Trainer, the drop-in path end to end: the
    training examples are fixed (drawn once, for every seed), Trainer shuffles them with data_seed =
    seed, and every other setting is Trainer's default (linear decay, gradient clipping at 1) but the
    learning rate and bf16 (Trainer's CPU autocast). Logs the loss of every step and the validation
    loss every --eval-every steps."""
    import tempfile

    import transformers

    examples = torch.Generator().manual_seed(0)
    batch, lr = hyper(model_name, args)
    train = _Examples([data.batch("train", batch, examples) for _ in range(args.steps)])
    val = _Examples(data.validation(args.val_batches, batch, torch.Generator().manual_seed(VAL_SEED)))
    torch.manual_seed(seed)
    model = build(model_name, args.small)
    VARIANTS[variant](model)
    with tempfile.TemporaryDirectory() as tmp:
        targs = transformers.TrainingArguments(
            output_dir=tmp, use_cpu=True, bf16=dtype == "bf16", seed=seed, data_seed=seed,
            per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
            max_steps=args.steps, learning_rate=lr, logging_steps=1, eval_strategy="steps",
            eval_steps=args.eval_every, save_strategy="no", report_to="none", disable_tqdm=True,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=train, eval_dataset=val)
        trainer.remove_callback(transformers.PrinterCallback)  # the log of every step, printed; we keep it
        trainer.train()
    history = trainer.state.log_history
    return {
        "train": [h["loss"] for h in history if "loss" in h],
        "val": [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h],
    }


def paired(by_variant: dict, variant: str) -> dict:
    """At each logged validation step: each seed's difference to torch's run of the same seed, their
    mean, torch's spread across seeds (sample standard deviation) and |mean| / spread, the statistic."""
    base, runs_v = by_variant["torch"], by_variant[variant]  # seed -> run
    seeds = sorted(base)
    steps = [s for s, _ in base[seeds[0]]["val"]]
    diffs = [[runs_v[s]["val"][i][1] - base[s]["val"][i][1] for s in seeds] for i in range(len(steps))]
    spread = [statistics.stdev(base[s]["val"][i][1] for s in seeds) for i in range(len(steps))]
    mean = [statistics.fmean(d) for d in diffs]
    pairs = zip(mean, spread, strict=True)
    ratio = [abs(m) / sd if sd > 0 else float("inf") if m else 0.0 for m, sd in pairs]
    return {"steps": steps, "diffs": diffs, "mean": mean, "spread": spread, "ratio": ratio}


def summarize(runs: dict) -> list[dict]:
    """Per model, dtype and variant: the largest statistic over the logged validation steps (and where),
    and the final validation loss, mean over seeds."""
    rows = []
    for (model, dtype), by_variant in runs.items():
        for variant, runs_v in by_variant.items():
            p = paired(by_variant, variant)
            worst = max(range(len(p["steps"])), key=p["ratio"].__getitem__)
            final = statistics.fmean(run["val"][-1][1] for run in runs_v.values())
            rows.append({"model": model, "dtype": dtype, "variant": variant, "final_val_loss": final,
                         "max_diff_over_spread": p["ratio"][worst],
                         "at_step": p["steps"][worst]})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["model", "dtype", "variant", "final val loss (mean of seeds)",
            "max over steps of |mean diff to torch| / torch's seed spread", "at step"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['variant']} | {r['final_val_loss']:.4f} | "
                     f"{r['max_diff_over_spread']:.2f} | {r['at_step']} |")  # fmt: skip
    return "\n".join(lines)


def figure(result: dict, model: str):
    """A matplotlib figure for one model: per dtype (columns), the validation loss (mean and min-max band
    over seeds) of each variant above, and below each seed's difference to torch (thin) with their mean
    (thick) against torch's seed spread (grey band, +-1 standard deviation)."""
    import matplotlib.pyplot as plt

    dtypes = [key.rsplit("/", 1)[1] for key in result["runs"] if key.rsplit("/", 1)[0] == model]
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6.5 * len(dtypes), 8), squeeze=False, sharex=True)
    for col, dtype in enumerate(dtypes):
        by_variant = result["runs"][f"{model}/{dtype}"]
        top, bottom = axes[0][col], axes[1][col]
        for variant, seeds in by_variant.items():
            p = paired(by_variant, variant)
            columns = list(zip(*[[v for _, v in run["val"]] for run in seeds.values()], strict=True))
            (line,) = top.plot(p["steps"], [statistics.fmean(c) for c in columns], label=variant)
            color = line.get_color()
            top.fill_between(p["steps"], [min(c) for c in columns], [max(c) for c in columns], color=color,
                             alpha=0.15)  # fmt: skip
            if variant == "torch":
                bottom.fill_between(p["steps"], [-s for s in p["spread"]], p["spread"], color="0.85",
                                    label="torch's seed spread (1 sd)")  # fmt: skip
                continue
            for per_seed in zip(*p["diffs"], strict=True):
                bottom.plot(p["steps"], per_seed, color=color, alpha=0.25, linewidth=0.8)
            bottom.plot(p["steps"], p["mean"], color=color, linewidth=2, label=f"{variant} (mean)")
        top.set(title=f"{model}, {dtype}: validation loss (mean, min-max over seeds)", ylabel="loss")
        bottom.set(title="difference to torch, per seed (thin) and mean (thick)", xlabel="step",
                   ylabel="loss - torch's loss, same seed")  # fmt: skip
        top.legend(fontsize=8)
        bottom.legend(fontsize=7)
    fig.tight_layout()
    return fig


def statistic_figure(result: dict):
    """The statistic |mean paired difference to torch| / torch's seed spread at every logged step, one
    panel per model and dtype, one line per variant; the dashed line at 1 is the seed spread."""
    import matplotlib.pyplot as plt

    keys = list(result["runs"])
    cols = 2
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        by_variant = result["runs"][key]
        for i, variant in enumerate(by_variant):
            if variant != "torch":
                p = paired(by_variant, variant)
                ax.plot(p["steps"], p["ratio"], marker=".", label=variant, color=f"C{i}")
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set(title=key, xlabel="step", ylabel="|mean diff| / spread", yscale="log")
        ax.legend(fontsize=7, ncol=2)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot(result: dict, out_dir: Path, prefix: str = "training") -> list[Path]:
    """figure() of each model, saved as out_dir/<prefix>_<model>.png (nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for model in dict.fromkeys(key.rsplit("/", 1)[0] for key in result["runs"]):
        fig = figure(result, model)
        path = out_dir / f"{prefix}_{model.replace('+', '_').lower()}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"],
                        help="bf16: CPU autocast to bfloat16")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=4, help="seeds per variant (default 4)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--eval-every", type=int, default=20, help="validation every N steps (default 20)")
    parser.add_argument("--val-batches", type=int, default=4, help="validation batches (default 4)")
    parser.add_argument("--batch", type=int, help=f"batch size (default per model: {_BATCH_HELP})")
    parser.add_argument("--seq", type=int, default=64, help="LM context in bytes (default 64)")
    parser.add_argument("--lr", type=float, help=f"AdamW learning rate (default per model: {_LR_HELP})")
    parser.add_argument("--trainer", choices=[*MODELS, "none"], default="gpt2",
                        help="also train this model through transformers.Trainer, with the variants "
                        f"among {', '.join(TRAINER_VARIANTS)} (default gpt2; none: skip)")  # fmt: skip
    parser.add_argument("--small", action="store_true", help="a smoke run: tiny models, 2 seeds, 4 steps")
    parser.add_argument("--out", type=Path, help="JSON path (default results/training_<device>.json)")
    args = parser.parse_args(argv)
    if args.small:
        args.seeds, args.steps, args.eval_every, args.val_batches, args.batch, args.seq = 2, 4, 2, 1, 4, 16
    for name in ("seeds", "steps", "eval_every", "val_batches", "batch", "seq"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.seeds < 2:
        parser.error("--seeds must be at least 2: the statistic is the spread across seeds")
    variants = ["torch"] + [v for v in args.variants if v != "torch"]
    trainer_variants = [v for v in variants if v in TRAINER_VARIANTS]
    lm_models = {"gpt2", "llama"} & {*args.models, args.trainer}
    lm = ByteLM(200_000 if args.small else 2_000_000, args.seq) if lm_models else None
    digits = Digits() if "vit" in {*args.models, args.trainer} else None
    jobs = [(model, run, variants) for model in args.models]
    if args.trainer != "none":
        jobs.append((args.trainer, run_trainer, trainer_variants))
    runs: dict = {}
    t0 = time.perf_counter()
    total = sum(len(args.dtypes) * len(vs) * args.seeds for _, _, vs in jobs)
    done = 0
    for model, runner, job_variants in jobs:
        key = model if runner is run else f"{model}+Trainer"
        for dtype in args.dtypes:
            by_variant = runs.setdefault((key, dtype), {})
            for variant in job_variants:
                for seed in range(args.seeds):
                    data = digits if model == "vit" else lm
                    by_variant.setdefault(variant, {})[seed] = runner(model, variant, seed, dtype, data, args)
                    done += 1
                    print(f"[{done}/{total}] {key} {dtype} {variant} seed {seed}: final val "
                          f"{by_variant[variant][seed]['val'][-1][1]:.4f} ({time.perf_counter() - t0:.0f} s)",
                          flush=True)  # fmt: skip
    rows = summarize(runs)
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {"variants": variants}
    settings["batch_lr"] = {m: hyper(m, args) for m in HYPER if m in {*args.models, args.trainer}}
    print("\n" + markdown(rows))
    result = {
        "device": device_name("cpu"),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - t0,
        "settings": settings,
        "summary": rows,
        "runs": {
            f"{m}/{d}": {v: {str(s): r for s, r in seeds.items()} for v, seeds in by.items()}
            for (m, d), by in runs.items()
        },  # fmt: skip
    }
    out = write_result(result, "training", "cpu", out=args.out)
    out.with_suffix(".md").write_text(markdown(rows) + "\n")  # the table the docs include
    # the default run's plots are training_<model>.png; another --out's are <its stem>_<model>.png
    for path in plot(result, out.parent, "training" if args.out is None else out.stem):
        print(f"plotted {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
