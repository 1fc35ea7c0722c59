"""The failure classifier on a corpus of real log excerpts, on the look-alikes
that fool a plain regex, and through its command-line wrapper."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from specgate.ciside.classify import LABELS, classify, explain

REPO = Path(__file__).resolve().parent.parent
LOGS = Path(__file__).resolve().parent / "logs"
CORPUS = sorted(LOGS.glob("*/*.log"))
SCRIPT = REPO / "scripts" / "classify_failure.py"


def test_corpus_is_large_and_covers_every_label():
    assert len(CORPUS) >= 30
    per_label = {label: [p for p in CORPUS if p.parent.name == label] for label in LABELS}
    assert {p.parent.name for p in CORPUS} == set(LABELS), "a directory is not a label"
    assert all(len(files) >= 5 for files in per_label.values()), {k: len(v) for k, v in per_label.items()}


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_corpus_file_gets_its_directory_label(path: Path):
    label, reason = explain(path.read_text())
    assert label == path.parent.name, reason
    assert reason and "\n" not in reason


def test_labels_are_in_precedence_order():
    assert LABELS == ("failure", "auth", "env-blocked", "transient", "cache-miss")


# --- one-line excerpts, one per label, as pytest's short summary shows them ---------
EXCERPTS = {
    "failure": "AssertionError: eagle3: mean acceptance length 1.31 < 2.0",
    "auth": "huggingface_hub.errors.GatedRepoError: 403 Client Error. (Request ID: Root=1-6650f1c2)",
    "env-blocked": "RuntimeError: operator torchvision::nms does not exist",
    "transient": "httpx2.ConnectError: [Errno 111] Connection refused",
    "cache-miss": "huggingface_hub.errors.OfflineModeIsEnabled: Cannot reach https://huggingface.co/api/models/"
                  "Qwen/Qwen3-0.6B/revision/main: offline mode is enabled.",
}


def _pytest_summary(*messages: str) -> str:
    lines = [f"FAILED tests/v1/spec_decode/test_x.py::test_{i} - {m}" for i, m in enumerate(messages)]
    return "\n".join(["=" * 20 + " short test summary info " + "=" * 20, *lines, f"{len(lines)} failed in 3.1s"])


@pytest.mark.parametrize("first,second", list(itertools.combinations(LABELS, 2)))
def test_mixed_run_takes_the_more_severe_label(first: str, second: str):
    text = _pytest_summary(EXCERPTS[second], EXCERPTS[first])
    label, reason = explain(text)
    assert label == first  # combinations() keeps LABELS' order: first is more severe
    assert "mixed run" in reason and f"1 {first}" in reason and f"1 {second}" in reason


@pytest.mark.parametrize("label", LABELS)
def test_each_excerpt_alone(label: str):
    assert classify(EXCERPTS[label]) == label
    assert classify(_pytest_summary(EXCERPTS[label], EXCERPTS[label])) == label


def test_unexplained_test_makes_a_cache_miss_run_a_failure():
    text = _pytest_summary(EXCERPTS["cache-miss"], "TypeError: propose() takes 1 positional argument but 2 were given")
    assert classify(text) == "failure"


def test_nothing_recognisable_is_a_failure():
    assert explain("") == ("failure", "failure: no recognised problem in the log")
    assert classify("==== 14 passed in 80.2s ====\nnox > Session cpu_unit failed.") == "failure"


# --- offline vs online -----------------------------------------------------------------
LOCAL_ENTRY = ("huggingface_hub.errors.LocalEntryNotFoundError: An error happened while trying to locate the file on "
               "the Hub and we cannot find the requested files in the local cache. Please check your connection and "
               "try again or make sure your Internet connection is on.")


@pytest.mark.parametrize("header,offline_hint,expected", [
    ("HF_HUB_OFFLINE            1", None, "cache-miss"),  # specgate's environment table
    ("run-cpu-test: attempt 1 with HF_HUB_OFFLINE=1: nox -s cpu_unit", None, "cache-miss"),
    ("{'HF_HUB_OFFLINE': 'true'}", None, "cache-miss"),
    ("HF_HUB_OFFLINE            0", None, "transient"),
    ("run-cpu-test: attempt 2 with HF_HUB_OFFLINE=0: nox -s cpu_unit", True, "transient"),  # the log beats the hint
    ("", None, "transient"),  # no evidence: online
    ("", True, "cache-miss"),  # the caller knows the run was offline
])
def test_local_entry_not_found_depends_on_offline_evidence(header: str, offline_hint, expected: str):
    assert classify(f"{header}\n{LOCAL_ENTRY}\n", offline=offline_hint) == expected


def test_hubs_advice_to_set_offline_0_is_not_online_evidence():
    advice = ("huggingface_hub.errors.LocalEntryNotFoundError: Cannot find an appropriate cached snapshot folder for "
              "the specified revision on the local disk and outgoing traffic has been disabled. To enable repo "
              "look-ups and downloads online, set 'HF_HUB_OFFLINE=0' as environment variable.")
    assert explain(advice) == ("cache-miss", "cache miss: a checkpoint not in the local HF cache (offline)")
    assert classify(f"{advice}\n{LOCAL_ENTRY}") == "cache-miss"


def test_transformers_offline_docs_link_is_not_offline_evidence():
    text = ("OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
            "the cached files.\nCheck your internet connection or see how to run the library in offline mode at "
            "'https://huggingface.co/docs/transformers/installation#offline-mode'.")
    assert classify(text) == "transient"
    assert classify("HF_HUB_OFFLINE=1\n" + text) == "cache-miss"


# --- hub id vs local path --------------------------------------------------------------
INVALID = ("  Value error, Invalid repository ID or local directory specified: '{}'.\n"
           "Please verify the following requirements:")


@pytest.mark.parametrize("value,expected", [
    ("Qwen/Qwen3-0.6B", "cache-miss"),
    ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "cache-miss"),
    ("/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/"
     "c1899de289a04d12100db370d81485cdf75e47ca", "cache-miss"),
    ("/root/.cache/specgate/fixtures/tiny-qwen3", "failure"),
    ("./fixtures/tiny-qwen3", "failure"),
    ("../tiny-qwen3", "failure"),
    ("~/models/tiny-qwen3", "failure"),
    ("fixtures/tiny/qwen3", "failure"),  # more than one slash
    ("tiny-qwen3", "failure"),  # a bare name is a relative directory here
])
def test_invalid_repository_id_hub_id_or_path(value: str, expected: str):
    assert classify(INVALID.format(value)) == expected


def test_invalid_repository_id_for_a_hub_id_online_is_not_a_cache_miss():
    assert classify("HF_HUB_OFFLINE=0\n" + INVALID.format("Qwen/Qwen3-0.6B")) == "failure"


@pytest.mark.parametrize("value,expected", [
    ("/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/"
     "c1899de289a04d12100db370d81485cdf75e47ca", "cache-miss"),
    ("/root/.cache/specgate/fixtures/tiny-qwen3", "failure"),
])
def test_no_weights_in_hf_cache_or_local_dir(value: str, expected: str):
    text = ("(Worker pid=17733) ERROR 11-29 22:04:50 [multiproc_executor.py:953] "
            f"RuntimeError: Cannot find any model weights with `{value}`")
    assert classify(text) == expected


# --- other look-alikes ---------------------------------------------------------------------
def test_404_that_mentions_authentication_is_a_failure_not_auth():
    text = ("huggingface_hub.errors.RepositoryNotFoundError: 404 Client Error. (Request ID: Root=1-6650f1c2)\n\n"
            "Repository Not Found for url: https://huggingface.co/api/models/Qwen/Qwen3-0.6B-nope/revision/main.\n"
            "If you are trying to access a private or gated repo, make sure you are authenticated and your token "
            "has the required permissions.")
    assert explain(text) == ("failure", "failure: repository Qwen/Qwen3-0.6B-nope not found on the hub (404)")
    assert classify(text.replace("404 Client", "401 Client")) == "auth"


def test_triton_fallback_warning_and_fake_tensor_noise_do_not_explain_anything():
    noise = (
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
        "(MainProcess pid=2211) WARNING 11-29 21:40:02 [vllm.py:725] Model Runner V2 requires Triton; "
        "using the V1 model runner instead.\n"
        "Exception ignored in: <function CPUDNNLGEMMHandler.__del__ at 0x7f3c2a1b9c60>\n"
        "Traceback (most recent call last):\n"
        '  File "/work/main/.nox/cpu_e2e/lib/python3.11/site-packages/torch/_inductor/cpu_handler.py", '
        'line 88, in __del__\n'
        "    assert not self.fake_mode\n"
        "AssertionError: Please convert all Tensors to FakeTensors first or instantiate FakeTensorMode with "
        "'allow_non_fake_inputs'.\n"
    )
    assert classify(noise + EXCERPTS["cache-miss"]) == "cache-miss"
    assert classify(noise) == "failure"  # nothing explains the failed run
    assert "no recognised problem" in explain(noise)[1]


def test_cuda_assertion_is_env_blocked():
    assert explain("AssertionError: Torch not compiled with CUDA enabled") == (
        "env-blocked", "env-blocked: CUDA not available (Torch not compiled with CUDA enabled)")


def test_not_subscriptable_is_triton_only_at_a_kernel_launch():
    launch = ("  File \"vllm/v1/worker/mamba_utils.py\", line 1226, in run_fused_precopy\n"
              "    precopy_mamba_align_fused_kernel[grid](\n"
              "TypeError: 'function' object is not subscriptable")
    assert explain(launch)[0] == "env-blocked"
    assert classify("TypeError: 'function' object is not subscriptable") == "failure"


def test_connection_refused_by_a_local_server_is_a_failure():
    local = ("requests.exceptions.ConnectionError: HTTPConnectionPool(host='localhost', port=8000): Max retries "
             "exceeded with url: /health (Caused by NewConnectionError('<urllib3.connection.HTTPConnection object>: "
             "Failed to establish a new connection: [Errno 111] Connection refused'))")
    assert classify(local) == "failure"
    assert classify(local.replace("'localhost', port=8000", "'huggingface.co', port=443")) == "transient"


def test_timeout_words_in_pytest_header_are_not_a_timeout():
    header = "timeout: 600.0s\ntimeout method: signal\ntimeout func_only: False\n"
    assert classify(header + EXCERPTS["cache-miss"]) == "cache-miss"
    assert explain(header + "E   Failed: Timeout (>600.0s) from pytest-timeout.") == (
        "failure", "failure: test timed out (pytest-timeout)")


def test_colours_and_timestamps_are_ignored():
    red, reset = "\x1b[31m", "\x1b[0m"
    text = (f"[2026-11-29T21:58:12Z] {red}E   huggingface_hub.errors.OfflineModeIsEnabled: "
            f"Cannot reach x: offline mode is enabled{reset}")
    assert classify(text) == "cache-miss"


def test_skips_naming_missing_pieces_are_not_failures():
    text = ("SKIPPED [2] tests/v1/spec_decode/test_eagle.py:41: CUDA is not available\n"
            "tests/v1/spec_decode/test_ngram.py::test_ngram_proposer SKIPPED (requires Triton.)\n"
            + EXCERPTS["transient"])
    assert classify(text) == "transient"


def test_a_single_tests_traceback_is_explained_alone():
    """cpu_unit passes one failed test's longrepr at a time."""
    text = (LOGS / "failure" / "pytest_mixed_assertion_and_cache_miss.log").read_text()
    block = text.split("test_target_config_cached ___", 1)[1].split("====", 1)[0]
    assert "OfflineModeIsEnabled" in block  # the chained cause pytest prints decides
    assert explain(block) == ("cache-miss", "cache miss: Qwen/Qwen3-0.6B not in the local HF cache (offline)")
    without_cause = "\n".join(line for line in block.splitlines() if "OfflineModeIsEnabled" not in line)
    assert explain(without_cause) == (
        "transient", "transient: the hub could not be reached for Qwen/Qwen3-0.6B (online)")
    assert explain(without_cause, offline=True)[0] == "cache-miss"


