"""The steps of ``python -m bench.gpu``, one module each, every one run as its own subprocess (so a hang or a
crash loses that step only), in this order: ``env``, ``e2e`` (random-weight models from ``models.py``), ``tests``,
``sanitizer`` (``sanitize.py`` is the script it runs under compute-sanitizer), ``kernels``, ``quant`` (both time
kernels over CUDA graph replays: ``graph_timing.py``), ``breakdown`` (a decode step's GPU time by kernel group:
``kernel_groups.py``), ``real`` (opt-in: SmolLM2's real weights, carried in chunks by
``bench/gpu_weights.py``) and ``summary``.
``common.runners`` is the one place that reaches into the engine's internals (its model runners).

Each takes ``--out DIR [--dry-run] [--deadline EPOCH]``: ``--dry-run`` runs the same code on CPU with tiny shapes,
``--deadline`` is when the orchestrator will kill it (steps that loop stop early and keep what they measured).
"""
