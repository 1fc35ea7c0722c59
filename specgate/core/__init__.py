"""The base every other layer stands on: the manifest, where caches live, the vLLM build
under test, the pinned environment, secret masking, the options every session shares, and
the torch-companion probe. It imports nothing of specgate's above it (the layers:
pyproject.toml [tool.importlinter]); several modules here are stdlib only, as they say."""
