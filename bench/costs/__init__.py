"""Cost benchmarks: what one piece of the step costs (host overhead, sampler, forward, RNG, quantised linear, trees)."""
