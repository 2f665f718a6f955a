"""The `invact` command (also `python -m invact`). `invact plan CONFIG.json --batch B --seq S`: what one
training forward of a Hugging Face model saves for backward, eager and after invact.patch(), from its
config alone, on the meta device (invact.planner.forward); with --fits SIZE, --step or --explain the
peak of a whole training step and the longest sequence (or largest batch) that fits
(invact.planner.step). This module parses the arguments, checks them and prints
(invact.planner.report's tables). Bad input
is one line on stderr, exit status 2.

The command parses its arguments and checks its config file (it exists, reads as a JSON object, names a
model_type) before torch, transformers and invact's runtime load (seconds; invact/__init__.py defers
the runtime in the command's process), so bad input answers at once; this module imports the standard
library alone at its top."""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path

from invact.planner.options import (
    DEFAULT_IMAGE_SIDE,
    DEFAULT_RANK,
    DEFAULT_RECIPES,
    DEVICES,
    DTYPE_NAMES,
    RECIPE_LABELS,
    SEQ_MULTIPLE,
    PlanError,
    read_size,
)
from invact.planner.report import format_forward, format_step

ERROR_STATUS = 2  # bad input, as argparse's own usage errors
PROG = "invact plan"

_SIDE = DEFAULT_IMAGE_SIDE  # short, for the help texts' lines

# The options that take a value: a value that looks negative ("--fits -5GiB") is taken as theirs and
# refused by their check with the reason, not by argparse as a missing value.
_VALUED = ("--batch", "--seq", "--dtype", "--images", "--image-size", "--fits", "--rank", "--gpus", "--tp")

_SUMMARY = (
    "what training a Hugging Face model saves for backward, eager and after invact.patch(), from its "
    "config alone; with --fits SIZE, how long a sequence (or how large a batch) fits in SIZE (24GiB, "
    "80GB)"
)

_EPILOG = """\
examples:
  invact plan config.json --batch 1 --seq 4096     what one training forward saves, eager and patched
  invact plan config.json --fits 24GiB             how long a sequence fits in 24 GiB (at batch 1)
  invact plan config.json --fits 80GiB --seq 4096  how large a batch of 4096 tokens fits in 80 GiB
  invact plan config.json --fits 80GiB --gpus 8 --fsdp   the same per GPU of 8 with FSDP2
  invact plan config.json --fits 80GiB --tp 4      the same per GPU of 4 with tensor parallelism
  invact plan --help                               every option, and what the figures are"""

_PLAN_DESCRIPTION = """\
Build the model a Hugging Face config JSON describes (its image-text-to-text class where it has a
vision tower, its sequence-to-sequence LM for an encoder-decoder, else its causal-LM class, else its
base model) on the meta device, with shapes only: no weights, nothing allocated, nothing downloaded.
Run one training-mode forward of input_ids (batch, seq) (use_cache off; a model whose forward takes
labels also gets labels = input_ids, so its loss is computed as in a training step; a
vision-language model also gets images) under invact's saved-tensor counter, once eager and once
after invact.patch(model), and print what each saves for backward, per kind of module and in total,
with patch()'s decisions. With --fits SIZE, --step or --explain: the peak of a whole training step
(weights, gradients, AdamW state, activations and what forward and backward allocate on the way),
eager and patched, without and with checkpointing, per recipe, and with --fits the longest sequence
(or largest batch) whose step fits in SIZE."""

