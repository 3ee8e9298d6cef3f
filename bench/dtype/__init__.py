"""fp32 vs bf16 on CPU: the measurements behind the CPU dtype policy
(bench/results/20261122_cpu_dtype/README.md). Run as modules:
``python -m bench.dtype.linear``, ``python -m bench.dtype.forward``, ``python -m bench.dtype.e2e --target smollm2``."""
