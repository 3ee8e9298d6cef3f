"""Memory benchmarks: resident weights and KV cache of a configuration."""
