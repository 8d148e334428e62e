"""RoPE (qkv.RoPE): a rotation that sees relative positions, and what a module saves."""

import pytest
import torch

import qkv


def test_rope_is_a_rotation_that_sees_relative_positions():
    rope = qkv.RoPE(8).double()
    q, k = (
        torch.randn(2, 3, 5, 8, dtype=torch.float64),
        torch.randn(2, 3, 5, 8, dtype=torch.float64),
    )
    torch.testing.assert_close(rope(q, 7).norm(dim=-1), q.norm(dim=-1))
    shifted = rope(q, 11) @ rope(k, 11).transpose(-1, -2)
    torch.testing.assert_close(rope(q, 0) @ rope(k, 0).transpose(-1, -2), shifted)
    # Against the complex-number definition: x_j + i·x_{j+D/2} times e^{i·p·θ_j}.
    p = torch.arange(3, 8, dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    z = torch.complex(q[..., :4], q[..., 4:]) * torch.polar(
        torch.ones(5, 4, dtype=torch.float64), p[:, None] * theta
    )
    torch.testing.assert_close(rope(q, 3), torch.cat([z.real, z.imag], -1))
    torch.testing.assert_close(rope(q, torch.arange(3, 8)), rope(q, 3))


def test_rope_frequencies_are_not_saved_with_the_weights():
    # A buffer recomputed from head_dim and base: checkpoints hold weights only.
    mha = qkv.MultiHeadAttention(16, 16, num_heads=2, rope=qkv.RoPE(8))
    assert not any("inv_freq" in name for name in mha.state_dict())
    assert list(qkv.RoPE(8).state_dict()) == []


def test_interleaved_scaled_rope_rotates_neighbouring_pairs():
    """interleaved=True pairs (x_2i, x_2i+1) and lays the result out as the even channels
    then the odd ones; scaling multiplies cos and sin; inv_freq is taken as given."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    freqs = torch.rand(4, dtype=torch.float64)
    plain = qkv.RoPE(8, inv_freq=freqs, scaling=0.5)
    mixed = qkv.RoPE(8, inv_freq=freqs, scaling=0.5, interleaved=True)
    halves = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    torch.testing.assert_close(mixed(x, 7), plain(halves, 7), rtol=0, atol=0)
    norms = plain(x, 7).norm(dim=-1) / x.norm(dim=-1)
    torch.testing.assert_close(norms, torch.full_like(norms, 0.5))
    assert "interleaved=True, scaling=0.5" in repr(mixed)
    with pytest.raises(ValueError, match="inv_freq must have shape"):
        qkv.RoPE(8, inv_freq=torch.ones(3))
