"""The one place that reads vLLM engine internals, and the engine process.

Everything here that is not vLLM's public API (attribute paths under
`LLM.llm_engine`, module globals vLLM decides with) goes through `engine_attr`
or `vllm_global`, which fail with one message naming the path and the vLLM
version when vLLM moves it. vLLM is imported lazily: the session module imports
specgate without paying for vLLM.

Engines run in an engine host (`python -m specgate.vllmside.engine REQUEST RESULT [CLAIMS OWNER]`, see
`run_engines`): it imports vLLM and torch once, then forks a child that runs the engines
one at a time, each started, used, shut down and freed before the next, the engine core
in-process (no further spawns). A child runs several engines while that is safe and
then exits, and the host forks a fresh one for the rest, which pays no second import:
vLLM 0.32's CPU worker scans every loaded module when it starts
(vllm.triton_utils.dispatcher._rebind_kernels), and once an ngram engine has loaded
numba, llvmlite's lazy library wrapper answers `__dict__` with a function wrapper, so
any later engine in that process fails with "AttributeError: '_lib_fn_wrapper' object
has no attribute 'get'". The caller orders ngram engines last. The host itself never
starts an engine, so every child starts from a process no engine has touched; while a
child runs, a thread of the host has vLLM inspect the model classes of the later engines
(`inspect_in_background`). run_engines may run several hosts at once (lanes), each taking
the next engine no other has taken (`Claims`), each with its share of the threads.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gc
import hashlib
import importlib
import importlib.util
import itertools
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from specgate.contract import processes
from specgate.vllmside import compilecache, enginehooks

# vLLM's own counter names (vllm/v1/spec_decode/metrics.py), read through LLM.get_metrics().
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "drafted_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
TIMED_OUT = "engine process timed out"    # how a test that lost its engine to engine_timeout_s says so
# vLLM's words when it falls back (vllm/config/vllm.py, VllmConfig.use_v2_model_runner).
V2_NEEDS_TRITON = "Model Runner V2 requires Triton; using the V1 model runner instead"


class EngineInternalsError(RuntimeError):
    """A vLLM internal the harness reads has moved; the message says which and where."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def _moved(path: str, exc: BaseException) -> EngineInternalsError:
    return EngineInternalsError(
        f"vLLM {vllm_version()}: cannot read {path} ({exc}); vLLM moved this internal, "
        "update specgate/vllmside/engine.py for this version"
    )


def engine_attr(llm: Any, path: str) -> Any:
    """Read `llm.llm_engine.<path>` (dotted), or fail naming the full path and the vLLM version."""
    full = f"LLM.llm_engine.{path}"
    obj = llm
    for part in ["llm_engine", *path.split(".")]:
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise _moved(full, exc) from exc
    return obj


def vllm_global(module: str, name: str) -> Any:
    """A module-level value vLLM decides with (e.g. the HAS_TRITON its config reads)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise _moved(f"{module}.{name}", exc) from exc


def compilation(llm: Any) -> dict[str, str]:
    """How the engine compiles the model: CompilationMode name and backend, as configured
    after the platform's adjustments (CPU: DYNAMO_TRACE_ONCE + inductor, or eager under
    VLLM_CPU_CI_ENV; NONE with enforce_eager)."""
    mode = engine_attr(llm, "vllm_config.compilation_config.mode")
    backend = engine_attr(llm, "vllm_config.compilation_config.backend")
    return {"mode": getattr(mode, "name", str(mode)), "backend": str(backend)}


def compile_counters() -> dict[str, int]:
    """vLLM's process-wide compilation counters (vllm.compilation.counter), plus torch's
    FX graph cache hits and misses (as "inductor.fxgraph_cache_hit" / "..._miss"); they see
    the engine's compiles only when the engine core runs in this process."""
    import dataclasses

    from torch._dynamo.utils import counters as torch_counters

    counter = vllm_global("vllm.compilation.counter", "compilation_counter")
    values = {f.name: getattr(counter, f.name) for f in dataclasses.fields(counter)}
    values.update({f"inductor.{name}": torch_counters["inductor"][name] for name in INDUCTOR_COMPILES})
    return values


