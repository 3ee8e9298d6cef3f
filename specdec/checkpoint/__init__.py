"""Checkpoints into our forward: finding a model (folder, hub id, .gguf), reading safetensors in place, converting
GGUF files (gguf.py; their Q4/Q8 blocks kept as they are: gguf_blocks.py), quantising while loading (quant_load.py)
and the default model's verified, cached conversion (default_model.py)."""
