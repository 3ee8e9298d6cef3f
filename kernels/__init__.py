"""Triton kernels for specdec and the torch references beside them.

This folder sits at the repository's top level (``kernels/``) but is installed as ``specdec.kernels`` (see
``pyproject.toml``), so it never clashes with the unrelated PyPI project named ``kernels``. Import it as
``from specdec.kernels import paged_attention``.

Each file holds one op: a private ``@triton.jit`` kernel, its public launcher, and a readable torch
reference that is both the CPU path and the test oracle. Callers go through ``specdec.ops``, which picks
the kernel or the reference (see ``specdec.ops`` for the dispatch rule).
"""
