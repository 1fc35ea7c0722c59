"""The CI side: why a run failed from its log (classify), Buildkite's REST API, the past runs of
a step and the drift from them, the charts drawn from them, and the vLLM paths that trigger
specgate in vLLM's own pipeline. It imports only specgate.contract and specgate.core, never
specgate.vllmside."""
