"""Every compute kernel: the attention interface and its plain-torch implementation
(``attention.py``), the C++ CPU kernels (``cpu/``), the Triton kernels (``triton/``),
the choice of attention backend (``backend.py``), and the grammar's token mask
(``token_bitmask.py``)."""
