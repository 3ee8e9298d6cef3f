"""Speculative decoding: proposers, the per-round SpecDecodeMetadata, verification, KV compaction, adaptive k."""
