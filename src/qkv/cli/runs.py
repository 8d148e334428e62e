"""The subcommands that train and read a run: ``qkv train``, ``generate``, ``heads``, ``view``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from ..training import has_checkpoint, read_config, read_state


def checkpoint_or_pretrained(args: argparse.Namespace) -> Path:
    """``--checkpoint``, or where none is given the pretrained induction model's run (trained
    here the first time: :func:`qkv.learn.pretrained_run`)."""
    if args.checkpoint is None:
        from ..learn import pretrained_run

        args.checkpoint = pretrained_run("induction")
        print(
            f"no --checkpoint: qkv's pretrained induction model, {args.checkpoint}", file=sys.stderr
        )
    return Path(args.checkpoint)


def run_heads(args: argparse.Namespace) -> None:
    from ..heads import copying_scores, head_scores
    from ..training import load_checkpoint

    model = load_checkpoint(checkpoint_or_pretrained(args))
    if args.length is not None and 2 * args.length > model.config.block_size:
        raise ValueError(
            f"--length {args.length}: twice it must fit the context "
            f"(block_size={model.config.block_size})"
        )
    scores = head_scores(model, length=args.length, batch=args.batch, seed=args.seed)
    copying = copying_scores(model)
    ablation = _ablation(args, model) if args.ablate is not None else None
    if args.json:
        found = {name: s.tolist() for name, s in {**scores, "copying": copying}.items()}
        print(json.dumps(found if ablation is None else {**found, "ablation": ablation}))
    else:
        for name, s in {**scores, "copying": copying}.items():
            layer, head = divmod(int(s.argmax()), s.shape[1])
            print(f"{name:>16}: best layer {layer} head {head}: {s.max():.3f}")
        if ablation is not None:
            early, late = ablation["icl_positions"]
            print(
                f"held-out windows: {ablation['windows']}; ICL score = loss at position "
                f"{late} − at {early}, each averaged over ±{ablation['band']} positions"
            )
            for name, r in ablation["rows"].items():
                print(f"{name:>24}: loss {r['loss']:.4f}, ICL {r['icl']:+.4f}")
    if not args.no_png:
        from ..learn.viz import head_scores_heatmap

        try:
            head_scores_heatmap(scores, title=f"head scores: {args.checkpoint}", path=args.png)
            print(f"heatmap written to {args.png}", file=sys.stderr)
        except ImportError as err:
            print(f"no heatmap: {err}", file=sys.stderr)


def _ablation(args: argparse.Namespace, model: torch.nn.Module) -> dict:
    """The held-out loss and ICL score of the model, and with the heads of ``--ablate``
    removed (docs/induction.md)."""
    from ..heads import (
        ablate,
        icl_band,
        icl_positions,
        icl_score,
        parse_heads,
        per_token_loss,
    )
    from ..training import validation_windows

    chosen = parse_heads(args.ablate)
    x, y = validation_windows(args.checkpoint, args.windows)
    half = len(x) // 2  # mean ablation: the means of one half, measured on the other
    reference, x, y = (x[:half], x[half:], y[half:]) if args.ablation == "mean" else (None, x, y)
    before = per_token_loss(model, x, y)
    with ablate(model, chosen, mode=args.ablation, reference=reference):
        after = per_token_loss(model, x, y)
    rows = {"model": before, f"{args.ablation}-ablated {args.ablate}": after}
    return {
        "rows": {
            name: {"loss": losses.mean().item(), "icl": icl_score(losses)}
            for name, losses in rows.items()
        },
        "windows": len(x),
        "icl_positions": list(icl_positions(len(before))),
        "band": icl_band(len(before)),
    }


def run_view(args: argparse.Namespace) -> None:
    from ..heads import repeated_tokens
    from ..training import load_checkpoint, snapshots
    from ..view import byte_labels, view

    model = load_checkpoint(checkpoint_or_pretrained(args))
    on_bytes = read_config(args.checkpoint)["train"].get("data", "text") == "text"
    if args.prompt is not None and args.tokens is not None:
        raise ValueError("give --prompt or --tokens, not both")
    labels = None
    if args.prompt is not None:
        if not on_bytes:
            raise ValueError(
                f"this checkpoint was not trained on bytes (its vocabulary is "
                f"{model.config.vocab_size} tokens): give --tokens instead"
            )
        data = args.prompt.encode("utf-8")
        tokens, labels = list(data), byte_labels(data)
    elif args.tokens is not None:
        tokens = args.tokens
        if max(tokens) >= model.config.vocab_size or min(tokens) < 0:
            raise ValueError(
                f"--tokens: ids must be in 0 … {model.config.vocab_size - 1}; got {tokens}"
            )
    elif on_bytes:
        raise ValueError("give --prompt TEXT: the text to show")
    else:
        tokens = repeated_tokens(
            model.config.vocab_size, model.config.block_size // 2, batch=1, seed=1
        )[0].tolist()
    kept = [] if args.no_snapshots else snapshots(args.checkpoint)
    if kept:  # the snapshot of the last step is the final model itself: not loaded twice
        final = read_state(args.checkpoint)["step"]
        kept = [(step, path) for step, path in kept if step != final]
    frames = [(f"step {step}", load_checkpoint(args.checkpoint, step)) for step, _ in kept]
    page = view(
        model,
        tokens,
        labels=labels,
        snapshots=frames,
        query=args.query,
        title=f"qkv: {args.checkpoint}",
        ablated=args.ablate,
    )
    page.save(args.out)
    print(f"view written to {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")


def run_train(args: argparse.Namespace) -> int:
    from ..training import DEFAULT_PRESET, PRESETS, train

    preset = args.preset
    if preset is None:
        preset = saved_preset(args.out) if args.resume else DEFAULT_PRESET
    train_config = None
    if args.dtype is not None:  # the preset's recipe with the matmuls' dtype asked for
        autocast = {"float32": None, "bfloat16": "bfloat16", "auto": "auto"}[args.dtype]
        train_config = dataclasses.replace(PRESETS[preset][1], autocast=autocast)
    result = train(
        args.out,
        preset=preset,
        train_config=train_config,
        text=args.text,
        steps=args.steps,
        seed=args.seed,
        resume=args.resume,
        compile=args.compile,
        progress=not args.quiet,
        save_every=args.save_every,
    )
    if result.interrupted:
        return 130  # the shell's code for a run stopped by Ctrl-C
    val = result.val_loss
    print(
        f"trained to step {result.step}: validation loss "
        f"{'n/a' if val is None else f'{val:.4f} nats/{result.unit}'}; checkpoint in "
        f"{result.out}"
    )
    return 0


def saved_preset(out: Path) -> str:
    if not has_checkpoint(out):
        raise FileNotFoundError(f"--out {str(out)!r} holds no checkpoint to resume")
    return str(read_config(out).get("preset"))


def run_generate(args: argparse.Namespace) -> None:
    from ..training import load_checkpoint

    texts = list(args.prompt or [])
    if args.prompts_file is not None:
        texts += args.prompts_file.read_text(encoding="utf-8").splitlines()
    texts = texts or ["def "]
    if not all(texts):
        raise ValueError(
            "--prompt must not be empty (nor a line of --prompts-file): the model continues a text"
        )
    model = load_checkpoint(args.checkpoint)
    data = read_config(args.checkpoint)["train"].get("data", "text")
    if data != "text":
        raise ValueError(
            f"this checkpoint was trained on {data!r}, not bytes: qkv generate reads and "
            "writes bytes (qkv heads and qkv view read such runs)"
        )
    prompts = [list(text.encode("utf-8")) for text in texts]
    vocab = model.config.vocab_size
    outside = sorted({b for prompt in prompts for b in prompt if b >= vocab})
    if outside:
        raise ValueError(
            f"--prompt has bytes outside this model's vocabulary of {vocab} tokens "
            f"({', '.join(map(str, outside[:5]))}{', …' if len(outside) > 5 else ''}): it was "
            "trained on other tokens (the induction preset's are 0..63), not on text"
        )
    sampling = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=torch.Generator().manual_seed(args.seed),
        kv_dtype={None: None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[args.kv_dtype],
    )
    if args.kv_dtype and args.no_cache:
        raise ValueError("--kv-dtype quantizes the KV caches; --no-cache uses none")
    if len(prompts) == 1:
        idx = torch.tensor(prompts)  # (1, T) bytes
        out = model.generate(idx, args.tokens, use_cache=not args.no_cache, **sampling)
        print(bytes(out[0].tolist()).decode("utf-8", errors="replace"))
        return
    # Prompts of different lengths, decoded together on a paged cache (docs/ragged.md).
    outs = model.generate([torch.tensor(p) for p in prompts], args.tokens, **sampling)
    for i, out in enumerate(outs):
        print(f"--- {i}: {texts[i]!r}")
        print(bytes(out.tolist()).decode("utf-8", errors="replace"))
