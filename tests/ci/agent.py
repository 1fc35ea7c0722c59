"""A Buildkite agent in miniature: runs .buildkite/pipeline.yml's steps the way an agent
does, so tests can drive the real chain (pipeline command -> scripts/run-cpu-test.sh ->
nox -> session -> pytest -> summary.json -> annotate.py) and look at what a build leaves.

What it does as Buildkite does: upload-time interpolation ($$ is a literal $, $NAME and
${NAME} come from the environment), the pipeline's and the step's env, `parallelism`
expanded into jobs with BUILDKITE_PARALLEL_JOB(_COUNT), the documented BUILDKITE_*
job variables, `bash -e -c COMMAND` in the checkout, `artifact_paths` uploaded after the
command (here: copied to store/<build id>/<job id>/), `soft_fail` exit statuses, and
`depends_on` (a dependent of a failed step does not run). A stand-in `buildkite-agent`
on PATH records every call (annotate with its body).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PIPELINE = REPO / ".buildkite" / "pipeline.yml"
HF_TOKEN = "hf_PLANTEDbuildkiteJOB0123456789"
AGENT_TOKEN = "bkagent_PLANTED0123456789abcdef"
SECRETS = (HF_TOKEN, AGENT_TOKEN)
VLLM_PIPELINE = REPO / ".buildkite" / "vllm" / "pipeline.yml"
# `artifact download PATTERN DEST --step KEY` copies what step KEY uploaded, from
# $STUB_UPLOADED/<KEY>/, to the same relative path under DEST, as the agent does.
STUB = """#!/usr/bin/env python3
import glob, json, os, shutil, sys
call = {"argv": sys.argv[1:], "job_id": os.environ.get("BUILDKITE_JOB_ID")}
if sys.argv[1:2] == ["annotate"]:
    call["body"] = sys.stdin.read()
if sys.argv[1:3] == ["artifact", "download"]:
    pattern, dest, step = sys.argv[3], sys.argv[4], sys.argv[sys.argv.index("--step") + 1]
    root = os.path.join(os.environ["STUB_UPLOADED"], step)
    for name in glob.glob(pattern, root_dir=root):   # as Buildkite does: the artifact's path kept under DEST
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copy(os.path.join(root, name), os.path.join(dest, name))
with open(os.environ["STUB_AGENT_CALLS"], "a") as log:
    log.write(json.dumps(call) + "\\n")
