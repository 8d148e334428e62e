"""qkv.heads: recording attention through qkv, the head scores, one query step by step."""

import pytest
import torch

import qkv
from qkv import heads, masks, scores
from qkv.models import GPT, GPTConfig
from tests.helpers import tiny_llama


def small_gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=32, **kw)).eval()


class Scripted(torch.nn.Module):
    """A one-layer 'model' whose four heads do one thing each, by a score bias: head 0 looks
    at the previous token, head 1 at the earlier occurrence of the same token, head 2 at the
    token after it (induction), head 3 at position 0. Other positions get a bias of 0."""

    def forward(self, ids):
        B, T = ids.shape
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        same = (ids[:, :, None] == ids[:, None, :]) & (j < i)  # (B, T, T) earlier duplicates
        after = torch.zeros_like(same)
        after[:, :, 1:] = same[:, :, :-1]  # the key right after an earlier duplicate
        wanted = torch.stack(
            [(j == i - 1).expand(B, T, T), same, after & (j < i), (j == 0).expand(B, T, T)], dim=1
        )  # (B, 4, T, T)
        bias = wanted.float() * 30.0
        q = k = v = torch.zeros(B, 4, T, 8)
        return qkv.attention(q, k, v, mask=masks.causal(), score_mod=scores.bias(bias))


def test_scores_find_the_head_that_does_each_thing():
    found = heads.head_scores(Scripted(), vocab_size=10_000, length=20)
    for h, name in enumerate(["previous_token", "duplicate_token", "induction", "first_token"]):
        row = found[name][0]
        assert row[h] > 0.99, (name, row)
        assert (row[torch.arange(4) != h] < 0.1).all(), (name, row)


def test_scores_over_blocks_of_rows_equal_scores_over_all_rows():
    L = 300  # 2L = 600 > one block of heads.ROW_BLOCK rows
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=2 * L, n_layer=2, n_head=4, n_embd=32)).eval()
    tokens = heads.repeated_tokens(256, L, batch=2)
    blocked = heads.head_scores(model, tokens=tokens)
    calls = heads.run(model, tokens)
    for layer, call in enumerate(calls):
        whole = heads.scores_from_weights(call.weights(rows=slice(L, 2 * L)), L)
        for name in heads.SCORES:
            torch.testing.assert_close(blocked[name][layer], whole[name], atol=1e-6, rtol=1e-5)


def test_recording_leaves_the_output_alone_and_stops_with_the_block():
    model, idx = small_gpt(), torch.randint(0, 256, (2, 30))
    before = model(idx)
    with heads.record() as calls:
        inside = model(idx)
        with heads.record() as inner:
            model(idx)
    model(idx)
    torch.testing.assert_close(inside, before, atol=1e-5, rtol=1e-5)
    assert len(calls) == 4 and len(inner) == 2  # two layers, two forward passes outside
    assert qkv.core.record.listeners() == ()


def test_a_record_block_sees_its_own_thread_only():
    # The open blocks live in a ContextVar: a block in one thread records that thread's
    # calls, not those another thread makes at the same time, and closes on an exception.
    import threading

    model, idx = small_gpt(), torch.randint(0, 256, (1, 12))
    seen = {}

    def other():
        with heads.record() as calls:
            model(idx)
            seen["other"] = len(calls)

    with heads.record() as mine:
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert seen["other"] == 2 and len(mine) == 0
    with pytest.raises(RuntimeError), heads.record():
        raise RuntimeError("boom")
    assert qkv.core.record.listeners() == ()


def test_recorded_weights_are_the_modules_weights():
    model, idx = small_gpt(positions="rope"), torch.randint(0, 256, (2, 30))
    with heads.record() as calls:
        model(idx)
    attn = model.blocks[1].attn
    x = model.blocks[0](model.wte(idx))
    q, k, v = attn.project(model.blocks[1].ln_1(x))
    _, expected = qkv.attention(
        q, k, v, mask=masks.causal(), return_weights=True, backend="reference"
    )
    torch.testing.assert_close(calls[1].weights(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        calls[1].weights(rows=[3, 29], heads=[2]),
        expected[:, [2]][:, :, [3, 29]],
        atol=1e-6,
        rtol=1e-5,
    )


def test_one_query_step_by_step_agrees_with_the_kernel():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 5)
    mod = scores.alibi(scores.alibi_slopes(4)).then(scores.softcap(2.0))
    mask = masks.sliding_window(4)
    with heads.record() as calls:
        out = qkv.attention(q, k, v, mask=mask, score_mod=mod)
    s = calls[0].step(row=6, head=3, batch=1)
    weights = calls[0].weights(rows=[6], heads=[3])[1, 0, 0]
    torch.testing.assert_close(s["weights"].float(), weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s["out"].float(), out[1, 3, 6], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s["scaled"], s["q·k"] * s["scale"])
    assert not torch.equal(s["modified"], s["scaled"])  # ALiBi and the cap changed them
    assert s["allowed"].tolist() == mask.dense(1, 1, 9, 12)[0, 0, 6].tolist()
    assert s["weights"][~s["allowed"]].eq(0).all()
    with pytest.raises(ValueError, match="no query row 9"):
        calls[0].step(row=9, head=0)


def test_huggingface_models_are_scored_through_qkv():
    model = tiny_llama("LlamaModel", vocab_size=50)
    eager = tiny_llama("LlamaModel", vocab_size=50, attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    ids = heads.repeated_tokens(50, 8, batch=2)
    found = heads.head_scores(model, tokens=ids)
    assert found["induction"].shape == (2, 4)
    with torch.no_grad():
        weights = eager(ids, output_attentions=True).attentions  # per layer (B, H, T, T)
    for layer, w in enumerate(weights):
        expected = heads.scores_from_weights(w[:, :, 8:], 8)
        for name in heads.SCORES:
            torch.testing.assert_close(found[name][layer], expected[name], atol=1e-5, rtol=1e-4)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="made no qkv.attention call"):
        heads.head_scores(torch.nn.Identity(), vocab_size=10, length=4)
    with pytest.raises(ValueError, match="each row a segment followed by itself"):
        heads.head_scores(small_gpt(), tokens=torch.arange(8)[None])
    with pytest.raises(ValueError, match="length >= 2"):
        heads.repeated_tokens(10, 1)
    with pytest.raises(ValueError, match="vocabulary size is unknown"):
        heads.head_scores(Scripted())
