"""Weight quantisation: formats (formats.py), the quantised linear (linear.py), its fast CPU paths (cpu_paths.py) and
their native build (native.py). Quantise-while-loading and GGUF blocks kept quantised are checkpoint loading:
specdec/checkpoint/quant_load.py and gguf_blocks.py."""
