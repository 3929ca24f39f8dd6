"""The CPU kernels: C++ sources built at first use (``build.py``), each with its Python
binding: paged attention, the bf16 GEMM and the linear layers over it, fused elementwise
ops, and the thread pool they share."""
