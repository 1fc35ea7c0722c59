"""The upstream test tree and its pipeline file list (specgate.vllmside.upstream).

The sdist tests serve a small fake vLLM sdist from a real HTTP index on 127.0.0.1;
nothing here downloads the real 44 MB sdist or imports vLLM.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from localserver import LocalServer

from specgate.core.manifest import load
from specgate.vllmside import upstream

REPO = Path(__file__).resolve().parent.parent
SPEC_STEP = "cpu-spec-decode-tests"
PIPELINE = ".buildkite/hardware_tests/cpu.yaml"


# --------------------------------------------------------------------------- the real pipeline

@pytest.fixture(scope="module")
def real_pipeline() -> Path:
    """vLLM 0.32.0's cpu.yaml from its sdist on the configured index, through the harness cache
    the tests mirror (tests/hermetic.py): the tree a session cached, else unpacked into the
    mirror now, so no test depends on a session having cached it before."""
    return upstream.fetch_tree("0.32.0", upstream.index_url()) / PIPELINE


def test_real_cpu_pipeline_lists_the_pinned_unit_files_and_keeps_e2e_apart(real_pipeline):
    files = upstream.pipeline_files(real_pipeline, SPEC_STEP)
    assert len(files) == 14 and all(f.startswith("tests/v1/") and f.endswith(".py") for f in files)
    assert "tests/v1/spec_decode/test_ngram.py" in files
    assert "tests/v1/e2e/test_cpu_spec_decode.py" not in files  # the second invocation is cpu_e2e's
    step = upstream.find_step(real_pipeline, SPEC_STEP)
    invocations = upstream.pytest_invocations("\n".join(step["commands"]))
    assert [upstream.file_args(i) for i in invocations[1:]] == [["tests/v1/e2e/test_cpu_spec_decode.py"]]
    assert files == list(load().unit.files)  # the manifest pins exactly vLLM 0.32.0's list


# --------------------------------------------------------------------------- crafted pipelines

def _pipeline(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpu.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_step_inside_a_group_with_string_command_and_value_options(tmp_path):
    path = _pipeline(tmp_path, """
        steps:
        - group: CPU
          steps:
          - key: other
            commands: ["pytest tests/other.py"]
          - key: spec
            command: >-
              cd /w && python3 -m pytest -x -m cpu_model --timeout 30 -k 'not slow'
              tests/a.py tests/b.py::TestK --junitxml=j.xml; pytest tests/c.py
        """)
    assert upstream.pipeline_files(path, "spec") == ["tests/a.py", "tests/b.py::TestK"]


def test_wrapped_script_with_line_continuations_and_unset(tmp_path):
    path = _pipeline(tmp_path, r'''
        steps:
        - key: spec
          commands:
          - |
            bash run-cpu-test.sh 30m "
            pytest -v -s --num-shards=$$N --shard-id=$$I \
            tests/x.py \
            tests/y.py
            unset VLLM_CPU_CI_ENV
            pytest tests/e2e.py"
        ''')
    assert upstream.pipeline_files(path, "spec") == ["tests/x.py", "tests/y.py"]


@pytest.mark.parametrize("text, message", [
    ("steps:\n- key: other\n  commands: ['pytest tests/a.py']\n", "no step with key 'spec'"),
    ("steps:\n- key: spec\n  commands: ['echo hello']\n", "runs no pytest command with test files"),
    ("steps:\n- key: spec\n  commands: ['pytest -x -v']\n", "runs no pytest command with test files"),
    ("steps: [key: spec\n", "not valid YAML"),
])
def test_unusable_pipeline_is_one_line_and_exit_1(tmp_path, text, message):
    with pytest.raises(upstream.UpstreamError) as caught:
        upstream.pipeline_files(_pipeline(tmp_path, text), "spec")
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.exit_code == 1


def test_missing_pipeline_file(tmp_path):
    with pytest.raises(upstream.UpstreamError, match="pipeline file not found") as caught:
        upstream.pipeline_files(tmp_path / "absent.yaml", "spec")
    assert caught.value.exit_code == 1


# --------------------------------------------------------------------------- drift

def test_drift_pairs_vllms_real_rename():
    pinned = ["tests/v1/worker/test_gpu_autoregressive_speculator.py", "tests/v1/worker/test_gpu_batch_ordering.py",
              "tests/v1/spec_decode/test_ngram.py"]
    listed = ["tests/v1/worker/test_gpu_target_dependent_ar_speculator.py",
              "tests/v1/worker/test_gpu_batch_ordering.py", "tests/v1/spec_decode/test_ngram.py",
              "tests/v1/spec_decode/test_dflash2.py"]
    gap = upstream.drift(pinned, listed)
    assert gap.renamed == [("tests/v1/worker/test_gpu_autoregressive_speculator.py",
                            "tests/v1/worker/test_gpu_target_dependent_ar_speculator.py")]
    assert gap.added == ["tests/v1/spec_decode/test_dflash2.py"] and gap.removed == []
    assert gap.as_dict()["renamed"][0]["upstream"].endswith("target_dependent_ar_speculator.py")
    assert any(line.startswith("  renamed:") for line in gap.lines())


def test_drift_does_not_pair_unlike_names_or_other_folders():
    gap = upstream.drift(["tests/a/test_ngram.py", "tests/a/test_eagle.py"],
                         ["tests/a/test_dflash_causality.py", "tests/b/test_eagle.py"])
    assert gap.renamed == []
    assert gap.removed == ["tests/a/test_ngram.py", "tests/a/test_eagle.py"]
    assert gap.added == ["tests/a/test_dflash_causality.py", "tests/b/test_eagle.py"]


def test_no_drift_is_falsy():
    assert not upstream.drift(["a.py", "b.py"], ["b.py", "a.py"])


# --------------------------------------------------------------------------- version and index

def test_installed_version_reads_vllm_cpu_as_the_public_version():
    assert upstream.installed_version(("not-a-vllm-distribution", "vllm-cpu", "vllm")) == "0.32.0"
    with pytest.raises(upstream.UpstreamError) as caught:
        upstream.installed_version(("not-a-vllm-distribution",))
    assert caught.value.exit_code == 75


def test_index_url_prefers_uv_then_pip_then_pypi():
    assert upstream.index_url({"UV_INDEX_URL": "http://uv/simple", "PIP_INDEX_URL": "http://pip/simple"}) == "http://uv/simple"
    assert upstream.index_url({"PIP_INDEX_URL": "http://pip/simple"}) == "http://pip/simple"
    assert upstream.index_url({}) == upstream.DEFAULT_INDEX


# --------------------------------------------------------------------------- the sdist, over real HTTP

PYPROJECT = """\
[build-system]
requires = ["setuptools"]

