"""backend="flex": torch's FlexAttention lowered from qkv's masks (BlockMask from qkv's block
map, mask_mod from the predicate) and score modifications (score_mod), on the CPU (the same
tests run on CUDA when one is present). On CPU torch's FlexAttention runs inference only."""

import numpy as np
import pytest
import torch

import qkv
from qkv import masks
from qkv.core import lowering as L
from qkv.kernels import flex as F
from tests.helpers import SCORE_SHAPE, mask_zoo, oracle, score_zoo

pytest.importorskip("torch.nn.attention.flex_attention")
# A fall back to flex's unfused eager path (past the recompile limit) is a failure here.
pytestmark = pytest.mark.filterwarnings("error:flex_attention called without torch.compile")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
B, H, H_KV, T_Q, T_K, D, D_V = 2, 4, 2, 150, 300, 16, 8  # 2 x 3 blocks of 128
QKV_MASKS = [name for name, m in mask_zoo(B, T_K, T_Q).items() if not isinstance(m, torch.Tensor)]
QUICK_MASKS = ["none", "causal", "sliding_window", "padding", "document&causal", "predicate"]
QUICK_MODS = ["alibi", "softcap", "relative_bias", "bias"]


def inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T_Q, D, generator=g, dtype=dtype)
    k = torch.randn(B, H_KV, T_K, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_KV, T_K, D_V, generator=g, dtype=dtype)
    return q.to(device), k.to(device), v.to(device)


def check_mask(device, name):
    mask = mask_zoo(B, T_K, T_Q)[name]
    q, k, v = inputs(device)
    with torch.no_grad():
        out = qkv.attention(q, k, v, mask=mask, backend="flex")
    np.testing.assert_allclose(
        out.cpu().double().numpy(), oracle(q, k, v, mask=mask), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", QUICK_MASKS)
def test_flex_equals_the_oracle_for_each_mask(device, name):
    check_mask(device, name)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for n in QKV_MASKS if n not in QUICK_MASKS])
def test_flex_equals_the_oracle_for_every_other_mask(device, name):
    check_mask(device, name)


def check_mod(device, mod_name, mask_name):
    # score_zoo's modifications are built for its (T_q, T_k): run at that size.
    _, _, t_q, t_k = SCORE_SHAPE

    mod = score_zoo(torch.float32)[mod_name]
    mask = mask_zoo(B, t_k, t_q)[mask_name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(B, h, t, D, generator=g).to(device)
        for h, t in ((H, t_q), (H_KV, t_k), (H_KV, t_k))
    )
    with torch.no_grad():
        out = qkv.attention(q, k, v, mask=mask, score_mod=mod, backend="flex")
    np.testing.assert_allclose(
        out.cpu().double().numpy(), oracle(q, k, v, mask=mask, score_mod=mod), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mod_name", QUICK_MODS)
def test_flex_applies_score_modifications(device, mod_name):
    check_mod(device, mod_name, "causal")


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mod_name", list(score_zoo()))
@pytest.mark.parametrize(
    "mask_name", ["none", "sliding_window", "padding", "document&causal", "prefix_lm", "predicate"]
)
def test_flex_applies_every_modification_under_every_mask(device, mod_name, mask_name):
    check_mod(device, mod_name, mask_name)


STRUCTURED = {
    "causal": masks.causal(),
    "sliding_window": masks.sliding_window(100),
    "prefix_lm": masks.prefix_lm(200),
    "document": masks.document(np.repeat([0, 1, 2, 3], [90, 300, 12, 366])),
    "padding": masks.padding([450]),
    "document&causal": masks.document(np.repeat([0, 1], [333, 435])) & masks.causal(),
    "window|prefix": masks.sliding_window(64) | masks.prefix_lm(130),
}


@pytest.mark.parametrize("name", STRUCTURED)
def test_the_block_mask_equals_create_block_mask_block_for_block(name):
    from torch.nn.attention.flex_attention import create_block_mask

    # T a multiple of the block: at a ragged end create_block_mask counts the padding past
    # T as masked, so a last block qkv calls FULL is PARTIAL there (both compute the same).
    mask, T = STRUCTURED[name], 768
    ours = L.flex_block_mask(mask, 1, 1, T, T, 0, torch.device("cpu"))
    theirs = create_block_mask(
        L.flex_mask_mod(mask, 0, torch.device("cpu")), 1, 1, T, T, device="cpu", BLOCK_SIZE=F.BLOCK
    )
    for count, index in (
        ("kv_num_blocks", "kv_indices"),
        ("full_kv_num_blocks", "full_kv_indices"),
    ):
        n_ours, n_theirs = getattr(ours, count), getattr(theirs, count)
        assert torch.equal(n_ours, n_theirs), count
        for row, n in enumerate(n_ours[0, 0].tolist()):
            assert sorted(getattr(ours, index)[0, 0, row, :n].tolist()) == sorted(
                getattr(theirs, index)[0, 0, row, :n].tolist()
            ), (index, row)


def test_new_document_ids_do_not_recompile():
    from torch._dynamo.utils import counters

    q, k, v = inputs("cpu")
    rng = np.random.default_rng(3)
    with torch.no_grad():
        for step in range(3):
            ids = np.sort(rng.integers(0, 5, size=T_K))
            mask = masks.document(ids) & masks.causal()
            out = qkv.attention(q, k, v, mask=mask, backend="flex")
            if step == 0:
                graphs = counters["stats"]["unique_graphs"]
            np.testing.assert_allclose(
                out.double().numpy(), oracle(q, k, v, mask=mask), atol=1e-5, rtol=1e-5
            )
    assert counters["stats"]["unique_graphs"] == graphs  # the ids are inputs, not constants


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"mask": torch.ones(T_Q, T_K, dtype=torch.bool)}, "takes a qkv mask"),
        ({"dropout_p": 0.1}, "cannot give dropout"),
        ({"return_weights": True}, "cannot give the attention weights"),
    ],
)
def test_what_flex_cannot_do_is_refused(kw, match):
    q, k, v = inputs("cpu")
    with pytest.raises(ValueError, match=match):
        qkv.attention(q, k, v, backend="flex", **kw)


