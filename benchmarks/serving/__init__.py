"""The serving throughput harness (stock vLLM, GridTrim, StepTrim) on synthetic models."""
