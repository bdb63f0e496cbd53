"""Integrations of the compressed KV cache into serving engines (vLLM)."""
