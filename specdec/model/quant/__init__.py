"""Weight quantisation: formats (formats.py), the quantised linear (linear.py), its fast CPU paths (cpu_paths.py),
quantise-while-loading and GGUF blocks kept quantised (load.py)."""
