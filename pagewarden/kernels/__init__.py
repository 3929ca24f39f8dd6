"""Every compute kernel: the attention interface and its plain-torch implementation
(``attention.py``), the C++ CPU kernels (``cpu/``), the Triton kernels (``triton/``), and
the choice of attention backend (``backend.py``)."""
