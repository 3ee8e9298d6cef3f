"""The runner: one ragged forward of a model on its paged KV pool (staging, CUDA graphs, forward timing)."""