# --- the command-line wrapper ---------------------------------------------------------------
def _script(*args: str) -> subprocess.CompletedProcess:
    # -I -S: no site-packages, no user environment, as on a bare CI host.
    return subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("path", [p for p in CORPUS if p.stem in {
    "vllm_engine_no_weights_in_hf_cache", "pytest_gated_online_rerun", "pytest_torchvision_missing",
    "pytest_online_rerun_500", "pytest_mixed_assertion_and_cache_miss"}], ids=lambda p: p.parent.name)
def test_script_prints_the_label_last(path: Path):
    proc = _script(str(path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == path.parent.name
    assert lines[:-1] == [explain(path.read_text())[1]]


def test_script_bad_input_exits_2_with_one_line(tmp_path: Path):
    for args in [(str(tmp_path / "missing.log"),), (str(tmp_path),), (), ("a.log", "b.log")]:
        proc = _script(*args)
        assert proc.returncode == 2, args
        assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)


def test_script_reads_undecodable_bytes(tmp_path: Path):
    log = tmp_path / "run.log"
    log.write_bytes(b"\xff\xfe garbage\n" + EXCERPTS["auth"].encode())
    proc = _script(str(log))
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "auth"


@pytest.mark.parametrize("prefix", ["", "(EngineCore pid=7) ", "[2026-11-30T16:40:53Z] (EngineCore pid=7) "])
@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_vllm_progress_records_say_nothing(prefix: str, level: str):
    """vLLM's INFO/DEBUG records are dropped before any rule reads a line (that is what
    makes a 35 MB engine log fast); a WARNING or ERROR record with the same words counts."""
    miss = (LOGS / "cache-miss" / "hf_hub_download_offline.log").read_text()
    progress = f"{prefix}{level} 11-30 16:40:53 [core.py:402] retrying after Connection refused\n"
    assert classify(progress * 3 + miss) == "cache-miss"
    warning = progress.replace(level, "WARNING", 1)
    assert classify(warning + miss) == "transient"