_PLAN_EPILOG = f"""\
What the figures are: bytes autograd saves for backward in one training forward, what a real forward
of these shapes keeps for the backward pass, each storage once (a tensor saved by an activation and
by the next Linear counts once), the model's parameters and buffers excluded. Not in them: the
forward's output (eager: the logits, batch x seq x vocab, and the loss; printed separately),
gradients, optimizer state, and what backward allocates.
Head and loss: what the output head (lm_head) and the model's loss save. Eager, Hugging Face's loss
upcasts the logits and its log-softmax saves an fp32 (tokens x vocab) tensor; patch() computes the
loss and its gradients from the hidden state and the head's weight a chunk of rows at a time
(invact.loss), keeping the hidden states' gradient (the head weight's counts as its gradient).
--no-labels runs the forward without labels (no loss); --no-loss plans patch(loss=False).

Kinds: each saved storage counts where it was first saved (the innermost module running then), an
activation's output with the activation wherever it is saved, and a gated product act(g) * u, what a
gated MLP's down projection saves, as its own kind (patch() recomputes it in backward). Where
patch() moves y into a fused gate_up output (Phi-3, MoE experts), that one storage counts under
"MLP, other". patch() inverts the norms whose formula it reproduces (invact.norm: each keeps its output
and rstd, not its input); --no-norms leaves them, and their row is then what they hold both ways.

Attention: attn_implementation="sdpa" (transformers' eager attention where the model has no SDPA
path); scaled_dot_product_attention runs the kernel torch picks on CPU for the same shapes, dtype,
mask and dropout: "flash" saves q, k, v, the output and a logsumexp (as CUDA's flash kernel does),
"math" also the attention probabilities (batch x heads x seq x seq per layer; CPU picks it with
attention dropout > 0, where CUDA's flash kernel would not). The output says which ran.

Images: a config with a vision_config (Qwen2-VL, Qwen2.5-VL, Gemma 3, LLaVA, Idefics3, PaliGemma)
builds its *ForConditionalGeneration class, and each sample carries --images images (default 1
where invact plan builds the model's image inputs; --images 0 plans text only), square, at the
tower's image_size (Gemma 3's SigLIP: 896 x 896), or for a tower that takes any size (Qwen2-VL,
Qwen2.5-VL) --image-size pixels, default {_SIDE} x {_SIDE}: a (1, 32, 32) grid of 14-pixel patches, 256
tokens after the 2 x 2 merge. An image takes as many tokens of --seq as its features have rows;
each image's tokens, then one text token, start every sample, and the text tokens fill the rest.
Idefics3/SmolVLM: an image is one tile at the tower's image_size (their processors split a large
image into several: count tiles as images). The vision tower and the projector into the language
model are their own rows ("vision: ..."), beside the language model's; the kinds add up to the
total either way.

Encoder-decoders (T5, BART: their sequence-to-sequence LM, head and loss included): the encoder gets
input_ids (batch, seq) and the decoder labels (batch, seq), shifted right as the model does: both
run seq tokens, with all-ones attention masks. --no-labels gives the decoder decoder_input_ids =
input_ids.

The whole training step (--step, --explain, --fits): one step (forward with labels, the loss,
backward, AdamW's foreach step, the gradients set to None) after the first, so AdamW's state exists,
run on the meta device while every storage it allocates is followed to its release
(invact.planner.step): its peak of live bytes holds the weights, the gradients, the optimizer state,
the inputs, what the forward saves, the eager loss's logits and their fp32 copies, a layer's
backward buffers and AdamW's temporaries, each where the step holds them. Recipes: "bf16", the model
and AdamW's state in bf16; "lora", a frozen bf16 base with PEFT's LoRA adapters (bf16, --rank,
alpha 2 x rank, dropout 0) on every Linear but the head, AdamW on the adapters (needs peft);
"qlora", that base in bitsandbytes' 4-bit NormalFloat with double quantization (its packed weights
and constants as bitsandbytes stores them, each weight dequantized to bf16 while its matmul runs),
the rest in fp32 as PEFT's prepare_model_for_kbit_training leaves it, fp32 adapters, the forward
under autocast to bf16 (needs bitsandbytes and peft; one GPU: not with --gpus).
Checkpointing: Hugging Face's (activation_checkpointing_enable, torch's non-reentrant checkpoint
around each decoder layer). --fits searches the longest sequence in multiples of {SEQ_MULTIPLE} tokens
up to the config's max_position_embeddings (">=" where that fits) at --batch (default 1), or with
--seq instead the largest batch (give one of them: the other is what it searches); "none" where not
even the smallest fits. The output's second line says which it searched. Give --fits what PyTorch
may allocate: a GPU's memory less the CUDA context (about 0.5 GiB) and what else runs on it.
Checked against real CPU steps: benchmarks/step_plan.py.

Several GPUs (--gpus N --fsdp): the peak on each of N GPUs training with FSDP2 (fully_shard on each
decoder layer, then the root; parameters resharded after each layer's forward, the root's kept until
the end of backward): each parameter's shard (ceil(rows / N) of its rows), its gradient's and AdamW
state's, the parameters FSDP2 gathers (the root's, a layer's, the next layer's prefetched in backward)
and its all-gather and reduce-scatter buffers (--explain's "FSDP2" term), at --batch x --seq per GPU;
--fits answers the longest sequence per GPU. Checked against real FSDP2 steps over gloo on a CPU:
benchmarks/fsdp_plan.py. Other engines (DDP, DeepSpeed) and wrappings are not planned.

Tensor parallel (--tp N): the peak on each of N GPUs that share one batch under transformers' tensor
parallelism (from_pretrained with DistributedConfig(tp_plan="auto"): the model's tp_plan): each GPU
its shard of the projections the plan splits (heads, MLP features, the vocabulary of the embeddings and
the head) and of their gradients and AdamW state (AdamW's for-loop: its foreach refuses the mix of
DTensor and plain parameters), its heads' activations, the all-reduces' and the head's all-gather
buffers, the eager loss on the gathered logits and patch()'s over the vocabulary's shards. With
--gpus M --fsdp as well: FSDP2 over the M / N data parallel groups. Recipes bf16 and mixed. Checked
against real steps over gloo on a CPU: benchmarks/fsdp_plan.py --tp.

A --seq past the config's max_position_embeddings (or n_positions) is planned as given, with one
warning line on stderr: the model has no positions there.

Exit status: 0, or 2 with one line on stderr for bad input: no such file, invalid JSON, a config
without a model_type or that transformers cannot build, a model whose forward cannot run on the meta
device, a non-positive batch or seq, an unknown dtype, --fits that is not a positive size, --fits
with both --batch and --seq, --images for a model without a vision tower, images whose tokens do not
fit in seq, an image size the tower does not take, --gpus without --fsdp or --fsdp without --gpus,
--tp with a LoRA recipe, --gpus not a multiple of --tp, a model without a tp_plan or whose heads --tp
does not divide.
The file is checked first, and all but the last few before torch and transformers load."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line ("PROG: error: ...") and exits with status 2."""

    def error(self, message: str) -> None:
        _fail(self.prog, message)


