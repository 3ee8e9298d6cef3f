"""Tensor parallelism (docs/tensor_parallel.md): the target (and the draft) sharded Megatron-style over ranks.

One responsibility per file:

- ``comm.py``: the process group of one engine (gloo on CPU, NCCL on CUDA) and its three collectives
  (all-reduce, broadcast from the driver, gather to the driver); a failure marks the group broken for good.
- ``sharding.py``: which heads / rows / columns a rank owns (``ShardLayout``), the configuration checks, and the
  slice of each checkpoint tensor a rank reads.
- ``layers.py``: the vocabulary-parallel embedding.
- ``payload.py``: a forward's inputs packed into one int64 tensor (what the driver broadcasts) and unpacked.
- ``driver.py``: rank 0's stand-ins for a model and its pool, which broadcast each forward / compaction.
- ``worker.py``: ranks >= 1: load their shards, then run what the driver broadcasts.
- ``launcher.py``: spawning the workers, the start-up handshake, liveness and shutdown.
"""
