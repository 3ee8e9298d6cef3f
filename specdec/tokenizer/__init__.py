"""Tokenizers: the model folder's tokenizer with its chat template (tokenizer.py), and the one a GGUF file carries,
rebuilt as a Hugging Face ``tokenizers`` object when it is converted (gguf_tokenizer.py)."""