def _fail(prog: str, message: str) -> None:
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(ERROR_STATUS)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def _size(text: str) -> int:
    """--fits: the bytes of a size such as 24GiB, 80GB, 24G (binary) or 25769803776
    (invact.planner.options.read_size, as the planner reads it)."""
    try:
        return read_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _version() -> str:
    """The --version line, "invact X.Y.Z (torch ..., transformers ...)", from the installed distributions'
    metadata: nothing imported."""
    from importlib import metadata

    from invact import __version__

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    others = ", ".join(f"{name} {installed(name) or 'not installed'}" for name in ("torch", "transformers"))
    return f"invact {installed('invact') or __version__} ({others})"


class _Version(argparse.Action):
    """--version: print _version() and exit (status 0)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="invact", description="invact: inverted activations for PyTorch training.",
                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--version", action=_Version,
                        help="print invact's version (and torch's and transformers') and exit")  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser,
                                     title="commands")  # fmt: skip
    plan = commands.add_parser(
        "plan",
        help=_SUMMARY,
        description=_PLAN_DESCRIPTION,
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _forward_arguments(plan)
    _step_arguments(plan)
    plan.add_argument("--json", action="store_true",
                      help="print one JSON object (eager_saved_bytes, patched_saved_bytes, kinds, "
                           "decisions, config, batch, seq, dtype, images, image_inputs, vision_eager_bytes, "
                           "vision_patched_bytes, encoder_decoder, ...) instead of the table")  # fmt: skip
    return parser


def _forward_arguments(plan: argparse.ArgumentParser) -> None:
    """`invact plan`'s config and what one forward is planned at (its shapes, dtype, patch()'s options)."""
    plan.add_argument("config", metavar="CONFIG.json",
                      help="a Hugging Face config JSON file (or a folder holding config.json); read "
                           "locally, nothing downloads")  # fmt: skip
    plan.add_argument(
        "--batch",
        type=_positive,
        metavar="B",
        help="batch size: input_ids are (B, S) (required; with --fits, give --batch or --seq, not both: "
        "the longest sequence is searched at --batch, default 1, or the largest batch at --seq)",
    )
    plan.add_argument(
        "--seq",
        type=_positive,
        metavar="S",
        help="sequence length, tokens: with images, their tokens and the text's together; an "
        "encoder-decoder's encoder and decoder each run S (required, but with --fits; past the "
        "config's max_position_embeddings: a warning)",
    )
    plan.add_argument("--dtype", default="bfloat16", metavar="DTYPE",
                      help=f"the model's dtype: {', '.join(DTYPE_NAMES)} (default: bfloat16)")  # fmt: skip
    plan.add_argument("--no-gated", dest="gated", action="store_false",
                      help="patch(gated=False): replace the activations only, keep gated MLPs' products "
                           "(default: the gated path, patch()'s default)")  # fmt: skip
    plan.add_argument("--no-norms", dest="norms", action="store_false",
                      help="patch(norms=False): leave RMSNorm and LayerNorm as they are (default: inverted, "
                           "patch()'s default)")  # fmt: skip
    plan.add_argument("--no-labels", dest="labels", action="store_false",
                      help="run the forward without labels, so no loss (default: labels = input_ids for a "
                           "model whose forward takes labels)")  # fmt: skip
    plan.add_argument("--no-loss", dest="loss", action="store_false",
                      help="patch(loss=False): keep the head and Hugging Face's loss as they are (default: "
                           "the loss from hidden states, patch()'s default)")  # fmt: skip
    plan.add_argument("--images", type=_non_negative, default=None, metavar="N",
                      help="images per sample, for a vision-language model (a config with a vision_config); "
                           "their tokens take part of --seq (default: 1 where invact plan builds the "
                           "model's image inputs, else 0; 0: text only)")  # fmt: skip
    plan.add_argument("--image-size", type=_positive, default=None, metavar="PX",
                      help="the side of the square images in pixels, for a tower that takes any size "
                           f"(Qwen2-VL, Qwen2.5-VL: a multiple of 28; default {_SIDE}, a 1 x 32 x 32 grid "
                           "of 14-pixel patches, 256 tokens); other towers take their config's "
                           "image_size")  # fmt: skip


def _step_arguments(plan: argparse.ArgumentParser) -> None:
    """`invact plan`'s options of the whole training step (--fits, --step, --explain, recipes, GPUs)."""
    step = plan.add_argument_group(
        "the whole training step (forward, loss, backward, AdamW), its peak of live bytes",
        "--step, --explain or --fits plan the step's peak instead of the saved bytes; see below.",
    )
    step.add_argument(
        "--fits",
        type=_size,
        metavar="SIZE",
        help="the memory the step must fit in (24GiB, 80GB, 24G = GiB, or bytes): print the longest "
        f"sequence (a multiple of {SEQ_MULTIPLE}) that fits at --batch (default 1), or with "
        "--seq instead the largest batch, eager and patch(), without and with checkpointing, "
        "per recipe",
    )
    step.add_argument(
        "--step",
        action="store_true",
        help="print the step's predicted peak at --batch and --seq, eager and patch(), without "
        "and with checkpointing, per recipe",
    )
    step.add_argument(
        "--explain",
        action="store_true",
        help="with each peak, its terms: weights, gradients, optimizer state, inputs, what the "
        "forward and the backward allocated that is live at the peak (implies --step "
        "without --fits)",
    )
    step.add_argument(
        "--recipe",
        nargs="+",
        choices=[*RECIPE_LABELS, "all"],
        metavar="R",
        help="the recipes: "
        + "; ".join(f"{name}: {label}" for name, label in RECIPE_LABELS.items())
        + f"; all: every one (default: {' '.join(DEFAULT_RECIPES)}; with --tp: bf16)",
    )
    step.add_argument(
        "--rank",
        type=_positive,
        default=DEFAULT_RANK,
        metavar="R",
        help=f"the LoRA rank (default {DEFAULT_RANK})",
    )
    step.add_argument(
        "--gpus",
        type=_positive,
        metavar="N",
        help="with --fsdp: plan each of N GPUs that train the model with FSDP2, per GPU: its shard of the "
        "weights, gradients and AdamW state, the parameters it gathers and its own --batch x --seq "
        "(--batch is per GPU; with --fits, the longest sequence per GPU)",
    )
    step.add_argument(
        "--fsdp",
        action="store_true",
        help="with --gpus: FSDP2 as torchtitan, accelerate and TRL wrap a model (fully_shard on each "
        "decoder layer, then the root; parameters resharded after each layer's forward)",
    )
    step.add_argument(
        "--tp",
        type=_positive,
        metavar="N",
        help="plan each of N GPUs that train the model with transformers' tensor parallelism (its "
        "tp_plan), all N on one batch of --batch x --seq (with --gpus M --fsdp: FSDP2 over M / N groups)",
    )
    step.add_argument(
        "--device",
        choices=list(DEVICES),
        default="cuda",
        help="the device the step is planned for: invact's loss computes blocks of its size (default cuda)",
    )