# With VLLM_USE_AOT_COMPILE=0 (cpu_e2e's pin: vLLM 0.32 cannot load its own AOT artifacts on
# CPU) vLLM counts no compile at all; inductor's FX graph cache then shows each compiled graph,
# whether compiled now (miss) or loaded from the cache (hit). The eager backend touches neither.
INDUCTOR_COMPILES = ("fxgraph_cache_hit", "fxgraph_cache_miss")


def compiled_model(counters: dict[str, int]) -> bool:
    """Whether the counters saw the model go through torch.compile with inductor: vLLM's AOT
    compile (compiled now or its artifact loaded), or inductor compiling or loading a graph."""
    names = ("num_aot_compiles", "num_aot_artifacts_loaded", *(f"inductor.{n}" for n in INDUCTOR_COMPILES))
    return sum(counters.get(name, 0) for name in names) > 0


def runner(llm: Any) -> str:
    """The model runner the engine picked: "v2" or "v1"."""
    return "v2" if engine_attr(llm, "vllm_config.use_v2_model_runner") else "v1"


def loaded_kernels(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """vLLM's kernel libraries this process mapped (`_C`, `_C_AVX512`, `_C_AVX2`): vllm/platforms/cpu.py
    loads one by the CPU, each its own build of the spec-decode kernels. [] where the maps are unreadable."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    names = {Path(line.split()[-1]).name.split(".")[0] for line in lines if "/vllm/" in line}
    return sorted(name for name in names if name == "_C" or name.startswith("_C_"))


def triton_cpu_gap() -> str:
    """What is missing for Triton on CPU, in words naming the package and its backends."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    import triton

    try:
        from triton.backends import backends
    except ImportError as exc:
        return f"triton {triton.__version__} is installed but triton.backends does not import ({exc})"
    if "cpu" not in backends:
        return (f"the Triton CPU backend is missing: triton {triton.__version__} is installed "
                f"with backends {', '.join(sorted(backends)) or 'none'} and no 'cpu'")
    return f"triton {triton.__version__} has a 'cpu' backend but vLLM disabled Triton (see vLLM's log)"


def v2_runner_blocker() -> str | None:
    """Why vLLM will pick the V1 runner before any engine starts, or None if nothing
    known blocks V2. Mirrors VllmConfig.use_v2_model_runner: the explicit
    VLLM_USE_V2_MODEL_RUNNER setting wins, else the HAS_TRITON that vllm.config.vllm
    imported. Features V2 does not support are only known once a config exists, so
    the test still asserts the runner the engine really picked."""
    forced = vllm_global("vllm.envs", "VLLM_USE_V2_MODEL_RUNNER")
    if forced is not None:
        return None if forced else "VLLM_USE_V2_MODEL_RUNNER=0 forces the V1 model runner"
    if vllm_global("vllm.config.vllm", "HAS_TRITON"):
        return None
    return f"{V2_NEEDS_TRITON} ({triton_cpu_gap()})"


@functools.cache
def model_import_error(architecture: str) -> str | None:
    """Import the model class vLLM's registry maps `architecture` to, as the engine will.
    None when it imports; else a line naming the module that failed and why."""
    registry = vllm_global("vllm.model_executor.models", "ModelRegistry")
    try:
        model = registry.models[architecture]
    except AttributeError as exc:
        raise _moved("vllm.model_executor.models.ModelRegistry.models", exc) from exc
    except KeyError:
        return f"vLLM {vllm_version()} registers no model class for {architecture}"
    module = getattr(model, "module_name", architecture)
    try:
        model.load_model_cls()
    except ImportError as exc:
        missing = f"{exc.name} is not importable: " if getattr(exc, "name", None) else ""
        return (f"{missing}{type(exc).__name__}: {exc} (vLLM's model registry imports {module} "
                f"for {architecture})")
    return None


def draft_architecture(llm_kwargs: dict[str, Any]) -> str | None:
    """The architecture vLLM gives a run's draft: its checkpoint's config (the target's when
    the speculative config names none, as for MTP) under SpeculativeConfig.hf_config_override,
    which renames e.g. MiMoForCausalLM to MiMoMTPModel. None without a speculative config or
    where the config does not load (the engine then reports why)."""
    spec = llm_kwargs.get("speculative_config")
    if not spec:
        return None
    get_config = vllm_global("vllm.transformers_utils.config", "get_config")
    override = vllm_global("vllm.config.speculative", "SpeculativeConfig").hf_config_override
    try:
        config = get_config(spec.get("model") or llm_kwargs["model"], trust_remote_code=False)
        return override(config).architectures[0]
    except Exception:   # see the docstring
        return None


def inspect_in_background(architectures: list[str]) -> threading.Thread:
    """Have vLLM's registry inspect each architecture's model class in a thread of the host.
    vLLM inspects a class in a fresh Python process, which imports vLLM (10 to 13 s here),
    and caches the answer under VLLM_CACHE_ROOT/modelinfos, where an engine that starts
    later finds it. Asked while the engine child compiles on one core (vLLM sets
    TORCHINDUCTOR_COMPILE_THREADS=1), that wait runs on the other. An engine that gets
    there first inspects for itself; an inspection that fails here fails again, and is
    reported, in the engine that needs it."""
    registry = vllm_global("vllm.model_executor.models", "ModelRegistry")
    try:   # vLLM registers an architecture, or the engine reports that it does not
        inspections = [registry.models[a].inspect_model_cls for a in architectures if a in registry.models]
    except AttributeError as exc:
        raise _moved("vllm.model_executor.models.ModelRegistry.models[...].inspect_model_cls", exc) from exc
    # What vLLM's inspection imports, imported here: a module the thread is halfway through
    # importing when the host forks would be half-initialized in the engine child.
    importlib.import_module("cloudpickle")

    def inspect_all() -> None:
        for inspect in inspections:
            try:
                inspect()
            except RuntimeError:   # vLLM's word for a failed inspection process: see the docstring
                continue

    thread = threading.Thread(target=inspect_all, name="specgate-model-inspection", daemon=True)
    thread.start()
    return thread


def environment_block(models: list[list[str]]) -> str | None:
    """Why this machine cannot load a run's checkpoints ([architecture, name] pairs): a model
    class vLLM cannot import here (e.g. torchvision missing), or None."""
    for architecture, name in models:
        error = model_import_error(architecture)
        if error:
            return f"environment-blocked: {architecture} ({name}): {error}"
    return None


def spec_counters(llm: Any) -> dict[str, Any]:
    """The engine's speculative-decoding counters (cumulative since it started)."""
    values: dict[str, Any] = {key: 0 for key in SPEC_COUNTERS}
    values["per_position"] = []
    names = {v: k for k, v in SPEC_COUNTERS.items()}
    for metric in llm.get_metrics():
        if metric.name in names:
            values[names[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION:
            values["per_position"] = [int(v) for v in metric.values]
    return values


def request_metrics(output: Any) -> dict[str, Any] | None:
    """Per-request acceptance of one RequestOutput (per_request_spec_decode_metrics="detailed")."""
    metrics = output.outputs[0].spec_decode_metrics
    if metrics is None:
        return None
    return {
        "num_draft_tokens": int(metrics.num_draft_tokens),
        "histogram": list(metrics.histogram),
        "per_step_accepted": list(metrics.per_step_accepted),
        "per_step_drafted": list(metrics.per_step_drafted),
    }


def shutdown(llm: Any | None) -> None:
    """Stop the engine (its processes, if any) and free what it holds, before the next engine
    starts; with None (the engine failed to start) only the freeing."""
    if llm is not None:
        engine_attr(llm, "engine_core").shutdown()
    vllm_global("vllm.distributed.parallel_state", "cleanup_dist_env_and_memory")()


@contextlib.contextmanager
def host_owns_gc_freeze() -> Iterator[None]:
    """An engine's life with vLLM's own gc.freeze() and gc.unfreeze() calls turned off. vLLM
    freezes the whole heap once its engine is up and unfreezes all of it at shutdown, so each
    full gc.collect of the shutdown (three per engine) walks every object of vLLM's, torch's and
    transformers' modules: 0.7 s a collect here. The host froze those once, before the first
    engine and after each; the engine's objects stay young, so a collect walks only them, and
    the one after the engine is deleted frees its cycles. Five tiny engines in a row: shutdown
    0.25 s instead of 2.3 s, no engine left alive (vLLM's way keeps the last one until the next
    shutdown), the same resident memory."""
    freeze, unfreeze = gc.freeze, gc.unfreeze
    gc.freeze = gc.unfreeze = lambda: None
    try:
        yield
    finally:
        gc.freeze, gc.unfreeze = freeze, unfreeze


# --------------------------------------------------------------------------- the engine process

class EngineProcessError(RuntimeError):
    """The engine process failed in a way that could not be relayed as its own exception."""


def _outputs(outputs: list[Any]) -> dict[str, Any]:
    # JSON keys are strings: logprobs travel as [token, logprob] pairs per position.
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "logprobs": [[[[t, lp.logprob] for t, lp in (step or {}).items()]
                          for step in (o.outputs[0].logprobs or [])] for o in outputs],
            "request_metrics": [request_metrics(o) for o in outputs]}


def generate(llm_kwargs: dict[str, Any], phases: list[dict[str, Any]], *, probes: dict[str, str] | None = None,
             mutant_fired: Callable[[], int] | None = None) -> dict[str, Any]:
    """Start one engine, run its phases in order (each a set of requests, see `_run_phase`), shut
    it down. A phase that fails ends the engine: the phases after it are not run. `probes` (the
    host's `probe_defects`) says which repairs a phase may ask for: only a defect the build has
    is repaired. Returns JSON-ready data; an exception is recorded (pickled with its traceback)
    instead of raised."""
    result: dict[str, Any] = {"error": None, "phases": {}}
    llm = None
    started = time.monotonic()
    with host_owns_gc_freeze():
        try:
            from vllm import LLM

            result["import_s"] = round(time.monotonic() - started, 2)
            before = compile_counters()
            started = time.monotonic()
            llm = LLM(**llm_kwargs)
            result["init_s"] = round(time.monotonic() - started, 2)
            # An ngram engine has just imported its proposer (not earlier: see LLVMLITE_DEFECT),
            # whose kernels numba compiles at the first step.
            if ngram := sys.modules.get(NGRAM_PROPOSER):
                compilecache.keep_numba_kernels(ngram)
            result["compile_counters"] = {k: v - before[k] for k, v in compile_counters().items() if v != before[k]}
            result["runner"], result["compilation"] = runner(llm), compilation(llm)
            result["kernels"] = loaded_kernels()
            result["threads"] = importlib.import_module("torch").get_num_threads()   # its lane's share
            for phase in phases:
                data = _run_phase(llm, phase, probes or {})
                if mutant_fired is not None:   # how often the injected fault changed something in this phase
                    data["mutant_fired"] = mutant_fired()
                result["phases"][phase["key"]] = data
                if data["error"]:
                    break
        except Exception as exc:
            result["error"] = _error_record(exc)
        finally:
            started = time.monotonic()
            shutdown(llm)
            del llm
            gc.collect()   # the engine's own cycles: only the young objects, the rest is frozen
            result["shutdown_s"] = round(time.monotonic() - started, 2)
    return result


def _run_phase(llm: Any, phase: dict[str, Any], probes: dict[str, str]) -> dict[str, Any]:
    """One phase: generate its prompts (token-id lists or text) with their sampling parameters
    (one dict for all, or one per prompt), `batch` requests per generate call; then the
    `repeat` prompts once more (seeded determinism). `record_drafts` and `repair`:
    specgate.vllmside.enginehooks; the repair is applied where the probe found its defect."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    repair = phase.get("repair")
    present = probes.get(repair or "") == enginehooks.PRESENT
    data: dict[str, Any] = {"error": None, "repair": repair if present else None}
    inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in phase["prompts"]]
    sampling = phase["sampling"]
    # detokenize=False: the checks read token ids and logprobs only; decoding every token and
    # its logprobs took a third of an eagle3 sampling phase (3.8 s -> 2.4 s).
    params = ([SamplingParams(**s, detokenize=False) for s in sampling] if isinstance(sampling, list)
              else [SamplingParams(**sampling, detokenize=False)] * len(inputs))
    batch = phase.get("batch") or len(inputs)
    before = spec_counters(llm)
    started = time.monotonic()
    try:
        with enginehooks.active(record=phase.get("record_drafts", False), repair=data["repair"]):
            outputs = []
            for first in range(0, len(inputs), batch):
                outputs += llm.generate(inputs[first:first + batch], params[first:first + batch], use_tqdm=False)
            drafts, draft_q = enginehooks.drafts_by_request(), enginehooks.draft_q_by_request()
            data["generate_s"] = round(time.monotonic() - started, 2)
            # before the repeat: the checks read the first pass
            data["counters"] = counters_since(before, spec_counters(llm))
            repeat = phase.get("repeat") or []
            if repeat:
                again = llm.generate([inputs[i] for i in repeat], [params[i] for i in repeat], use_tqdm=False)
                data["repeat_token_ids"] = [list(o.outputs[0].token_ids) for o in again]
        data.update(_outputs(outputs))
        if phase.get("record_drafts"):
            data["drafts"], data["draft_q"] = drafts, draft_q
    except Exception as exc:
        data["error"] = _error_record(exc)
    return data


def counters_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the engine's cumulative spec-decode counters gained between two readings."""
    earlier = before["per_position"] + [0] * (len(after["per_position"]) - len(before["per_position"]))
    return {**{key: after[key] - before[key] for key in SPEC_COUNTERS},
            "per_position": [a - b for a, b in zip(after["per_position"], earlier, strict=True)]}


def _error_record(exc: BaseException) -> dict[str, str | None]:
    from tblib import pickling_support

    pickling_support.install(exc)
    try:
        pickled = base64.b64encode(pickle.dumps(exc)).decode("ascii")
    except Exception:  # an exception that does not pickle still travels as text
        pickled = None
    return {"type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)), "pickle": pickled}


def relay(error: dict[str, str | None]) -> BaseException:
    """The engine process's exception, re-created with its traceback where it unpickles."""
    pickled = error.get("pickle")
    if pickled:
        from tblib import pickling_support

        pickling_support.install()
        try:
            return pickle.loads(base64.b64decode(pickled))
        except Exception:
            pass
    return EngineProcessError(f"{error['type']}: {error['message']}\n{error['traceback']}")


NGRAM_PROPOSER = "vllm.v1.spec_decode.ngram_proposer"   # loads numba (llvmlite)
# vLLM 0.32's CPU worker start scans every loaded module and fails once llvmlite is loaded.
LLVMLITE_DEFECT = ("llvmlite (numba) is loaded in this process, and vLLM 0.32's CPU worker start "
                   "(vllm.triton_utils.dispatcher._rebind_kernels) fails on its lazy library wrapper")


def _generate_all(engines: list[dict[str, Any]], result_path: Path, answer: dict[str, Any],
                  mutant_fired: Callable[[], int] | None = None, claims: Claims | None = None,
                  import_s: float | None = None) -> None:
    """Engine child: engines one after another in this process, each taken (`claims`: the
    engines no other lane has taken) and its result appended to the result file as it ends;
    the first engine carries the host's import (`import_s`, its first child only). Stops early
    (the host forks a fresh child for the rest) after a failed engine or phase, whose leftovers
    could spoil the next, or once llvmlite is loaded."""
    claims = claims or Claims(None, "")
    stopped, started = None, 0
    for spec in engines:
        if started and "llvmlite" in sys.modules:
            stopped = LLVMLITE_DEFECT
            break
        if not claims.take(spec["key"]):
            continue
        if import_s is not None and not started:
            _append_record(result_path, {"host_import": {"engine": spec["key"], "s": import_s}})
        started += 1
        result = generate(spec["llm"], spec["phases"], probes=answer.get("probes"), mutant_fired=mutant_fired)
        # What outlived the shutdown is module state: frozen, the next engine's many full
        # gc.collect calls (vLLM's, during start and shutdown: host_owns_gc_freeze) skip it.
        gc.freeze()
        _append_record(result_path, {"results": {spec["key"]: result}})
        if result["error"] or any(p["error"] for p in result["phases"].values()):
            stopped = "an engine failed"
            break
    _append_record(result_path, {"stopped": stopped})


def _fork_engines(engines: list[dict[str, Any]], result_path: Path, answer: dict[str, Any],
                  mutant_fired: Callable[[], int] | None, claims: Claims | None = None,
                  import_s: float | None = None) -> int:
    """Host side: run `_generate_all` in a forked child and wait for it. Returns the child's
    exit status as a shell would (128 + signal when a signal ended it)."""
    pid = os.fork()
    if pid == 0:   # the child: dies with the host, and leaves without the host's exit handlers
        code = 1
        try:
            processes.die_with_parent()
            _generate_all(engines, result_path, answer, mutant_fired, claims, import_s)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _append_record(path: Path, record: dict[str, Any]) -> None:
    """One record of the host's answer, on a line of its own: each engine's result is written
    once (not the whole answer again after every engine), and a child that dies while writing
    leaves a broken line, which read_answer skips, never a broken file."""
    with path.open("a", encoding="utf-8") as out:
        out.write("\n" + json.dumps(record))


def read_answer(path: Path) -> dict[str, Any]:
    """The host's answer: its records merged in the order written, results by engine key; the
    import the host paid for all goes to the first engine it started."""
    answer: dict[str, Any] = {"results": {}}
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:   # empty, or cut short by a child that died
            continue
        answer["results"].update(record.pop("results", {}))
        answer.update(record)
    host_import = answer.pop("host_import", None)
    first = host_import and answer["results"].get(host_import["engine"])
    if first and "import_s" in first:
        first["import_s"] = round(first["import_s"] + host_import["s"], 2)
    return answer


class HostAnswer(NamedTuple):
    """What the engine hosts of one run_engines call answered."""
    results: dict[str, dict[str, Any]]   # engine key -> generate's result, or {"error": None, "blocked": why}
    v2_known: bool                       # whether a host got as far as v2_runner_blocker()
    v2_blocker: str | None               # what it said
    probes: dict[str, str]               # declared defect (its repair's name) -> enginehooks.probe_defects' verdict


class Claims:
    """Which host of a run_engines call starts which engine: a file per engine in `folder`, made
    once (a hard link, which fails where it exists) by the engine child about to start it and
    holding its host's `owner`. The lanes so share the engines as they free up, in the order
    given. No folder: every engine is free (one host, run by hand)."""

    def __init__(self, folder: Path | None, owner: str) -> None:
        self.folder, self.owner = folder, owner

    def _path(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / hashlib.sha256(key.encode()).hexdigest()[:32]

    def take(self, key: str) -> bool:
        if self.folder is None:
            return True
        # Written first, then linked into place (which fails if the claim exists): a claim is
        # never seen without its owner, even from a process killed while making it.
        written = self.folder / f".{os.getpid()}-{self._path(key).name}"
        written.write_text(self.owner, encoding="utf-8")
        try:
            os.link(written, self._path(key))
            return True
        except FileExistsError:
            return False
        finally:
            written.unlink()

    def free(self, key: str) -> bool:
        return self.folder is None or not self._path(key).exists()

    def taken_by(self, key: str) -> str | None:
        """The owner that took `key` (None: nobody has)."""
        try:
            return self._path(key).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None


HOST_MODULE = "specgate.vllmside.engine"   # what `python -m` runs as an engine host (main, below)


class _Host:
    """An engine host that run_engines started for one of its lanes."""

    def __init__(self, lane: int, number: int, engines: list[dict[str, Any]], workdir: Path, env: dict[str, str],
                 timeout_s: float) -> None:
        self.lane, self.engines, self.timeout_s = lane, engines, timeout_s
        self.number = number              # its place among the call's hosts: the engines' "process"
        self.claims = Claims(workdir / "claims", f"{lane}/{number}")
        request_path, self.result_path = workdir / f"request-{number}.json", workdir / f"result-{number}.json"
        request_path.write_text(json.dumps(engines), encoding="utf-8")
        self.started = time.monotonic()
        # In our process group, so a Buildkite timeout or cancel (which signals the group) reaches it.
        self.proc = subprocess.Popen([sys.executable, "-m", HOST_MODULE, str(request_path),
                                      str(self.result_path), str(workdir / "claims"), self.claims.owner],
                                     env=env, preexec_fn=processes.die_with_parent)

    def taken(self) -> list[dict[str, Any]]:
        return [e for e in self.engines if self.claims.taken_by(e["key"]) == self.claims.owner]

    def running(self) -> bool:
        """Whether it still runs within its time: timeout_s for each engine it took (or its import)."""
        if self.proc.poll() is not None:
            return False
        elapsed = time.monotonic() - self.started   # the claims are read only once past one engine's time
        return elapsed < self.timeout_s or elapsed < self.timeout_s * len(self.taken())

    def outcome(self) -> str | None:
        """Why the host, now ended (one past its time is ended here), failed; None: it did not."""
        if self.proc.poll() is None:
            processes.end_process_tree(self.proc.pid)
            self.proc.wait()
            return f"{TIMED_OUT} ({self.timeout_s:.0f} s per engine) and was killed"
        return f"engine process exited {self.proc.returncode}" if self.proc.returncode else None


def run_engines(engines: list[dict[str, Any]], workdir: Path, *, env: dict[str, str],
                timeout_s: float, lanes: int = 1) -> HostAnswer:
    """Run each engine {"key", "llm", "phases"} through `generate` in engine hosts (`python -m
    specgate.vllmside.engine`), `lanes` of them at once, one engine at a time each: a lane's
    host takes the next engine no other has taken (Claims), so the lanes share the engines as
    they free up and each starts its engines in the order given. Each lane gets an equal share
    of the environment's OMP_NUM_THREADS (at least one: never more lanes than threads). An
    engine may also carry "models" ([architecture, name] pairs: it does not start where
    environment_block names one) and "only_v2" (it does not start when v2_runner_blocker says
    why not); such an engine's result is {"error": None, "blocked": why}. An engine that got no
    result (its engine child or the host crashed or timed out) gets an error record, and a fresh
    host takes its lane on. A timeout (timeout_s per engine) ends the host and everything it
    started. The caller so never imports vLLM: the host answers what needs it, the probes of
    declared defects among it."""
    (workdir / "claims").mkdir(parents=True, exist_ok=True)
    threads = int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    count = max(1, min(lanes, threads, len(engines)))
    lane_env = {**env, "OMP_NUM_THREADS": str(threads // count)} if count > 1 else env
    results: dict[str, dict[str, Any]] = {}
    v2_known, v2_blocker, probes = False, None, {}
    numbers, claims = itertools.count(), Claims(workdir / "claims", "")
    running = [_Host(lane, next(numbers), engines, workdir, lane_env, timeout_s)
               for lane in range(count if engines else 0)]
    while running:
        time.sleep(0.05)
        for host in [h for h in running if not h.running()]:
            running.remove(host)
            why = host.outcome()
            answer = read_answer(host.result_path)
            if "v2_blocker" in answer and not v2_known:
                v2_known, v2_blocker, probes = True, answer["v2_blocker"], answer["probes"]
            results.update({key: {**result, "process": host.number} for key, result in answer["results"].items()})
            left = [e for e in engines if e["key"] not in results]
            if why:  # the engine the host was running when it died gets the blame (else the next free one)
                blamed = next((e for e in host.taken() if e in left), None) or next(
                    (e for e in left if host.claims.take(e["key"])), None)
                if blamed:
                    results[blamed["key"]] = {"error": {"type": EngineProcessError.__name__, "message": why,
                                                        "traceback": "", "pickle": None}, "process": host.number}
            if any(claims.free(e["key"]) for e in engines if e["key"] not in results):
                running.append(_Host(host.lane, next(numbers), engines, workdir, lane_env, timeout_s))
    return HostAnswer(results, v2_known, v2_blocker, probes)


def _fork_until_done(runs: list[dict[str, Any]], result_path: Path, answer: dict[str, Any], import_s: float,
                     mutant_fired: Callable[[], int] | None, claims: Claims) -> int:
    """Host side: fork engine children until no run is left that has no result and that no
    other host took; the first engine started carries the import the host paid for all.
    Returns 0, or a dead child's status."""
    first: float | None = import_s
    while pending := [r for r in runs if r["key"] not in answer["results"] and claims.free(r["key"])]:
        code = _fork_engines(pending, result_path, answer, mutant_fired, claims, first)
        if code:
            return code
        done = read_answer(result_path)["results"]
        if len(done) == len(answer["results"]) and any(claims.free(r["key"]) for r in pending):
            raise EngineProcessError(f"an engine child ran none of {len(pending)} engine(s)")   # else forked forever
        if len(done) > len(answer["results"]):
            first = None
        answer["results"] = done
    _append_record(result_path, {"stopped": None})
    return 0


def probe_in_child() -> dict[str, str]:
    """enginehooks.probe_defects, run in a forked child: the probe registers vLLM's CPU kernel
    overrides as an engine's worker does, which must not happen in the host before the repairs
    are installed (the engines' workers register the repaired kernels)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 1
        try:
            os.write(write, json.dumps(enginehooks.probe_defects()).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, encoding="utf-8") as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        why = f"unknown: the probe process ended with status {status} before answering"
        return dict.fromkeys(enginehooks.REPAIRS, why)
    return json.loads(text)


# What `generate` and every engine start import (vLLM imports most of itself lazily).
HOST_IMPORTS = ("vllm", "vllm.entrypoints.llm", "vllm.sampling_params", "vllm.inputs", "vllm.v1.worker.cpu_worker",
                "vllm.v1.worker.cpu_model_runner")


def main(argv: list[str]) -> int:
    """The engine host: import vLLM once, answer what only vLLM knows (which runs cannot
    start here, and why), write that, then fork engine children until every run has a
    result. A child that dies (not one whose engine failed: that is a result) ends the host
    with its status, and run_engines blames the engine it was running."""
    request_path, result_path = Path(argv[0]), Path(argv[1])
    claims = Claims(Path(argv[2]), argv[3]) if len(argv) > 3 else Claims(None, "")
    runs = json.loads(request_path.read_text(encoding="utf-8"))
    started = time.monotonic()
    for module in HOST_IMPORTS:   # here, once: every child forked below inherits them
        importlib.import_module(module)
    v2_blocker = v2_runner_blocker()
    blocked = {r["key"]: why for r in runs
               if (why := environment_block(r.get("models", [])) or (r.get("only_v2") and v2_blocker))}
    answer: dict[str, Any] = {"results": {key: {"error": None, "blocked": why} for key, why in blocked.items()},
                              "v2_blocker": v2_blocker, "probes": probe_in_child(), "stopped": None}
    _append_record(result_path, answer)   # a host that dies later still leaves this
    pending = [r for r in runs if r["key"] not in answer["results"]]
    architectures = [[a for a, _ in r.get("models", [])] + [draft_architecture(r["llm"])] for r in pending]
    # The first engine inspects its own classes at once; the thread answers for the later ones.
    later = [a for names in architectures[1:] for a in names if a and a not in architectures[0]]
    inspection = inspect_in_background(list(dict.fromkeys(later)))
    gc.freeze()   # as after each engine (_generate_all); the children also share these pages unwritten
    import_s = round(time.monotonic() - started, 2)
    phases = [phase for r in pending for phase in r["phases"]]
    present = {name for name, verdict in answer["probes"].items() if verdict == enginehooks.PRESENT}
    enginehooks.install(record=any(p.get("record_drafts") for p in phases),
                        repairs={p["repair"] for p in phases if p.get("repair") in present})
    mutant_fired = None
    mutant = os.environ.get("SPECGATE_MUTANT")   # only `nox -s mutants` sets it (specgate.sessions.mutants)
    if mutant:
        from specgate.vllmside import catalogue

        catalogue.install(mutant)
        mutant_fired = catalogue.take_fired
    try:
        return _fork_until_done(runs, result_path, answer, import_s, mutant_fired, claims)
    finally:
        inspection.join()   # its vLLM subprocess must not outlive the host


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
