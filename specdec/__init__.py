"""specdec: lossless speculative decoding for Llama-family models on a paged KV cache."""
