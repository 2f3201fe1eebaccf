"""pdserve: prefill/decode-disaggregated LLM serving around a pooled KV store."""

__version__ = "0.1.0"
