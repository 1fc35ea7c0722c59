"""The vLLM side: the engine host and what it installs into vLLM (enginehooks, and the mutant
catalogue it patches in when SPECGATE_MUTANT is set), the fixture checkpoints and their known
answers, where checkpoints come from, vLLM's own test tree and plugin, and the venvs and caches
a vLLM build needs. It imports only specgate.contract and specgate.core, never specgate.ciside."""
