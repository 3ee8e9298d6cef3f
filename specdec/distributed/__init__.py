"""Tensor parallelism (docs/tensor_parallel.md): the target (and the draft) sharded Megatron-style over ranks.

One responsibility per file:

- ``comm.py``: the process group of one engine (gloo on CPU, NCCL on CUDA) and its three collectives
  (all-reduce, broadcast from the driver, gather to the driver); a failure marks the group broken for good.
- ``sharding.py``: which heads / rows / columns a rank owns (``ShardLayout``), the configuration checks, and the
  slice of each checkpoint tensor a rank reads.
- ``layers.py``: the vocabulary-parallel embedding.
- ``payload.py``: the driver's command headers as a few ints, and a forward's inputs packed into one int64 tensor.
- ``channel.py``: the command channel: one broadcast of a fixed-size message per command (header, small payloads
  inline), over a gloo group of its own; what every launch mode uses.
- ``driver.py``: rank 0's stand-ins for a model and its pool, which send each forward / compaction.
- ``driver_link.py``: rank 0's end of the engine (groups, channel, its shards), whatever started the workers.
- ``worker.py``: ranks >= 1: load their shards, then run what the driver sends.
- ``launcher.py``: spawning the workers, the start-up handshake, liveness and shutdown.
- ``launch_env.py``: whether ``torchrun`` started this process, and the checks of an engine under it.
- ``torchrun.py``: rank 0 of a ``torchrun`` launch (the env:// rendezvous, no spawning) and the other ranks'
  entry (serve, then leave the process).
"""
