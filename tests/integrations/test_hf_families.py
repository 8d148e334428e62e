"""No Hugging Face family gives a different answer on qkv without an error.

Every family of transformers' causal-LM, masked-LM and seq2seq mappings is built from a
tiny random config and compared with eager (``tests/integrations/hf_families.py`` says how).
The full sweep (~250 families, about two minutes here) runs in CI as its own step
(``-m sweep``); the default run takes one family per mechanism the integration has —
so a change that breaks one shows in seconds, and the sweep catches the rest."""

import pytest

pytest.importorskip("transformers")

from tests.integrations import hf_families

#: One family per mechanism: plain interface (llama), sliding window and softcap (gemma2),
#: learned sinks (gpt_oss), sinks per row (inkling2_text), DSA indices (glm_moe_dsa),
#: eager's additive mask (deepseek_v4), MoE keywords (qwen3_moe), own attention refused
#: (codegen, bloom), latent attention (deepseek_v3), encoders (bert), encoder-decoders
#: (t5's position bias, bart's cross-attention, a bert2bert's broadcast mask).
SAMPLE = {
    "causal": [
        "llama",
        "gemma2",
        "gpt_oss",
        "inkling2_text",
        "glm_moe_dsa",
        "deepseek_v4",
        "qwen3_moe",
        "codegen",
        "bloom",
        "deepseek_v3",
    ],
    "masked": ["bert", "roberta"],
    "seq2seq": ["t5", "bart", "encoder-decoder"],
}
EXPECTED = {  # the sample's status, so a family that stops working is noticed
    "codegen": "refused",
    "bloom": "refused",
}


def check(mapping, family):
    outcome = hf_families.run_family(family, hf_families.families(mapping)[family], mapping)
    assert outcome.status not in ("different", "insensitive"), outcome
    return outcome


@pytest.mark.parametrize("mapping, family", [(m, f) for m, fs in SAMPLE.items() for f in fs])
def test_a_family_of_each_mechanism_is_equal_to_eager_or_refused(mapping, family):
    outcome = check(mapping, family)
    assert outcome.status == EXPECTED.get(family, "equal"), outcome


def _all():
    try:
        return [(m, f) for m in hf_families.MAPPINGS for f in hf_families.families(m)]
    except Exception:  # no transformers: the module is skipped above
        return []


@pytest.mark.sweep
@pytest.mark.parametrize("mapping, family", _all())
def test_no_family_is_silently_wrong(mapping, family):
    check(mapping, family)
