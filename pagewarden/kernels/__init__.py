"""Triton kernels for the paged KV cache (KV write, paged attention with fused checks)."""