"""
_INTERPOLATION = re.compile(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Buildkite's upload-time interpolation, for the forms the pipelines use ($$, $NAME, ${NAME},
    ${NAME:-default})."""
    def value(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        found = env.get(m[1] or m[3], "")
        return found or (m[2] or "") if m[2] is not None else found

    return _INTERPOLATION.sub(value, text)


def pipeline(path: Path = PIPELINE) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@dataclass
class Job:
    step: str
    build_id: str
    job_id: str
    shard: int | None
    exit_status: int
    outcome: str                      # passed / soft_failed / failed
    output: str
    wall_s: float
    uploaded: Path                    # store/<build id>/<job id>
    annotations: list[dict] = field(default_factory=list)

    def summary(self, session: str) -> dict:
        return json.loads((self.uploaded / "artifacts" / session / "summary.json").read_text(encoding="utf-8"))


@dataclass
class Build:
    build_id: str
    number: int
    jobs: list[Job]

    @property
    def passed(self) -> bool:
        return all(job.outcome != "failed" for job in self.jobs)

    def of(self, step: str) -> list[Job]:
        return [job for job in self.jobs if job.step == step]


def agent_checkout(dest: Path) -> Path:
    """The agent's checkout: the working tree's tracked and unignored files. The harness's
    own nox venv is shared (it is pinned by constraints/harness.txt); session venvs are not."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    if (REPO / ".venv-nox").is_dir():
        (dest / ".venv-nox").symlink_to(REPO / ".venv-nox")
    return dest


class Agent:
    def __init__(self, checkout: Path, home: Path, env: dict[str, str] | None = None,
                 pipeline: Path = PIPELINE) -> None:
        self.checkout, self.home, self.pipeline = checkout, home, pipeline
        self.store = home / "artifact-store"
        self.calls = home / "agent-calls.jsonl"
        bin_dir = home / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        (bin_dir / "buildkite-agent").write_text(STUB)
        (bin_dir / "buildkite-agent").chmod(0o755)
        self.env = {**self._machine_env(bin_dir), **(env or {})}
        self.builds = 0

    @staticmethod
    def _machine_env(bin_dir: Path) -> dict[str, str]:
        """The agent machine's environment: this one without the test session's venv and
        harness variables, plus what an agent sets for every job."""
        venv = os.environ.get("VIRTUAL_ENV", "\0")
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if not p.startswith((venv, str(REPO / ".nox")))]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPECGATE_", "HF_", "PYTEST_", "NOX", "VIRTUAL_ENV", "BUILDKITE"))}
        return {**env, "PATH": os.pathsep.join([str(bin_dir), *path]), "BUILDKITE": "true", "CI": "true",
                "BUILDKITE_AGENT_NAME": "ci-agent-1", "BUILDKITE_AGENT_ACCESS_TOKEN": AGENT_TOKEN,
                "BUILDKITE_ORGANIZATION_SLUG": "acme", "BUILDKITE_PIPELINE_SLUG": "specgate",
                "BUILDKITE_BRANCH": "main", "BUILDKITE_BUILD_AUTHOR": "Qwen", "BUILDKITE_SOURCE": "webhook",
                "TOKENIZERS_PARALLELISM": "false", "HF_TOKEN": HF_TOKEN}

    def run_build(self, steps: list[str] | None = None, *, env: dict[str, str] | None = None,
                  step_env: dict[str, dict[str, str]] | None = None, shards: list[int] | None = None,
                  rewrite: Callable[[str, str], str] | None = None,
                  while_running: Callable[[subprocess.Popen, dict[str, str]], None] | None = None) -> Build:
        """One build of the pipeline's steps (all, or those named), in order; `shards` picks some
        jobs of a parallel step. `rewrite(step, command)` may change a command (e.g. a shorter
        timeout); `while_running(proc, job_env)` runs in a thread beside each job."""
        self.builds += 1
        data = pipeline(self.pipeline)
        build = Build(str(uuid.uuid4()), self.builds, [])
        upload_env = {**self.env, **(env or {})}   # what `pipeline upload` interpolates the file with
        build_env = {**upload_env, **{k: interpolate(str(v), upload_env) for k, v in (data.get("env") or {}).items()},
                     **(env or {}), "BUILDKITE_BUILD_ID": build.build_id, "BUILDKITE_BUILD_NUMBER": str(build.number),
                     "BUILDKITE_COMMIT": "0" * 40}
        failed: set[str] = set()
        for step in data["steps"]:
            key = step["key"]
            if steps is not None and key not in steps:
                continue
            needs = step.get("depends_on") or []
            if any(dep in failed for dep in ([needs] if isinstance(needs, str) else needs)):
                failed.add(key)   # blocked: Buildkite does not run it
                continue
            count = step.get("parallelism")
            for shard in [s for s in range(count) if shards is None or s in shards] if count else [None]:
                job = self._run_job(step, build_env | (step_env or {}).get(key, {}), build.build_id, shard,
                                    rewrite, while_running)
                build.jobs.append(job)
                if job.outcome == "failed":
                    failed.add(key)
        return build

    def _run_job(self, step: dict, build_env: dict[str, str], build_id: str, shard: int | None,
                 rewrite, while_running) -> Job:
        job_id = str(uuid.uuid4())
        env = {**build_env, **{k: str(v) for k, v in (step.get("env") or {}).items()},
               "BUILDKITE_JOB_ID": job_id, "BUILDKITE_STEP_KEY": step["key"], "BUILDKITE_STEP_ID": str(uuid.uuid4()),
               "BUILDKITE_LABEL": step["label"], "BUILDKITE_RETRY_COUNT": "0",
               "BUILDKITE_BUILD_CHECKOUT_PATH": str(self.checkout), "STUB_AGENT_CALLS": str(self.calls)}
        if shard is not None:
            env |= {"BUILDKITE_PARALLEL_JOB": str(shard), "BUILDKITE_PARALLEL_JOB_COUNT": str(step["parallelism"])}
        command = interpolate(step.get("command") or "\n".join(step["commands"]), env)
        if rewrite:
            command = rewrite(step["key"], command)
        env["BUILDKITE_COMMAND"] = command
        started = time.monotonic()
        proc = subprocess.Popen(["bash", "-e", "-c", command], cwd=self.checkout, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, errors="replace")
        watcher = threading.Thread(target=while_running, args=(proc, env), daemon=True) if while_running else None
        if watcher:
            watcher.start()
        output, _ = proc.communicate()
        if watcher:
            watcher.join(timeout=60)
        uploaded = self.store / build_id / job_id
        for pattern in step.get("artifact_paths") or []:
            for name in glob.glob(interpolate(pattern, env), root_dir=self.checkout, recursive=True):
                if (self.checkout / name).is_file():
                    (uploaded / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(self.checkout / name, uploaded / name)
        soft = step.get("soft_fail")
        soft_codes = {entry["exit_status"] for entry in soft} if isinstance(soft, list) else set()
        code = proc.returncode
        outcome = "passed" if code == 0 else "soft_failed" if soft is True or code in soft_codes else "failed"
        calls = [json.loads(line) for line in self.calls.read_text().splitlines()] if self.calls.exists() else []
        notes = [call for call in calls if call["job_id"] == job_id and call["argv"][:1] == ["annotate"]]
        return Job(step["key"], build_id, job_id, shard, code, outcome, output, round(time.monotonic() - started, 1),
                   uploaded, notes)
