"""Attention kernels. Each takes canonical (B, H, T, D) tensors that the core has
validated and returns ``(out, weights, lse)`` with ``None`` for what it cannot give."""
