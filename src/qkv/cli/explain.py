"""``qkv explain``: one attention computation traced step by step, printed, and its weights
drawn. It traces the teaching sentence through a module with random weights, your own
tokens and embeddings, or one layer of a trained run (``--checkpoint``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from .. import masks
from ..learn import tutorial
from ..learn.explain import explain
from ..nn.mha import MultiHeadAttention
from ..nn.mla import MultiHeadLatentAttention
from ..nn.modules import SelfAttention


def _sequence(args: argparse.Namespace) -> tuple[list[str], torch.Tensor]:
    tokens: list[str] | None = args.tokens.split() if args.tokens else None
    rows = args.embeddings
    if args.input is not None:
        try:
            data = json.loads(args.input.read_text())
            rows, tokens = data["embeddings"], tokens or data.get("tokens")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"--input {args.input}: cannot read tokens and embeddings ({err})"
            ) from None
    if rows is None:
        rows = tutorial.EMBEDDINGS
        tokens = tokens or list(tutorial.SENTENCE)
    where = f"--input {args.input}" if args.input is not None else "--embeddings"
    if (
        not isinstance(rows, (list, tuple))
        or not rows
        or not all(isinstance(r, (list, tuple)) for r in rows)
    ):
        raise ValueError(f"{where}: embeddings must be a non-empty table, one row per token")
    widths = [len(r) for r in rows]
    if len(set(widths)) != 1 or widths[0] == 0:
        bad = next((i for i, w in enumerate(widths) if w != widths[0]), 0)
        raise ValueError(
            f"{where}: embeddings must be rows of one width; row 0 has "
            f"{widths[0]} numbers, row {bad} has {widths[bad]}"
        )
    try:
        x = torch.tensor(rows, dtype=torch.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: embeddings must hold numbers only") from None
    not_finite = (~torch.isfinite(x)).nonzero()
    if len(not_finite):
        row, col = not_finite[0].tolist()
        raise ValueError(
            f"{where}: embeddings must be finite; row {row} holds {x[row, col].item()} "
            f"at column {col}"
        )
    tokens = tokens or [str(i) for i in range(x.shape[0])]
    if len(tokens) != x.shape[0]:
        raise ValueError(
            f"{len(tokens)} tokens but {x.shape[0]} embedding rows: give one "
            "row per token (--embeddings or --input)"
        )
    return tokens, x


def run_explain(args: argparse.Namespace) -> None:
    if not args.no_png and not args.png.parent.is_dir():
        raise ValueError(f"--png {args.png}: the folder {args.png.parent} does not exist")
    if args.checkpoint is not None or args.pretrained is not None:
        return _show(_trained_trace(args), args)
    if args.layer is not None or args.prompt is not None:
        raise ValueError(
            "--layer and --prompt explain a trained run: give --checkpoint DIR or "
            "--pretrained induction"
        )
    if args.variant is not None:
        return _show(_variant_trace(args), args)
    if args.simplified:
        unused = [
            f
            for f, v in (("--heads", args.heads), ("--d-out", args.d_out), ("--seed", args.seed))
            if v is not None
        ]
        if unused:
            raise ValueError(
                f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with "
                "--simplified, which has no trainable weights: drop one or the other"
            )
    args.heads = 1 if args.heads is None else args.heads
    # The seeds' width of 2, and 2 dims for every head where there are several.
    args.d_out = 2 * args.heads if args.d_out is None else args.d_out
    if args.d_out % args.heads:
        raise ValueError(
            f"--d-out {args.d_out} must be a multiple of --heads {args.heads} (each head "
            f"takes d_out / heads dims): try --d-out {2 * args.heads}"
        )
    args.seed = 789 if args.seed is None else args.seed
    tokens, x = _sequence(args)
    torch.manual_seed(args.seed)
    E = x.shape[1]
    module: SelfAttention | MultiHeadAttention | None
    if args.simplified:
        module, mask = None, masks.causal() if args.causal else None
        title = "simplified attention" + (", causal" if args.causal else "")
    else:
        mask = None
        if args.heads == 1:
            module = SelfAttention(E, args.d_out, causal=args.causal)
        else:
            module = MultiHeadAttention(E, args.d_out, args.heads, causal=args.causal)
        title = (
            f"{type(module).__name__}(d_in={E}, d_out={args.d_out}"
            + (f", heads={args.heads}" if args.heads > 1 else "")
            + (", causal" if args.causal else "")
            + f"), seed {args.seed}: random weights, untrained"
        )
    _show(explain(x, tokens=tokens, module=module, mask=mask, title=title), args)


#: What each --variant is, for the title.
VARIANTS = {
    "gqa": "grouped-query attention: 4 query heads share 2 key/value heads",
    "mqa": "multi-query attention: 4 query heads share 1 key/value head",
    "mla": "multi-head latent attention, absorbed: 2 heads over one latent row per token",
    "window": "a sliding window: each token sees itself and the 1 token before it",
    "sinks": "attention sinks: each head's softmax holds a key with no value (logit 1)",
    "sparse": "token-sparse attention: each token attends to the 2 earlier keys an indexer picks",
}


def _variant_trace(args: argparse.Namespace) -> Any:
    """One of 2026's kinds of attention (``--variant``) on the sentence, causal, random
    weights: the module and mask it takes, traced step by step."""
    if args.simplified or args.heads is not None or args.d_out is not None:
        raise ValueError(
            "--variant builds its own module: --simplified, --heads and --d-out do not apply"
        )
    args.seed = 789 if args.seed is None else args.seed
    tokens, x = _sequence(args)
    torch.manual_seed(args.seed)
    E, name = x.shape[1], args.variant
    module: Any
    mask: Any = None
    if name in ("gqa", "mqa"):
        module = MultiHeadAttention(E, 8, 4, num_kv_heads=2 if name == "gqa" else 1, causal=True)
    elif name == "mla":
        module = MultiHeadLatentAttention(
            E, 2, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2
        )
    else:
        module = MultiHeadAttention(E, 4, 2, causal=True, sinks=name == "sinks")
        if name == "sinks":
            with torch.no_grad():
                assert module.sinks is not None
                module.sinks.fill_(1.0)  # (a learned sink starts at 0; 1 shows its share)
        elif name == "window":
            mask = masks.sliding_window(2)
        else:  # the indexer: the 2 earlier keys (itself included) with the largest x · x
            T = x.shape[0]
            picks = (x @ x.T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -1e9)
            top = picks.topk(min(2, T), dim=-1).indices
            top = top.masked_fill(top > torch.arange(T)[:, None], -1)  # rows with fewer keys
            mask = masks.key_indices(top[None])
    title = f"--variant {name}: {VARIANTS[name]}; seed {args.seed}: random weights, untrained"
    return explain(x, tokens=tokens, module=module, mask=mask, title=title)


#: The segment --pretrained and a run on tokens are explained over: 8 tokens, then again.
SEGMENT = 8


def _trained_trace(args: argparse.Namespace) -> Any:
    """One attention layer of a trained run (``--checkpoint``, or ``--pretrained``) traced over
    --prompt's bytes, or for a run on token ids over a random segment repeated: the layer's
    input is what the model computes there (captured as the layer's norm returns it)."""
    from ..heads import head_scores, repeated_tokens
    from ..learn import pretrained_run
    from ..training import load_checkpoint, read_config, read_state

    if args.checkpoint is not None and args.pretrained is not None:
        raise ValueError("give --checkpoint DIR or --pretrained NAME, not both")
    options = ("heads", "d_out", "seed", "tokens", "embeddings", "input")
    given = [f for f in options if getattr(args, f) is not None]
    if given or args.simplified or args.causal:
        raise ValueError(
            "--checkpoint and --pretrained explain the run's own layer: --heads, --d-out, "
            "--seed, --tokens, --embeddings, --input, --simplified and --causal do not apply"
        )
    run = args.checkpoint if args.checkpoint is not None else pretrained_run(args.pretrained)
    model = load_checkpoint(run).eval()
    on_text = read_config(run)["train"].get("data", "text") == "text"
    if on_text:
        prompt = "the cat sat. the cat sat." if args.prompt is None else args.prompt
        ids = list(prompt.encode("utf-8"))[: model.config.block_size]
        if not ids or max(ids) >= model.config.vocab_size:
            raise ValueError("--prompt must be non-empty text within the model's vocabulary")
        # each byte as a label: a space as ␣, a newline as \n, a byte past ASCII as \xNN
        tokens = ["␣" if b == 32 else repr(chr(b))[1:-1] if b < 128 else f"\\x{b:02x}" for b in ids]
    else:
        if args.prompt is not None:
            raise ValueError(
                f"--prompt: this run was trained on token ids 0 … {model.config.vocab_size - 1}, "
                f"not text; it is explained over a random segment of {SEGMENT} tokens repeated"
            )
        ids = repeated_tokens(model.config.vocab_size, SEGMENT, batch=1, seed=1)[0].tolist()
        tokens = [str(i) for i in ids]
    layer = args.layer
    if layer is None and on_text:
        layer = 0
    elif layer is None:  # a run on tokens: the layer of its strongest induction head
        induction = head_scores(model)["induction"]
        layer = int(induction.argmax()) // induction.shape[1]
    n = len(model.blocks)
    if not 0 <= layer < n:
        raise ValueError(f"--layer must be 0 .. {n - 1}; got {layer}")
    block, seen = model.blocks[layer], []
    hook = block.ln_1.register_forward_hook(lambda module, inputs, out: seen.append(out))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        hook.remove()
    step = read_state(run).get("step")
    name = f"the pretrained {args.pretrained} model" if args.checkpoint is None else str(run)
    title = f"{name}, layer {layer}, trained {step} steps"
    return explain(seen[0][0].detach(), tokens=tokens, module=block.attn, title=title)


def _show(trace: Any, args: argparse.Namespace) -> None:
    print(json.dumps(trace.to_dict()) if args.json else trace.to_text(args.precision), end="")
    if not args.no_png:
        try:
            trace.heatmap(args.png)
            print(f"heatmap written to {args.png}", file=sys.stderr)
        except ImportError as err:
            print(f"no heatmap: {err}", file=sys.stderr)
