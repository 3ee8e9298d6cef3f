"""Projections: speedups estimated from measured acceptance and per-forward costs (speculation, quantisation, TP)."""
