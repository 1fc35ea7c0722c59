"""specgate: a Nox-driven CI harness that gates vLLM speculative decoding on CPU."""
