"""The vLLM 0.26.0 integration: the only part of serve_bridge that imports vllm (docs/vllm_integration.md)."""
