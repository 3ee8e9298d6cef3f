"""Acceptance benchmarks: how many draft tokens the target accepts (traces, block verification, EAGLE-3, trees)."""
