"""specdec: lossless speculative decoding for Llama-family models on a paged KV cache."""

from specdec.checkpoint.default_model import default_model_path
from specdec.config import SpeculativeConfig
from specdec.llm import LLM
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "default_model_path"]
__version__ = "0.1.0"
