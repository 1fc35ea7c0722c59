"""The engine host (specgate.vllmside.engine.main): vLLM imported once, engines in forked children."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from specgate.contract import summary
from specgate.vllmside import engine

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run(key: str, model: str) -> dict:
    return {"key": key, "llm": {"model": model, "max_model_len": 64},
            "phases": [{"key": f"{key} greedy", "prompts": [[1, 2, 3]],
                        "sampling": {"max_tokens": 2, "temperature": 0}}]}


@pytest.mark.vllm
def test_each_failed_engine_gets_a_fresh_child_and_the_host_pays_the_import_once(tmp_path):
    """Two engines that fail at LLM(...): the first child stops after its failure, the host
    forks a second child for the rest, and both results arrive with one import between them."""
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    runs = [_run("a", str(tmp_path / "no-such-model-a")), _run("b", str(tmp_path / "no-such-model-b"))]
    request.write_text(json.dumps(runs))
    code = ("import os, sys\nimport specgate.vllmside.engine as engine\ncode = engine.main(sys.argv[1:])\n"
            "print('host', os.getpid(), code)")
    out = subprocess.run([sys.executable, "-c", code, str(request), str(result)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "0"
    data = engine.read_answer(result)
    assert data["stopped"] is None and sorted(data["results"]) == ["a", "b"]
    first, second = data["results"]["a"], data["results"]["b"]
    assert "no-such-model-a" in first["error"]["message"] and "no-such-model-b" in second["error"]["message"]
    assert first["import_s"] > 1.0 > second["import_s"]   # the host imported vLLM; the second child inherited it


def test_the_answer_survives_a_child_that_died_while_writing_a_result(tmp_path):
    """Each engine's result is a record of its own: one cut short by a dying child is skipped,
    and the records before it and those a fresh child appends after it still count; the host's
    import goes to the first engine it started."""
    path = tmp_path / "result.json"
    engine._append_record(path, {"results": {"blocked": {"error": None, "blocked": "why"}}, "probes": {},
                                 "stopped": None})
    engine._append_record(path, {"host_import": {"engine": "a", "s": 7.5}})
    engine._append_record(path, {"results": {"a": {"error": None, "import_s": 0.01}}})
    with path.open("a") as out:   # the next child's engine, killed mid-write
        out.write("\n" + json.dumps({"results": {"b": {"error": None, "import_s": 0.0}}})[:25])
    engine._append_record(path, {"stopped": "an engine failed"})
    engine._append_record(path, {"results": {"c": {"error": None, "import_s": 0.0}}})
    answer = engine.read_answer(path)
    assert sorted(answer["results"]) == ["a", "blocked", "c"] and answer["stopped"] == "an engine failed"
    assert answer["results"]["a"]["import_s"] == 7.51 and answer["results"]["c"]["import_s"] == 0.0
    assert engine.read_answer(tmp_path / "never-written.json") == {"results": {}}


def test_a_child_killed_by_a_signal_ends_the_host_with_its_status(tmp_path, monkeypatch):
    """run_engines then blames the engine the child was running (tests/ci covers that chain)."""
    # An engine the OOM killer took.
    monkeypatch.setattr(engine, "generate", lambda *args, **kwargs: os.kill(os.getpid(), 9))
    assert engine._fork_engines([_run("a", "x")], tmp_path / "result.json", {"results": {}, "probes": {}},
                                None) == 128 + 9
    assert not (tmp_path / "result.json").exists()


@pytest.mark.vllm
def test_the_host_answers_what_only_vllm_knows_and_starts_no_engine_it_blocks(tmp_path):
    """The pytest process never imports vLLM: the host says which runs cannot start here and
    why (an architecture vLLM does not register; an "only_v2" run where the V2 runner is
    blocked), and leaves those runs unstarted."""
    unknown = {**_run("unknown", str(tmp_path / "never-loaded")), "models": [["NoSuchForCausalLM", "org/none"]]}
    v2_only = {**_run("v2", str(tmp_path / "no-such-model-v2")), "only_v2": True}
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    answer = engine.run_engines([unknown, v2_only], tmp_path / "host", env=env, timeout_s=300)
    assert answer.v2_known
    blocked = answer.results["unknown"]["blocked"]
    assert blocked.startswith("environment-blocked: NoSuchForCausalLM (org/none): vLLM ")
    assert blocked.endswith("registers no model class for NoSuchForCausalLM")
    v2 = answer.results["v2"]
    if answer.v2_blocker:   # here: no Triton CPU backend
        assert v2 == {"error": None, "blocked": answer.v2_blocker, "process": 0}
        assert answer.v2_blocker.startswith(engine.V2_NEEDS_TRITON)
    else:                   # where V2 can run, the run starts (and fails on its missing model)
        assert "no-such-model-v2" in v2["error"]["message"]


@pytest.mark.vllm
def test_the_host_has_vllm_inspect_later_engines_models_while_the_first_runs(tmp_path):
    """vLLM inspects a model class in a fresh process (10 to 13 s here) and caches the answer
    under VLLM_CACHE_ROOT/modelinfos. The host asks for the later runs' classes in the
    background, the MTP draft under the name vLLM gives it, and leaves the first run's
    classes to its own engine. Both engines here fail before vLLM looks at a model class,
    so only the host's thread can have asked."""
    from specgate.vllmside.fixtures import _mimo_config

    mimo = tmp_path / "mimo"
    _mimo_config().save_pretrained(mimo)
    first = {**_run("first", str(tmp_path / "no-such-model")), "models": [["Qwen3ForCausalLM", "org/first"]]}
    mtp = {**_run("mtp", str(mimo)), "models": [["MiMoForCausalLM", "org/mimo"]]}
    mtp["llm"] |= {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
                   "no_such_engine_argument": 1}   # LLM(...) rejects it before building any config
    cache = tmp_path / "vllm-cache"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": str(cache)}
    answer = engine.run_engines([first, mtp], tmp_path / "host", env=env, timeout_s=300)
    assert "no-such-model" in answer.results["first"]["error"]["message"]
    assert "no_such_engine_argument" in answer.results["mtp"]["error"]["message"]
    inspected = sorted(path.name for path in (cache / "modelinfos").iterdir())
    assert inspected == ["vllm-model_executor-models-mimo-MiMoForCausalLM.json",
                         "vllm-model_executor-models-mimo_mtp-MiMoMTP.json"]