def _check_config(path: str) -> None:
    """The config file, checked before anything loads: it exists (in a folder: its config.json), reads as
    a JSON object and names a model_type; each failure one line, in invact.planner.config's words
    (read_config, build_config), which check the same again when the run reads it."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.exists():
        _fail(PROG, f"{file}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        _fail(PROG, f"{file}: cannot read it: {e}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        _fail(PROG, f"{file}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    if not isinstance(data, dict):
        _fail(PROG, f"{file}: a config is a JSON object, got {type(data).__name__}")
    if not isinstance(data.get("model_type"), str):
        _fail(PROG, f"{file}: the config has no model_type: transformers cannot tell which model it "
                    "describes")  # fmt: skip


def _check_arguments(args) -> None:
    """What the arguments ask, checked before anything loads (after the config file): each refusal one
    line, exit status 2."""
    if args.recipe is None:  # the default: bf16 alone under --tp, which plans no LoRA recipe
        args.recipe = ["bf16"] if args.tp is not None else list(DEFAULT_RECIPES)
    if args.tp is not None:
        lora = [r for r in args.recipe if r in ("lora", "qlora", "all")]
        if lora:
            _fail(PROG, f"--tp plans the full recipes (bf16, mixed): --recipe {lora[0]} under tensor "
                        "parallelism is not planned")  # fmt: skip
        if args.gpus is not None and args.gpus % args.tp:
            _fail(PROG, f"--gpus {args.gpus} does not split into tensor parallel groups of --tp {args.tp}")
    if args.fsdp and args.gpus is None:
        _fail(PROG, "--fsdp plans FSDP2 over several GPUs: give --gpus N")
    if args.gpus is not None and not args.fsdp:
        _fail(PROG, "--gpus N plans FSDP2's sharding: add --fsdp (other engines, DDP and DeepSpeed, are not "
                    "planned per GPU)")  # fmt: skip
    if args.gpus is not None and "qlora" in args.recipe:
        _fail(PROG, "--recipe qlora plans one GPU: FSDP2 over a 4-bit base (FSDP-QLoRA) is not planned")
    if not (args.fits is not None or args.step or args.explain or args.gpus or args.tp):
        for name in ("batch", "seq"):
            if getattr(args, name) is None:
                _fail(PROG, f"the following argument is required: --{name} (or --fits)")
        if args.dtype.lower().removeprefix("torch.") not in DTYPE_NAMES:
            _fail(PROG, f"unknown dtype {args.dtype!r} (choose from {', '.join(DTYPE_NAMES)})")
        return
    if args.dtype.lower().removeprefix("torch.") not in ("bfloat16", "bf16"):
        _fail(PROG, "--step, --explain, --fits, --gpus and --tp plan bf16 recipes: leave --dtype at bfloat16")
    if args.fits is None and (args.batch is None or args.seq is None):
        _fail(PROG, "--step, --explain, --gpus and --tp need --batch and --seq (or --fits)")
    if args.fits is not None and args.batch is not None and args.seq is not None:
        _fail(PROG, "--fits searches the longest sequence at --batch or the largest batch at --seq: give one "
                    "of them, not both (--step plans the peak at --batch and --seq)")  # fmt: skip
    if not (args.gated and args.norms and args.loss and args.labels):
        _fail(PROG, "--step, --explain and --fits plan patch() with its defaults and labels: "
                    "drop --no-gated, --no-norms, --no-loss and --no-labels")  # fmt: skip


def _load_runtime() -> None:
    """What the run needs, once the input is checked: invact's runtime (torch; deferred in the command's
    process, invact._load) and transformers (seconds)."""
    import invact

    try:
        with warnings.catch_warnings(record=True) as caught:  # the filters in force still apply
            invact._load()
        import transformers
    except ImportError as e:
        if getattr(e, "name", None) == "transformers":
            _fail(PROG, "transformers is not installed: pip install transformers")
        _fail(PROG, str(e))
    from invact._versions import VersionWarning

    for w in caught:  # a version outside the tested range: one line in the command's own words
        if issubclass(w.category, VersionWarning):
            print(f"{PROG}: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    transformers.utils.logging.set_verbosity_error()  # its advice on configs would interleave the table


def _warn_past_positions(path: str, seq: int | None) -> None:
    """One line on stderr where seq is past the positions the config's model has (its text model's
    max_position_embeddings or n_positions, as --fits' search stops there): planned as given."""
    from invact.planner.config import load_config, positions

    try:
        known = positions(load_config(path)[0])
    except PlanError as e:
        _fail(PROG, str(e))
    if known is not None and seq is not None and seq > known[1]:
        name, value = known
        print(f"{PROG}: warning: --seq {seq} is past the config's {name} ({value}): the model has no "
              "positions beyond it; planned as given", file=sys.stderr)  # fmt: skip


