"""Serving: `from seekforge.serve import LLM, SamplingParams` for offline / in-process generation,
`seekforge serve` for the OpenAI-compatible server. See engine.py for the layering."""

from seekforge.serve.async_engine import AsyncEngine
from seekforge.serve.engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from seekforge.serve.sequence import SamplingParams

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
