"""The ``qkv`` command (also ``python -m qkv``).

``qkv explain`` (the project's main job) traces attention over the seeds' sentence "Your
journey starts with one step" step by step and writes a heatmap of the weights.
``qkv mask causal --size 8`` prints a mask's picture. ``qkv train`` trains a GPT on bytes
(the standard library's sources by default) and ``qkv generate`` samples from it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from .. import masks
from ..learn.trained import RECIPES
from .args import Parser, positive
from .doctor import run_doctor
from .explain import run_explain
from .runs import run_generate, run_heads, run_train, run_view


def _embeddings(text: str) -> list[list[float]]:
    try:
        return [[float(v) for v in row.split(",")] for row in text.split(";") if row.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"embeddings must be rows of comma-separated numbers split by ';', "
            f"e.g. '0.1,0.2;0.3,0.4'; got {text!r}"
        ) from None


def _ids(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"ids must be comma-separated integers; got {text!r}"
        ) from None


#: --checkpoint of qkv heads and qkv view
PRETRAINED_HELP = (
    "a directory written by qkv train (default: qkv's pretrained induction model, trained "
    "here once, about 40 s, and kept: qkv.learn.pretrained)"
)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="qkv", description="qkv: attention, step by step.")
    parser.add_argument(  # pyproject.toml's version, as the installed package has it
        "--version", action="version", version=f"qkv {metadata.version('qkv')}"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    doc = sub.add_parser(
        "doctor",
        help="what this machine runs: CPU, threads, native kernels, the kernel choice",
        description="Print the CPU and its instruction sets, the native kernels, the "
        "machine profile behind the kernel choice (measured once, stored) and which code "
        "each dtype and mask kind takes.",
    )
    doc.add_argument(
        "--remeasure",
        action="store_true",
        help="measure the profile again (a stored choice changes only past a margin)",
    )

    ex = sub.add_parser(
        "explain",
        help="trace one attention computation step by step",
        description="Trace attention over a sentence step by step and draw "
        "its weights. With no options: the seeds' six tokens and 3-d "
        "embeddings through SelfAttention(3, 2) seeded with 789.",
    )
    ex.add_argument("--causal", action="store_true", help="mask out the future")
    ex.add_argument(
        "--heads",
        type=positive,
        help="number of heads (default 1; >1 uses MultiHeadAttention; --d-out a multiple)",
    )
    ex.add_argument("--d-out", type=positive, help="width of Q, K, V (default 2, or 2 per head)")
    ex.add_argument("--seed", type=int, help="torch seed for the weights (789)")
    ex.add_argument(
        "--simplified",
        action="store_true",
        help="no trainable weights: Q = K = V = the embeddings, no scaling",
    )
    ex.add_argument("--tokens", help="token labels, space-separated")
    ex.add_argument(
        "--embeddings", type=_embeddings, help="one row per token: '0.1,0.2,0.3;0.4,0.5,0.6'"
    )
    ex.add_argument(
        "--input", type=Path, help='a JSON file {"tokens": [...], "embeddings": [[...], ...]}'
    )
    ex.add_argument("--json", action="store_true", help="print the trace as JSON")
    ex.add_argument(
        "--png",
        type=Path,
        default=Path("attention.png"),
        help="where to write the heatmap (default attention.png)",
    )
    ex.add_argument(
        "--checkpoint",
        type=Path,
        help="a trained run (qkv train --out): explain one of its attention layers on --prompt",
    )
    ex.add_argument(
        "--pretrained",
        choices=sorted(RECIPES),
        help="explain a layer of qkv's pretrained model instead (trained here once, about 40 s, "
        "and kept): over a random token segment repeated",
    )
    ex.add_argument(
        "--layer",
        type=int,
        help="with --checkpoint or --pretrained: the layer (default 0 for a run on text, else "
        "the layer of the strongest induction head)",
    )
    ex.add_argument(
        "--prompt",
        help="with --checkpoint: the text whose bytes the layer attends over "
        "(default 'the cat sat. the cat sat.')",
    )
    ex.add_argument(
        "--variant",
        choices=["gqa", "mqa", "mla", "window", "sinks", "sparse"],
        help="the attention of 2026's models on the same sentence: grouped-query, "
        "multi-query, multi-head latent, a sliding window, sinks, token-sparse "
        "(docs/variants.md)",
    )
    ex.add_argument("--no-png", action="store_true", help="do not draw the heatmap")
    ex.add_argument("--precision", type=int, default=4, help="decimals in the tables (4)")

    sub.add_parser(
        "bench", help="benchmark qkv against torch SDPA (qkv bench --help)", add_help=False
    )

    mk = sub.add_parser(
        "mask",
        help="print a mask's picture",
        description="Print a mask as a picture: █ may attend, · masked.",
    )
    mk.add_argument(
        "kind", choices=["full", "causal", "sliding_window", "prefix_lm", "document", "padding"]
    )
    mk.add_argument(
        "--size",
        type=positive,
        help=f"number of queries T_q (default 8, or the number of --ids; at most {MAX_PICTURE})",
    )
    mk.add_argument("--keys", type=positive, help="number of keys T_k (default: --size)")
    mk.add_argument("--window", type=positive, help="for sliding_window (default 3)")
    mk.add_argument("--prefix", type=int, help="for prefix_lm (default 2)")
    mk.add_argument("--ids", type=_ids, help="for document: one id per key, '0,0,1,1'")
    mk.add_argument("--length", type=int, help="for padding: number of valid keys (required)")
    tr = sub.add_parser(
        "train",
        help="train a GPT on bytes (qkv train --help)",
        description="Train a qkv GPT on the bytes of the Python standard "
        "library's sources (or --text) and keep a checkpoint in --out.",
    )
    tr.add_argument(
        "--preset",
        default=None,
        help="model and recipe: tiny (seconds), cpu-10min (the default: about ten minutes "
        "on a 2-core CPU, docs/training.md) or induction (docs/induction.md); on "
        "--resume, the checkpoint's",
    )
    tr.add_argument("--text", type=Path, help="a UTF-8 file or folder to train on instead")
    tr.add_argument(
        "--out", type=Path, default=Path("runs/gpt"), help="checkpoint directory (default runs/gpt)"
    )
    tr.add_argument(
        "--steps",
        type=positive,
        help="the run's total steps (default: the preset's; with --resume the run's own, "
        "and N extends it)",
    )
    tr.add_argument(
        "--save-every",
        type=positive,
        metavar="N",
        help="write a checkpoint every N steps (default: at each evaluation), and at the end; "
        "Ctrl-C and SIGTERM also save, then stop",
    )
    tr.add_argument("--seed", type=int, default=0, help="seed of weights, batches, dropout (0)")
    tr.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    tr.add_argument("--compile", action="store_true", help="run the model under torch.compile")
    tr.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "auto"],
        help="the matmuls' dtype (default: the preset's): auto measures both on this CPU "
        "and takes the faster",
    )
    tr.add_argument("--quiet", action="store_true", help="no progress output")

    ge = sub.add_parser(
        "generate",
        help="sample text from a trained GPT",
        description="Continue a prompt with a GPT checkpoint written by "
        "qkv train. The same --seed gives the same text.",
    )
    ge.add_argument(
        "--checkpoint", type=Path, required=True, help="a directory written by qkv train"
    )
    ge.add_argument(
        "--prompt",
        action="append",
        help="text to continue (default 'def '); give it several times, or --prompts-file, "
        "to decode prompts of different lengths together",
    )
    ge.add_argument("--prompts-file", type=Path, help="a UTF-8 file of prompts, one per line")
    ge.add_argument("--tokens", type=positive, default=200, help="bytes to generate (default 200)")
    ge.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    ge.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="divides the logits; 0 is greedy (default 0.8)",
    )
    ge.add_argument("--top-k", type=positive, help="sample among the k likeliest bytes")
    ge.add_argument("--top-p", type=float, help="sample from the smallest set reaching p")
    ge.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute the context every step instead of using KV caches",
    )
    ge.add_argument(
        "--kv-dtype",
        choices=["int8", "fp8"],
        help="quantize the KV caches: int8, or fp8 (float8 e4m3); a float32 scale per token "
        "and head (default: the model's dtype)",
    )
    hd = sub.add_parser(
        "heads",
        help="score every head of a trained GPT",
        description="Score every layer and head of a checkpoint on a random "
        "sequence repeated twice: previous-token, duplicate-token, induction "
        "and first-token scores (mean attention weights, 0 to 1).",
    )
    hd.add_argument("--checkpoint", type=Path, help=PRETRAINED_HELP)
    hd.add_argument(
        "--length", type=positive, help="length of the repeated segment (default: half the context)"
    )
    hd.add_argument("--batch", type=positive, default=16, help="sequences averaged (16)")
    hd.add_argument("--seed", type=int, default=0, help="draws the sequences (0)")
    hd.add_argument("--json", action="store_true", help="print the scores as JSON")
    hd.add_argument(
        "--png",
        type=Path,
        default=Path("heads.png"),
        help="where to write the layers × heads heatmap (default heads.png)",
    )
    hd.add_argument("--no-png", action="store_true", help="do not draw the heatmap")
    hd.add_argument(
        "--ablate",
        metavar="L.H[,L.H...]",
        help="also report the held-out loss and ICL score with these heads removed "
        "(e.g. 1.0,1.3) beside the model's own",
    )
    hd.add_argument(
        "--ablation",
        choices=("zero", "mean"),
        default="zero",
        help="what replaces an ablated head's output: zeros, or its mean over held-out "
        "windows (default zero)",
    )
    hd.add_argument(
        "--windows",
        type=positive,
        help="held-out windows for --ablate (default: the run's eval_windows)",
    )

    vw = sub.add_parser(
        "view",
        help="write an interactive HTML view of a GPT's heads",
        description="Write one self-contained HTML file (works offline) "
        "showing what every head of a checkpoint attends to over a prompt, "
        "with a slider over the run's snapshots when it kept them.",
    )
    vw.add_argument("--checkpoint", type=Path, help=PRETRAINED_HELP)
    vw.add_argument("--prompt", help="text to show (models trained on bytes)")
    vw.add_argument(
        "--tokens",
        type=_ids,
        help="token ids to show instead, '3,14,15' (default for a model trained "
        "on repeated segments: a random segment of half the context, twice)",
    )
    vw.add_argument("--query", type=int, help="position shown step by step (default: last)")
    vw.add_argument(
        "--out",
        type=Path,
        default=Path("heads.html"),
        help="the HTML file to write (default heads.html)",
    )
    vw.add_argument(
        "--no-snapshots",
        action="store_true",
        help="show the final weights only, not the run's snapshots",
    )
    vw.add_argument(
        "--ablate",
        metavar="L.H[,L.H...]",
        help="show the model with these heads removed (zero ablation; marked on the page)",
    )
    return parser


#: the largest mask ``qkv mask`` draws (a picture of T_q × T_k characters)
MAX_PICTURE = 1024

#: the option of each mask kind, refused for the others
_MASK_OPTION = {
    "sliding_window": "window",
    "prefix_lm": "prefix",
    "document": "ids",
    "padding": "length",
}


def _mask(args: argparse.Namespace) -> None:
    for kind, option in _MASK_OPTION.items():
        if getattr(args, option) is not None and args.kind != kind:
            raise ValueError(f"--{option} is for {kind} masks only; {args.kind} takes none")
    if args.kind == "padding" and args.length is None:
        raise ValueError("padding needs --length: the number of valid keys")
    T_q = args.size or (len(args.ids) if args.ids else 8)
    T_k = args.keys or (len(args.ids) if args.ids else T_q)
    for name, n in (("--size", T_q), ("--keys", T_k)):
        if n > MAX_PICTURE:
            raise ValueError(f"{name} {n} is too large for a picture (at most {MAX_PICTURE})")
    args.window = 3 if args.window is None else args.window
    args.prefix = 2 if args.prefix is None else args.prefix
    make = {
        "full": lambda: masks.full(),
        "causal": lambda: masks.causal(),
        "sliding_window": lambda: masks.sliding_window(args.window),
        "prefix_lm": lambda: masks.prefix_lm(args.prefix),
        "document": lambda: masks.document(
            args.ids if args.ids else [2 * j // T_k for j in range(T_k)]
        ),
        "padding": lambda: masks.padding([args.length]),
    }
    mask = make[args.kind]()
    print(f"{mask!r}   T_q={T_q}, T_k={T_k}   (█ may attend · masked)")
    print(mask.picture(T_q, T_k))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI. Returns the exit status (0 ok, 2 bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a bare `qkv`: what it can do, not an error
        _parser().print_help()
        return 0
    if argv[:1] == ["bench"]:  # its own options: see qkv.cli.bench
        from .bench import main as bench

        try:
            bench(argv[1:])
        except (ValueError, OSError) as err:
            sys.exit(f"qkv bench: error: {err}")
        return 0
    parser = _parser()
    args = parser.parse_args(argv)
    commands = {
        "explain": run_explain,
        "mask": _mask,
        "train": run_train,
        "generate": run_generate,
        "heads": run_heads,
        "view": run_view,
        "doctor": run_doctor,
    }
    try:
        return commands[args.command](args) or 0
    except (ValueError, TypeError, OSError) as err:
        parser.exit(2, f"qkv {args.command}: error: {err}\n")
    except KeyboardInterrupt:  # a second Ctrl-C: out at once (checkpoints are written whole)
        parser.exit(130, f"qkv {args.command}: interrupted; the last checkpoint is whole\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