def _plan(args) -> int:
    _check_config(args.config)
    _check_arguments(args)
    _load_runtime()
    from invact.planner.forward import forward_saved

    _warn_past_positions(args.config, args.seq)
    if args.fits is not None or args.step or args.explain or args.gpus or args.tp:
        return _plan_step(args)
    try:
        result = forward_saved(args.config, args.batch, args.seq, args.dtype, gated=args.gated,
                             norms=args.norms, loss=args.loss, labels=args.labels, images=args.images,
                             image_size=args.image_size)  # fmt: skip
    except PlanError as e:
        _fail(PROG, str(e))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_forward(result))
    return 0


def _plan_step(args) -> int:
    from invact.planner.recipes import RECIPES
    from invact.planner.step import step_peaks

    recipes = tuple(RECIPES) if "all" in args.recipe else tuple(dict.fromkeys(args.recipe))
    try:
        result = step_peaks(args.config, args.batch, args.seq, recipes=recipes,
                           rank=args.rank, fits=args.fits, device=args.device, images=args.images,
                           image_size=args.image_size, ranks=args.gpus, tp=args.tp)  # fmt: skip
    except PlanError as e:
        _fail(PROG, str(e))
    print(json.dumps(result, indent=2) if args.json else format_step(result, explain=args.explain))
    return 0


def _negative_values_joined(argv: list[str]) -> list[str]:
    """argv with each option of _VALUED followed by a value that looks negative ("--fits", "-5GiB")
    joined into one ("--fits=-5GiB"), which argparse hands to the option's check."""
    joined, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return joined + argv[i:]
        if argv[i] in _VALUED and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return joined


def main(argv: list[str] | None = None) -> int:
    """The `invact` console command; returns the exit status (0, or 2 for bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser().parse_args(_negative_values_joined(argv))
        if args.command == "plan":
            return _plan(args)
    except SystemExit as e:  # argparse's --help and --version (0) and the one-line errors (2)
        return e.code if isinstance(e.code, int) else ERROR_STATUS
    return ERROR_STATUS  # pragma: no cover - argparse requires a known command


__all__ = ["main"]
