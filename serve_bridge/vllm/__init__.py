"""The vLLM integration, vLLM 0.34.0, 0.33.0 and 0.26.0 (one seam per line in ``versions/``): the
only part of serve_bridge that imports vllm (docs/vllm_integration.md)."""