[tool.pytest.ini_options]
markers = ["slow_test", "cpu_model: enable this model test in CPU tests"]
asyncio_mode = "auto"

[tool.coverage.run]
source = ["vllm"]
"""


def _fake_sdist(version: str, filler: int = 0) -> bytes:
    """A vllm sdist with tests/, .buildkite/ and pyproject.toml, and `filler` more test files."""
    top = f"vllm-{version}"
    files = {
        "pyproject.toml": PYPROJECT,
        "setup.py": "raise SystemExit('never built')\n",
        "vllm/__init__.py": "raise ImportError('the sdist vllm/ must never be imported')\n",
        "vllm.egg-info/PKG-INFO": f"Name: vllm\nVersion: {version}\n",
        "tests/__init__.py": "",
        "tests/test_where.py": (
            "import importlib.util, pathlib\n"
            "def test_vllm_is_not_taken_from_the_tree():\n"
            "    spec = importlib.util.find_spec('vllm')\n"
            "    root = pathlib.Path(__file__).resolve().parent.parent\n"
            "    assert spec is None or not pathlib.Path(spec.origin).resolve().is_relative_to(root)\n"
        ),
        ".buildkite/hardware_tests/cpu.yaml": "steps:\n- key: spec\n  commands: ['pytest tests/test_where.py']\n",
        **{f"tests/filler/test_{i}.py": f"def test_{i}(): pass\n" * 20 for i in range(filler)},
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class FakeIndex(LocalServer):
    """A PEP 503 simple index on 127.0.0.1 serving one vllm sdist, counting every request."""

    def __init__(self, version: str, *, sha256: str | None = "real", filler: int = 0) -> None:
        self.sdist = _fake_sdist(version, filler)
        self.filename = f"vllm-{version}.tar.gz"
        digest = hashlib.sha256(self.sdist).hexdigest() if sha256 == "real" else sha256
        self.fragment = f"#sha256={digest}" if digest else ""
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append(self.path)
                if self.path.rstrip("/") == "/simple/vllm":
                    body = (f'<html><body><a href="/files/{index.filename}{index.fragment}">'
                            f"{index.filename}</a></body></html>").encode()
                    self._send(200, body, "text/html")
                elif self.path == f"/files/{index.filename}":
                    self._send(200, index.sdist, "application/gzip")
                else:
                    self._send(404, b"not found", "text/plain")

            def _send(self, status, body, content_type):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__(Handler)
        self.url = f"{self.origin}/simple"
        self.start()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "upstream"


@pytest.fixture
def index():
    servers = []

    def start(version="9.9.9", **kwargs):
        servers.append(FakeIndex(version, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_sdist_is_fetched_once_then_reused_without_any_request(cache, index):
    served = index()
    root = upstream.fetch_tree("9.9.9", served.url)
    assert root == cache / "vllm-9.9.9"
    assert served.requests == ["/simple/vllm/", "/files/vllm-9.9.9.tar.gz"]
    # only tests/, .buildkite/ and the pytest config: never the sdist's vllm/ or its metadata
    assert sorted(p.name for p in root.iterdir()) == [".buildkite", upstream.MARKER, "pyproject.toml", "tests"]
    config = (root / "pyproject.toml").read_text()
    assert "markers" in config and "asyncio_mode" in config
    assert "coverage" not in config and "build-system" not in config
    described = upstream.describe(root)
    assert described["sha256"] == hashlib.sha256(served.sdist).hexdigest() and described["version"] == "9.9.9"

    assert upstream.fetch_tree("9.9.9", served.url) == root
    assert len(served.requests) == 2  # the second run made no request at all
    served.close()
    assert upstream.tree("9.9.9", environ={"UV_INDEX_URL": served.url}) == root  # works with the index gone


def test_pytest_in_the_tree_never_sees_the_sdist_vllm(cache, index):
    root = upstream.fetch_tree("9.9.9", index().url)
    files = upstream.pipeline_files(root / PIPELINE, "spec")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                          cwd=root, capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr


def test_hash_mismatch_leaves_nothing_behind(cache, index):
    served = index(sha256="0" * 64)
    with pytest.raises(upstream.UpstreamError, match="could not fetch") as caught:
        upstream.fetch_tree("9.9.9", served.url)
    assert caught.value.exit_code == 75
    assert sorted(p.name for p in cache.iterdir()) == ["vllm-9.9.9.lock"]  # no tree, no half-built temp folder


def test_a_listing_without_hash_is_refused(cache, index):
    with pytest.raises(upstream.UpstreamError, match="without a hash") as caught:
        upstream.fetch_tree("9.9.9", index(sha256=None).url)
    assert caught.value.exit_code == 75
    assert not (cache / "vllm-9.9.9").exists()


def test_absent_version_on_the_index(cache, index):
    with pytest.raises(upstream.UpstreamError, match="no source distribution for vllm==1.2.3") as caught:
        upstream.fetch_tree("1.2.3", index().url)
    assert caught.value.exit_code == 75


def test_unreachable_index_is_an_environment_problem(cache, index):
    served = index()
    url = served.url
    served.close()  # the port is closed now: connection refused
    with pytest.raises(upstream.UpstreamError, match="could not fetch") as caught:
        upstream.fetch_tree("9.9.9", url)
    assert caught.value.exit_code == 75 and "\n" not in str(caught.value)


# --------------------------------------------------------------------------- a damaged or half-made tree

@pytest.mark.parametrize("damage", [
    lambda root: (root / "tests" / "test_where.py").write_text("def test_vllm_is_not_taken_from_the_tree(): pass\n"),
    lambda root: os.truncate(root / ".buildkite" / "hardware_tests" / "cpu.yaml", 10),
    lambda root: (root / "tests" / "test_where.py").unlink(),
    lambda root: (root / upstream.MARKER).write_text(json.dumps({"version": "9.9.9", "source": "sdist"})),
], ids=["changed", "truncated", "deleted", "marker-without-digests"])
def test_a_damaged_tree_is_fetched_again(cache, index, capsys, damage):
    served = index()
    root = upstream.fetch_tree("9.9.9", served.url)
    good = upstream.file_digests(root)
    assert upstream.damage(root) is None and len(served.requests) == 2
    (root / "tests" / "__pycache__").mkdir()
    (root / "tests" / "__pycache__" / "x.pyc").write_bytes(b"pytest ran here")   # not damage
    assert upstream.damage(root) is None
    damage(root)
    assert upstream.damage(root) is not None
    assert upstream.fetch_tree("9.9.9", served.url) == root
    assert "upstream tree vllm-9.9.9: " in capsys.readouterr().out and len(served.requests) == 4
    assert upstream.file_digests(root) == good and upstream.damage(root) is None


def test_a_damaged_tree_with_the_index_unreachable_is_75_and_removed(cache, index):
    served = index()
    root = upstream.fetch_tree("9.9.9", served.url)
    os.truncate(root / "tests" / "test_where.py", 3)
    served.close()
    with pytest.raises(upstream.UpstreamError, match="could not fetch") as caught:
        upstream.fetch_tree("9.9.9", served.url)
    assert caught.value.exit_code == 75
    assert "the cached tree was damaged: tests/test_where.py has 3 bytes" in str(caught.value)
    assert sorted(p.name for p in cache.iterdir()) == ["vllm-9.9.9.lock"]    # nothing damaged left for the next job


FETCH = "import sys; from specgate.vllmside import upstream; upstream.fetch_tree('9.9.9', sys.argv[1])"


def test_sigkill_mid_extract_leaves_no_tree_and_the_next_fetch_cleans_up(cache, index):
    """A fetch SIGKILLed while it extracts (1,500 filler files, the sdist's last) leaves only its
    temporary folder; the next fetch removes it and makes a whole tree."""
    served = index(filler=1_500)
    env = {**os.environ, "SPECGATE_CACHE_DIR": str(cache.parent), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", FETCH, served.url], env=env, cwd=REPO)
    deadline = time.monotonic() + 120
    # Killed as soon as the fillers begin: the check is cheap, so the kill lands while most are to come.
    while not list(cache.glob(".vllm-9.9.9-*/tree/tests/filler")):
        assert proc.poll() is None and time.monotonic() < deadline, "the fetch ended before it was killed"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (cache / "vllm-9.9.9").exists() and list(cache.glob(".vllm-9.9.9-*"))
    left = [tree for tree in cache.glob(".vllm-9.9.9-*/tree")]
    assert left and len(list((left[0] / "tests" / "filler").iterdir())) < 1_500, "killed after the extraction"
    root = upstream.fetch_tree("9.9.9", served.url)
    assert upstream.damage(root) is None and len(list((root / "tests" / "filler").iterdir())) == 1_500
    assert sorted(p.name for p in cache.iterdir()) == ["vllm-9.9.9", "vllm-9.9.9.lock"]


# --------------------------------------------------------------------------- a checkout

def _checkout(root: Path) -> Path:
    (root / "tests" / "v1").mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "v1" / "test_one.py").write_text("def test_one(): pass\n")
    (root / ".buildkite").mkdir()
    (root / ".buildkite" / "cpu.yaml").write_text("steps: []\n")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text("")
    (root / "pyproject.toml").write_text(PYPROJECT)
    return root


def test_checkout_is_copied_without_its_vllm_package(cache, tmp_path):
    checkout = _checkout(tmp_path / "vllm-src")
    root = upstream.tree("0.0.0", str(checkout))
    assert root.parent == cache
    assert sorted(p.name for p in root.iterdir()) == [".buildkite", upstream.MARKER, "pyproject.toml", "tests"]
    assert upstream.describe(root)["path"] == str(checkout)
    (checkout / "tests" / "v1" / "test_two.py").write_text("def test_two(): pass\n")
    rebuilt = upstream.tree("0.0.0", environ={upstream.SOURCE_DIR_VAR: str(checkout)})
    assert (rebuilt / "tests" / "v1" / "test_two.py").is_file()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [root.name]  # no leftovers


@pytest.mark.parametrize("make", [lambda p: p / "absent", lambda p: _checkout(p / "c") / "tests"])
def test_bad_source_dir_is_bad_input(cache, tmp_path, make):
    with pytest.raises(upstream.UpstreamError, match="not a vLLM checkout") as caught:
        upstream.tree("0.0.0", str(make(tmp_path)))
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)


def test_pytest_config_without_a_pytest_section_is_an_empty_table(tmp_path):
    upstream.write_pytest_config('[project]\nname = "vllm"\n', tmp_path)
    assert (tmp_path / "pyproject.toml").read_text() == "[tool.pytest.ini_options]\n"
    json.dumps(upstream.describe(tmp_path))  # no marker: still describable


def test_a_development_build_falls_back_to_the_release_before_it_and_says_so(cache, index):
    served = index("9.9.8")
    assert upstream.tests_release("9.9.8", served.url) == ("9.9.8", None)   # a release: its own, no request
    assert served.requests == []
    release, note = upstream.tests_release("9.9.9.dev12", served.url)
    assert release == "9.9.8"
    assert note == ("vLLM 9.9.9.dev12 is a development build with no source distribution of its own: its upstream "
                    "tests and pipeline are vLLM 9.9.8's (name the build's own checkout with --vllm-source-dir)")


def test_a_development_build_with_no_release_before_it_is_75(cache, index):
    served = index("9.9.9")
    with pytest.raises(upstream.UpstreamError) as caught:
        upstream.tests_release("9.9.9rc1", served.url)
    assert caught.value.exit_code == 75 and "lists no vllm release before 9.9.9" in str(caught.value)


def test_the_vllm_side_pipelines_trigger_list_is_upstreams_own(real_pipeline):
    """.buildkite/vllm/pipeline.yml's if_changed starts from this list (tests/test_vllm_pipeline.py)."""
    from specgate.ciside import vllmpaths

    assert vllmpaths.upstream_dependencies(real_pipeline.read_text()) == list(vllmpaths.UPSTREAM_DEPENDENCIES_0_32)
