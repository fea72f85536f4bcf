"""Model networks in plain torch (no vLLM)."""
