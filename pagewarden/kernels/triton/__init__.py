"""Triton kernels for the paged KV cache (KV write, paged attention with fused checks) and
the ``AttentionOps`` backend over them."""
