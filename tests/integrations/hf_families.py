"""Every family of transformers' auto mappings, run on qkv against eager.

Each family is built from a tiny random config (nothing downloaded), run on a left-padded
batch with ``attn_implementation="qkv"`` and with ``"eager"`` (same weights, float32), and
generated greedily with the cache; the family is then one of

- ``equal``: qkv's attention ran, logits agree (≤ ``RTOL`` of the largest logit, unpadded
  positions) and greedy tokens are the same;
- ``refused``: qkv said why it cannot run the family (:class:`Unsupported`);
- ``ignores qkv``: the model ran and agreed with eager, but computes attention in its own
  code and builds no mask through transformers, so qkv never ran and could not refuse it
  (``huggingface.check(model)`` does);
- ``no attention``: the model ran and agreed, with no attention to run (state-space and
  recurrent models);
- ``eager fails``: the family does not run even on eager with a tiny config (transformers'
  own failure, or a config this generic shrinking cannot make small);
- ``crash``: eager runs, qkv raises something other than a refusal;
- ``insensitive``: equal, but a 1% error in the attention would not have shown either;
- ``different``: the answer differs without an error — silently wrong. The test fails on any.

Run as a script it writes the table of docs/huggingface.md::

    python -m tests.integrations.hf_families --write docs/huggingface.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

RTOL = 1e-4
WEIGHT_SCALE = 4.0
T, PAD, NEW = 11, 3, 5  # tokens per row, left padding of row 1, tokens generated
STATUSES = (
    "equal",
    "refused",
    "ignores qkv",
    "no attention",
    "eager fails",
    "crash",
    "insensitive",
    "different",
)

# Sizes a tiny config takes, for whichever of these attributes the family's config has.
SMALL: dict[str, Any] = {
    "vocab_size": 99,
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "embed_dim": 32,
    "intermediate_size": 48,
    "ffn_dim": 48,
    "d_ff": 48,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "n_inner": 48,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "d_kv": 8,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "rotary_dim": 4,
    "v_head_dim": 8,
    "sliding_window": 4,
    "index_topk": 4,  # sparse attention (DSA): fewer keys than the tokens, so it bites
    "attention_chunk_size": 4,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "tie_word_embeddings": False,
}


#: What a few families need beyond SMALL to be small and valid (hybrid layer patterns).
OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2},
    "bamba": {"attn_layer_indices": [1]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "zamba2": {"hybrid_layer_ids": [1]},
    "dots1": {"max_window_layers": 2},
}


@dataclass
class Outcome:
    family: str
    model_class: str
    status: str
    detail: str = ""
    seconds: float = 0.0
    #: the family computes attention in its own code (``huggingface.family``)
    own_attention: bool = False


class Calls:
    """Counts the calls of qkv's attention function."""

    def __init__(self) -> None:
        self.count = 0


@contextlib.contextmanager
def counting(perturb: bool = False) -> Iterator[Calls]:
    """qkv registered with transformers, its attention function counted while inside;
    with ``perturb``, its output nudged (to check that a comparison can see attention: 1%
    of each position's output mixed in from the one before, not a uniform scale, which a
    norm after the attention would undo)."""
    from transformers import AttentionInterface

    from qkv.integrations import huggingface

    huggingface.register()
    calls = Calls()

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.count += 1
        out, weights = huggingface.qkv_attention_forward(*args, **kwargs)
        # 1% of each position's output from its neighbour: what an off-by-one mask does
        return (out + 0.01 * out.roll(1, dims=1) if perturb else out), weights

    AttentionInterface.register(huggingface.NAME, counted)
    try:
        yield calls
    finally:
        huggingface.register()


def tiny_config(family: str) -> Any:
    """A small config of the family: every size attribute it has, from SMALL."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    return shrink(config_class, OVERRIDES.get(family, {}))


def shrink(config_class: Any, given: dict[str, Any]) -> Any:
    defaults = config_class()
    names = set(defaults.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    kwargs = {k: v for k, v in SMALL.items() if k in names}
    if "kv_lora_rank" in names and "num_key_value_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # latent attention
    for key in getattr(config_class, "sub_configs", {}) or {}:
        sub = getattr(defaults, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[key] = shrink(type(sub), {}).to_dict()
    if "layer_types" in names and getattr(defaults, "layer_types", None):
        kinds = list(dict.fromkeys(defaults.layer_types))[:2]  # one of each kind, up to two
        kwargs["layer_types"] = (kinds * 2)[:2]
    kwargs.update(given)
    return config_class(**kwargs)


def families(mapping: str = "causal") -> dict[str, str]:
    """family → model class name, from transformers' auto mapping."""
    from transformers.models.auto import modeling_auto as ma

    return dict(
        {
            "causal": ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            "masked": ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            "seq2seq": ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        }[mapping]
    )


def inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, min(vocab, 99), (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, mask


def run_family(family: str, model_class_name: str, mapping: str = "causal") -> Outcome:
    import transformers

    from qkv.integrations import huggingface
    from qkv.integrations.huggingface import Unsupported

    start = time.perf_counter()

    own = False

    def outcome(status: str, detail: str = "") -> Outcome:
        seconds = time.perf_counter() - start
        return Outcome(family, model_class_name, status, detail, seconds, own)

    try:
        model_class = getattr(transformers, model_class_name)
        config = tiny_config(family)
        own = huggingface.family(config).own_attention
        torch.manual_seed(0)
        eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager")
        eager = eager.float().eval()
        with torch.no_grad():  # weights ×4 (std ~0.08): sharper attention, which then matters
            for param in eager.parameters():
                if param.ndim >= 2:
                    param.mul_(WEIGHT_SCALE)
        ids, mask = inputs(getattr(eager.config.get_text_config(), "vocab_size", 99) or 99)
        extra = seq2seq_inputs(eager) if mapping == "seq2seq" else {}
        with torch.no_grad():
            want = logits(eager(input_ids=ids, attention_mask=mask, **extra))
        want_tokens = generate(eager, ids, mask, mapping)
    except Exception as err:  # the family's own failure, recorded
        return outcome("eager fails", one_line(err))
    try:
        with counting() as calls:
            ours = model_class._from_config(copy.deepcopy(config), attn_implementation="qkv")
            ours = ours.float().eval()
            ours.load_state_dict(eager.state_dict())
            with torch.no_grad():
                got = logits(ours(input_ids=ids, attention_mask=mask, **extra))
            got_tokens = generate(ours, ids, mask, mapping)
    except Unsupported as err:
        return outcome("refused", one_line(err))
    except Exception as err:  # reported as a crash, not hidden
        return outcome("crash", one_line(err))
    keep = torch.broadcast_to(mask.bool()[:, :, None], got.shape) if not extra else None
    diff = (got - want).abs()
    scale = float(want.abs().max().clamp_min(1e-6))
    error = float((diff[keep] if keep is not None else diff).max()) / scale
    same = error <= RTOL and torch.equal(got_tokens, want_tokens)
    detail = f"relative error {error:.1e}" + (
        "" if torch.equal(got_tokens, want_tokens) else "; tokens differ"
    )
    if calls.count == 0:  # never called: the family has no attention, or computes its own
        kind = "ignores qkv" if own else "no attention"
        return outcome(kind if same else "different", detail + "; qkv never called")
    if same:  # the comparison must be able to see the attention: a 1% nudge shows
        with counting(perturb=True), torch.no_grad():
            nudged = logits(ours(input_ids=ids, attention_mask=mask, **extra))
        moved = (nudged - got).abs()
        seen = float((moved[keep] if keep is not None else moved).max()) / scale
        if seen <= 10 * max(error, 1e-6):  # a 1% error must show well above agreement
            return outcome(
                "insensitive", detail + f"; a 1% change of attention moved logits {seen:.1e}"
            )
    return outcome("equal" if same else "different", detail)


def seq2seq_inputs(model: Any) -> dict[str, torch.Tensor]:
    """Decoder tokens, for the models of the seq2seq mapping that have a decoder (some are
    decoder-only language models behind an audio encoder)."""
    if "decoder_input_ids" not in inspect.signature(model.forward).parameters:
        return {}
    g = torch.Generator().manual_seed(2)
    return {"decoder_input_ids": torch.randint(3, 99, (2, 7), generator=g)}


def logits(output: Any) -> torch.Tensor:
    return output.logits.float()


def generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, mapping: str) -> torch.Tensor:
    """Greedy tokens with the cache (none for the masked-LM mapping: encoders)."""
    if mapping == "masked":
        return torch.empty(0)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            **({"decoder_start_token_id": 1} if mapping == "seq2seq" else {}),
        )


def one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    return text[:160]


MAPPINGS = {
    "causal": "Causal language models (`MODEL_FOR_CAUSAL_LM_MAPPING`)",
    "masked": "Encoders (`MODEL_FOR_MASKED_LM_MAPPING`)",
    "seq2seq": "Encoder–decoders (`MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING`)",
}
BEGIN, END = "<!-- families: begin -->", "<!-- families: end -->"


def table(results: dict[str, list[Outcome]]) -> str:
    """The markdown of docs/huggingface.md between its markers."""
    import transformers

    lines = [
        f"Measured with transformers {transformers.__version__} and torch "
        f"{torch.__version__.split('+')[0]} by `python -m tests.integrations.hf_families --write "
        "docs/huggingface.md`.",
        "",
    ]
    for mapping, outcomes in results.items():
        counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
        ran = len(outcomes) - counts["eager fails"]
        interface = [
            o
            for o in outcomes
            if o.status not in ("eager fails", "no attention") and not o.own_attention
        ]
        equal = sum(o.status == "equal" for o in interface)
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        lines += [
            f"### {MAPPINGS[mapping]}",
            "",
            f"{len(outcomes)} families: {summary}. Of the {ran} that run on eager with a tiny "
            f"config, {counts['equal']} ({counts['equal'] / max(ran, 1):.0%}) are equal on qkv; "
            f"of the {len(interface)} of those whose attention goes through transformers' "
            f"interface, {equal} are.",
            "",
            "| family | model | on qkv | detail |",
            "|---|---|---|---|",
        ]
        for o in outcomes:
            detail = o.detail.replace("|", "\\|").replace("[", "\\[")  # a table cell, no links
            lines.append(f"| `{o.family}` | `{o.model_class}` | {o.status} | {detail} |")
        lines.append("")
    return "\n".join(lines)


def write(path: str, results: dict[str, list[Outcome]]) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{table(results)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mapping", choices=list(MAPPINGS), action="append")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--write", metavar="PATH", help="rewrite the table in this file")
    args = parser.parse_args(argv)
    results = {}
    for mapping in args.mapping or list(MAPPINGS):
        results[mapping] = []
        for family, name in families(mapping).items():
            if args.only and family not in args.only:
                continue
            o = run_family(family, name, mapping)
            results[mapping].append(o)
            print(f"{o.family:28} {o.status:12} {o.seconds:5.1f}s  {o.detail}", flush=True)
    if args.write:
        write(args.write, results)
    bad = [
        o.family
        for os_ in results.values()
        for o in os_
        if o.status in ("different", "insensitive")
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.exit(main())
