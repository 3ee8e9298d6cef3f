"""Serving benchmarks: load against the OpenAI-compatible server and a long soak run."""