class _Engine:
    """What vLLM 0.32's in-process EngineCore does with the collector: it freezes the whole heap
    once it is up (freeze_gc_heap) and unfreezes it at shutdown. Its self-reference is the kind of
    cycle an engine is full of, so only a collect frees it."""

    def __init__(self) -> None:
        self.me = self
        gc.freeze()

    def shutdown(self) -> None:
        gc.unfreeze()
        gc.collect()


def _young(obj: object) -> bool:
    """Whether the collector walks `obj` (gc.get_objects lists every generation but the frozen one)."""
    return any(o is obj for o in gc.get_objects())


def test_an_engine_under_the_hosts_freeze_stays_collectable_and_the_frozen_heap_stays_frozen():
    """Inside host_owns_gc_freeze, vLLM's freeze and unfreeze do nothing: what the host froze
    stays frozen through the shutdown (so its collects walk only the engine), and the engine is
    never frozen, so a collect after it is deleted frees it. A freeze left on would keep every
    engine of the process alive; an unfreeze left on costs 2 s a shutdown. Outside, both work."""
    module_state = [object()]
    gc.freeze()
    try:
        with engine.host_owns_gc_freeze():
            core = _Engine()
            alive = weakref.ref(core)
            assert _young(core)
            core.shutdown()
            assert not _young(module_state)
            del core
            gc.collect()
            assert alive() is None
        gc.unfreeze()
        assert _young(module_state)
    finally:
        gc.unfreeze()


@pytest.mark.vllm
def test_the_55005_probe_tells_the_release_from_a_build_with_the_fix(tmp_path):
    """The probe on vLLM 0.32.0 as released finds #55005 (the expansion leaves its sentinel-filled
    output untouched); with the expansion PR #55006 proposes in place of the released one, the
    same probe finds it fixed. Each in a fresh vLLM process, as the engine host runs it."""
    code = ("import json, sys\nfrom specgate.vllmside import enginehooks\n"
            "if sys.argv[1] == 'fixed':\n"
            "    from vllm.utils import cpu_triton_utils\n"
            "    cpu_triton_utils._expand_kernel_impl = lambda o, i, c, f, t, MAX_NUM_TOKENS=None: "
            "enginehooks.expand_in_torch(o, i, c, f, t)\n"
            "print(json.dumps(enginehooks.probe_defects()))")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    verdicts = {}
    for build in ("released", "fixed"):
        out = subprocess.run([sys.executable, "-c", code, build], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        verdicts[build] = json.loads(out.stdout.splitlines()[-1])["vllm-55005"]
    assert verdicts == {"released": "present", "fixed": "fixed"}


def test_counters_since_gives_each_phase_what_it_added():
    before = {"drafts": 3, "drafted_tokens": 9, "accepted_tokens": 4, "per_position": [2, 1]}
    after = {"drafts": 5, "drafted_tokens": 15, "accepted_tokens": 7, "per_position": [3, 2, 1]}
    assert engine.counters_since(before, after) == {"drafts": 2, "drafted_tokens": 6, "accepted_tokens": 3,
                                                    "per_position": [1, 1, 1]}


def test_loaded_kernels_names_the_kernel_libraries_under_vllm(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 fd:01 11 /venv/lib/python3.12/site-packages/vllm/_C_AVX2.abi3.so\n"
        "7f01-7f02 r--p 00001000 fd:01 11 /venv/lib/python3.12/site-packages/vllm/_C_AVX2.abi3.so\n"
        "7f02-7f03 r-xp 00000000 fd:01 12 /venv/lib/python3.12/site-packages/vllm/_moe_C.abi3.so\n"
        "7f03-7f04 r-xp 00000000 fd:01 13 /venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so\n"
        "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n")
    assert engine.loaded_kernels(maps) == ["_C_AVX2"]
    assert engine.loaded_kernels(tmp_path / "absent") == []


@pytest.mark.vllm
def test_an_engine_process_maps_the_kernel_library_its_cpu_takes():
    """vllm/platforms/cpu.py loads _C where the CPU has AVX512-BF16, _C_AVX512 with AVX-512 only, and
    _C_AVX2 otherwise (on vllm._custom_ops' import, as an engine does); the summary's `kernels` reads it from the
    process's own maps."""
    isa = summary.host()["isa"]
    want = "_C" if "avx512_bf16" in isa else "_C_AVX512" if "avx512f" in isa else "_C_AVX2"
    code = ("import json\nimport vllm._custom_ops\nfrom specgate.vllmside import engine\n"
            "print(json.dumps(engine.loaded_kernels()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [want]
