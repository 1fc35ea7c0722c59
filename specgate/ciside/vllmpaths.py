"""The vLLM paths whose change makes specgate worth running in vLLM's own CI.

Upstream gates its CPU spec-decode job (`cpu-spec-decode-tests` in
.buildkite/hardware_tests/cpu.yaml) on `source_file_dependencies`, which vLLM's pipeline
generator reads and Buildkite does not. .buildkite/vllm/pipeline.yml needs the same list as
Buildkite `if_changed` globs, plus the CPU spec-decode files upstream's list misses.
Stdlib only (pyyaml is imported only to read a cpu.yaml).
"""

from __future__ import annotations

from collections.abc import Iterable

# As vLLM 0.32.0 spells them: a folder ends with "/", anything else is one file.
UPSTREAM_DEPENDENCIES_0_32 = (
    "vllm/v1/spec_decode/",
    "vllm/v1/worker/cpu/",
    "vllm/v1/worker/cpu_model_runner.py",
    "vllm/v1/worker/gpu/spec_decode/",
    "vllm/v1/attention/backends/cpu_attn.py",
    "vllm/config/speculative.py",
    "vllm/model_executor/models/qwen3_5.py",
    "vllm/model_executor/models/qwen3_5_mtp.py",
    "vllm/model_executor/models/llama_eagle3.py",
    "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
    "vllm/model_executor/layers/mamba/mamba_mixer2.py",
    "vllm/model_executor/layers/mamba/ops/cpu/",
    "tests/v1/e2e/test_cpu_spec_decode.py",
    "tests/v1/spec_decode/",
    "tests/v1/worker/",
)

# On the CPU spec-decode path but in no upstream entry: the Triton-on-CPU shim, the C++
# spec-decode kernels, the rejection sampler and the sampler that draws its bonus tokens, the
# top-k/top-p ops verification applies (mutants patch these, and sampling at T > 0 runs them),
# the CPU platform.
CPU_SPEC_DECODE_FILES = (
    "vllm/utils/cpu_triton_utils.py",
    "csrc/cpu/spec_decode_utils.cpp",
    "vllm/v1/sample/rejection_sampler.py",
    "vllm/v1/sample/sampler.py",
    "vllm/v1/sample/ops/topk_topp_sampler.py",
    "vllm/platforms/cpu.py",
)


def as_globs(entries: Iterable[str]) -> list[str]:
    """Upstream entries as Buildkite globs: a folder covers everything under it (`a/` -> `a/**`)."""
    return [entry + "**" if entry.endswith("/") else entry for entry in entries]


def if_changed(upstream_entries: Iterable[str] = UPSTREAM_DEPENDENCIES_0_32) -> list[str]:
    """The pipeline's `if_changed`: upstream's entries as globs, then the files they miss."""
    globs = as_globs(upstream_entries)
    return globs + [path for path in CPU_SPEC_DECODE_FILES if path not in globs]


def upstream_dependencies(pipeline_text: str, step_key: str = "cpu-spec-decode-tests") -> list[str]:
    """`source_file_dependencies` of the step keyed `step_key` in a cpu.yaml text (searched
    through groups, as specgate.vllmside.upstream.find_step does); KeyError when no step has that key."""
    import yaml  # only this reader needs it: the lists above are plain data

    def walk(steps: object) -> dict | None:
        for step in steps if isinstance(steps, list) else ():
            if isinstance(step, dict):
                found = step if step.get("key") == step_key else walk(step.get("steps"))
                if found is not None:
                    return found
        return None

    data = yaml.safe_load(pipeline_text)
    step = walk(data.get("steps") if isinstance(data, dict) else data)
    if step is None:
        raise KeyError(f"no step keyed {step_key!r}")
    return list(step.get("source_file_dependencies") or [])
