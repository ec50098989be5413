"""The vLLM 0.26.0 integration: the only package of the project that imports vllm."""
