"""specdec: lossless speculative decoding for Llama-family models on a paged KV cache."""

from specdec.llm import LLM
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