def test_on_the_cpu_flex_refuses_gradients_and_the_log_sum_exp():
    q, k, v = inputs("cpu")
    with pytest.raises(ValueError, match="inference only"):
        qkv.attention(q.requires_grad_(), k, v, mask=masks.causal(), backend="flex")
    with torch.no_grad(), pytest.raises(ValueError, match="log-sum-exp on CPU"):
        qkv.attention(q, k, v, mask=masks.causal(), backend="flex", return_lse=True)


def test_flex_is_never_chosen_by_auto_on_the_cpu_and_dispatch_says_why():
    q, k, v = (torch.zeros(1, 1, 4096, 8) for _ in range(3))
    choice = qkv.dispatch(q, k, v, mask=masks.sliding_window(64))
    assert choice.backend == "tiled" and "backend='flex'" in choice.reason


def test_auto_prefers_flex_on_cuda(monkeypatch):
    # Without a GPU, the rule itself: inputs taken for CUDA ones (qkv.core.call.Call.gpu)
    # send what the tiled kernel would take to flex, and leave SDPA what it does best.
    import qkv.core.dispatch as d

    monkeypatch.setattr(d.Call, "gpu", property(lambda ask: not isinstance(ask.mask, torch.Tensor)))
    q, k, v = (torch.randn(1, 2, 4096, 16) for _ in range(3))
    choose = lambda **kw: qkv.dispatch(q, k, v, **kw)  # noqa: E731
    assert choose(mask=masks.sliding_window(256)).backend == "flex"
    assert "on CUDA" in choose(mask=masks.sliding_window(256)).reason
    assert choose(mask=masks.causal(), return_lse=True).backend == "flex"
    assert choose(mask=masks.causal(), score_mod=qkv.scores.softcap(5.0)).backend == "flex"
    assert choose(mask=masks.causal()).backend == "sdpa"  # is_causal
    assert choose().backend == "sdpa"  # no mask
    assert choose(mask=masks.causal(), dropout_p=0.1).backend == "sdpa"  # flex has no dropout
    dense = masks.sliding_window(256).dense(1, 1, 4096, 4096)
    assert choose(mask=dense).backend != "flex"
