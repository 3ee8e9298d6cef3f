"""Speed benchmarks: end-to-end tokens/s, plain decoding, drafters, adaptive k, prefix cache, tensor parallel."""
