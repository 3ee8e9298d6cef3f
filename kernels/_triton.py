"""``triton`` and ``triton.language`` for the kernel modules, or a stand-in where triton is not installed.

Every kernel file holds its torch reference beside its Triton kernel, and the references are the CPU path.
``pyproject.toml`` installs triton on Linux only, so on other systems (or in a slim install) the kernel modules
must still import: this stand-in lets the ``@triton.jit`` definitions and ``tl.constexpr`` annotations run
without triton, and a kernel launched without it raises an ``ImportError`` that says so. (vLLM solves the same
problem with its ``TritonPlaceholder``.) ``specdec.ops`` only launches kernels for CUDA tensors or under
``force_triton()``.
"""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised by tests/test_import_without_triton.py in a subprocess
    HAS_TRITON = False

    class _MissingKernel:
        """What ``@triton.jit`` returns without triton: launching it (``kernel[grid](...)``) raises."""

        def __init__(self, fn=None):
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise ImportError(f"Triton kernel {self.__name__} needs triton, which is not installed "
                              "(pip install triton); the torch reference path needs no triton")

        def __call__(self, *args, **kwargs):
            return self[None]

    def _jit(fn=None, **_options):
        if fn is None:  # @triton.jit(do_not_specialize=...)
            return _MissingKernel
        return _MissingKernel(fn)

    class _Anything:
        """``tl.<anything>``: only ever evaluated in kernel annotations and signatures."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

    def _next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()

    triton = types.SimpleNamespace(
        jit=_jit,
        cdiv=lambda a, b: -(-a // b),
        next_power_of_2=_next_power_of_2,
        runtime=types.SimpleNamespace(JITFunction=_MissingKernel),
        language=_Anything(),
    )
    tl = triton.language

__all__ = ["HAS_TRITON", "triton", "tl"]
