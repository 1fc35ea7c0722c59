"""nox -s warm_cache: make every checkpoint the selected suites need present.

For each checkpoint (at its pinned revision, as a full snapshot) the HF cache is
checked first, with no network. What is missing is fetched online in a child
process (this session pins HF_HUB_OFFLINE=1 and huggingface_hub reads it at
import), one checkpoint at a time under a file lock so concurrent runs download
each file once. Only transient errors are retried. The fixture checkpoints are
built in the same phase so offline suites have them.

A cached snapshot's bytes are checked against what the hub listed (specgate.vllmside.hubcheck):
a damaged file is removed and fetched again; where the hub cannot be reached the
checkpoint fails with cause cache-corrupt, naming the file (no fallback to its fixture
in auto mode: the job had that checkpoint and must say it lost it).

Exit 0 when every needed checkpoint is present in the chosen mode (auto: hub or
fixture), 75 when something required is missing and unreachable, 2 on bad input.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from filelock import FileLock, Timeout

from specgate.contract import artifacts, exitcodes, processes
from specgate.core import cli, envpin
from specgate.core.manifest import REPO_ROOT, Checkpoint, Manifest
from specgate.core.paths import tree_size
from specgate.sessions import lifecycle
from specgate.sessions.caches import session as caches
from specgate.vllmside import cachestore, hubcheck, sources

SESSION = "warm_cache"
ATTEMPTS = 3                 # online attempts per checkpoint, transient errors only
BACKOFF_S = 2.0              # then 2x per further attempt
PROBE_TIMEOUT_S = 5.0
# Bounded waits for the online child unless the user set their own.
CHILD_TIMEOUTS = {"HF_HUB_ETAG_TIMEOUT": "10", "HF_HUB_DOWNLOAD_TIMEOUT": "30"}
DEFAULT_ENDPOINT = "https://huggingface.co"
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@dataclass
class Row:
    source: sources.Source
    size: int
    seconds: float


def build_parser() -> cli.Parser:
    p = cli.parser(SESSION, "Fill the HF cache with every pinned checkpoint and build the fixtures.",
                   model_source=True, pytest=False)
    p.add_argument("--suites", nargs="+", metavar="SUITE", default=None,
                   help="only the checkpoints these suites need (default: all)")
    return p


def step(ctx: lifecycle.Context) -> int:
    from specgate.vllmside import fixtures

    ctx.expects_tests = bool(ctx.manifest.checkpoints_for(ctx.args.suites))  # e.g. not for --suites gate
    warmed = [fixtures.fixture_dir(ctx.manifest, name) for name in ctx.manifest.fixtures]
    with cachestore.lease(*warmed):      # in use from here: the prune must not take what this job rebuilds next
        if ctx.manifest.cache is not None:   # the job's first session keeps the agent's caches in bounds
            ctx.record["pruned"] = caches.prune_at_job_start(ctx.manifest.cache)
        return run(ctx.manifest, ctx.args.suites, ctx.args.model_source, ctx.record)


def known_suites(manifest: Manifest) -> set[str]:
    return set(manifest.sessions) | {s for c in manifest.checkpoints.values() for s in c.suites}


def run(manifest: Manifest, suites: list[str] | None, mode: str, record: dict, *,
        cache_dir: Path | str | None = None, backoff_s: float = BACKOFF_S) -> int:
    """Warm every checkpoint the suites need; fill the summary record; return the exit code."""
    unknown = sorted(set(suites or ()) - known_suites(manifest))
    if unknown:
        raise cli.BadInput(f"unknown suite {', '.join(unknown)} (known: {', '.join(sorted(known_suites(manifest)))})")
    from specgate.vllmside import fixtures

    fixture_paths = fixtures.ensure_all(manifest, full=True)   # where full hashing belongs: once per job
    hub = Hub(sources.hub_cache(cache_dir), backoff_s, envpin.online_env(manifest))
    rows = [warm_one(manifest, ckpt, mode, hub) for ckpt in manifest.checkpoints_for(suites)]
    code = exitcodes.INCOMPLETE if any(r.source.status == "missing" for r in rows) else exitcodes.OK
    report(manifest, mode, suites, rows, fixture_paths, record)
    return code


def warm_one(manifest: Manifest, ckpt: Checkpoint, mode: str, hub: Hub) -> Row:
    started = time.monotonic()
    if mode == "fixture":
        source = sources.resolve(manifest, ckpt.repo_id, "fixture")
    else:
        snap = sources.snapshot(ckpt.repo_id, ckpt.revision, hub.cache)
        damaged = discard_damaged(ckpt, hub.cache)
        source, size = (sources.hub_source(ckpt, snap), snap.size) if snap.path and not damaged else hub.fetch(ckpt)
        if damaged and source.status == "missing":   # no fallback: the job had this checkpoint, say so
            source = replace(source, reason=f"{hubcheck.CORRUPT}: {ckpt.repo_id}@{ckpt.revision[:12]}: {damaged} "
                                            f"(removed, so no job reads it); {source.reason}")
        elif source.status == "missing" and mode == "auto":
            source = sources.fixture_source(manifest, ckpt, f"{source.reason}; using fixture {ckpt.fixture}")
    if source.source == "fixture":
        assert source.path is not None  # a fixture source always names its folder
        size = tree_size(Path(source.path))
    return Row(source, size, round(time.monotonic() - started, 2))


def discard_damaged(ckpt: Checkpoint, cache: Path) -> str:
    """What is wrong with the checkpoint's cached files whose bytes are not the hub's
    (specgate.vllmside.hubcheck; "" when nothing is), removed so the fetch that follows downloads them again."""
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        damaged = hubcheck.damaged(ckpt.repo_id, ckpt.revision, cache)
    except CachedRepoTreeNotFoundError:
        return ""
    if not damaged:
        return ""
    what = "; ".join(f"{name}: {why}" for name, why in damaged.items())
    print(f"{hubcheck.CORRUPT}: {ckpt.repo_id}@{ckpt.revision[:12]}: {what}; removing and fetching again", flush=True)
    hubcheck.discard(ckpt.repo_id, ckpt.revision, damaged, cache)
    return what


class Hub:
    """Online access to the hub for one run: a reachability probe done at most once,
    and downloads in a child process under a per-checkpoint file lock."""

    def __init__(self, cache: Path, backoff_s: float, online_env: dict[str, str]) -> None:
        self.cache, self.backoff_s, self.online_env = cache, backoff_s, online_env
        self._probed = False
        self._unreachable: str | None = None

    def fetch(self, ckpt: Checkpoint) -> tuple[sources.Source, int]:
        """The checkpoint's source after an online attempt, and its listed size."""
        folder = sources.repo_folder(ckpt.repo_id, self.cache).name
        lock = FileLock(self.cache / ".locks" / "specgate" / f"{folder}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"{ckpt.repo_id}: another warm_cache is fetching it; waiting", flush=True)
            lock.acquire()
        try:
            snap = sources.snapshot(ckpt.repo_id, ckpt.revision, self.cache)
            if snap.path is not None:  # completed by the run we waited for
                return sources.hub_source(ckpt, snap), snap.size
            reason = _unpinned(ckpt) or _needs_token(ckpt) or self.unreachable() or self._download(ckpt)
            if not reason:
                snap = sources.snapshot(ckpt.repo_id, ckpt.revision, self.cache)
                reason = snap.reason and f"download finished but the snapshot is incomplete: {snap.reason}"
            return sources.hub_source(ckpt, replace(snap, reason=reason), status="downloaded"), snap.size
        finally:
            lock.release()

    def unreachable(self) -> str | None:
        """Why the hub cannot be reached (None if it can), probed once per run so an
        unreachable hub costs seconds, not huggingface_hub's per-request retries."""
        if not self._probed:
            self._probed = True
            self._unreachable = probe(os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT), self.backoff_s)
        return self._unreachable

    def _download(self, ckpt: Checkpoint) -> str:
        """Fetch the snapshot; return "" on success or why it failed."""
        attempt = 0
        while True:
            attempt += 1
            print(f"{ckpt.repo_id}@{ckpt.revision[:12]}: downloading (attempt {attempt}/{ATTEMPTS})", flush=True)
            code, error = fetch_in_child(ckpt.repo_id, ckpt.revision, self.cache, self.online_env)
            if code == 0:
                return ""
            from specgate.ciside import classify

            label, reason = classify.explain(error, offline=False)  # its reason names the label
            if label == "auth":
                return f"{reason}; {_licence_hint(ckpt)}"
            if label != "transient" or attempt == ATTEMPTS:
                return reason + (f" (after {attempt} attempts)" if attempt > 1 else "")
            wait = self.backoff_s * 2 ** (attempt - 1)
            print(f"{ckpt.repo_id}: {reason}; retrying in {wait:g}s", flush=True)
            time.sleep(wait)


def _needs_token(ckpt: Checkpoint) -> str | None:
    """A gated checkpoint with no token anywhere huggingface_hub looks: no point asking."""
    from huggingface_hub import get_token

    if ckpt.gated and not get_token():
        return f"auth: {ckpt.repo_id} is gated and no HF token is set; {_licence_hint(ckpt)}"
    return None


def _licence_hint(ckpt: Checkpoint) -> str:
    return f"set HF_TOKEN and accept the licence at https://huggingface.co/{ckpt.repo_id}"


def probe(endpoint: str, backoff_s: float) -> str | None:
    """Open (and close) one TCP connection to the hub endpoint, retrying a bounded
    number of times. Skipped behind a proxy, where only the download can tell."""
    if any(os.environ.get(v) for v in PROXY_VARS):
        return None
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    error: OSError | None = None
    for attempt in range(ATTEMPTS):
        try:
            socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S).close()
            return None
        except OSError as exc:
            error = exc
            if attempt + 1 < ATTEMPTS:
                time.sleep(backoff_s * 2 ** attempt / 4)
    return f"hub unreachable: {endpoint} ({error.__class__.__name__}: {error}) after {ATTEMPTS} attempts"


def _unpinned(ckpt: Checkpoint) -> str | None:
    """Only pinned revisions are fetched: a moving branch would make two runs test two models."""
    if ckpt.pinned:
        return None
    return f"failure: {ckpt.repo_id} has no pinned revision in the manifest ({ckpt.unpinned_reason})"


def fetch_in_child(repo_id: str, revision: str, cache: Path, online_env: dict[str, str]) -> tuple[int, str]:
    """Run snapshot_download online in a child; progress goes to our stderr.
    Returns (exit code, error text)."""
    env = dict(os.environ)
    env.update(online_env)  # the one deliberate online step; the session itself stays offline
    for name, value in CHILD_TIMEOUTS.items():
        env.setdefault(name, value)
    proc = subprocess.run(
        [sys.executable, "-c", "from specgate.sessions.warm.session import child_main; child_main()",
         repo_id, revision, str(cache)],
        env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, errors="replace",
        preexec_fn=processes.die_with_parent,  # a killed warm_cache leaves no download running
    )
    return proc.returncode, proc.stdout.strip() or f"the fetch process exited with code {proc.returncode}"


def child_main() -> None:
    repo_id, revision, cache = sys.argv[1:4]
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, revision=revision, cache_dir=cache)
    except Exception as exc:  # the text is classified by the parent
        print(f"{type(exc).__name__}: {exc}", flush=True)
        raise SystemExit(1) from None


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def report(manifest: Manifest, mode: str, suites: list[str] | None, rows: list[Row],
           fixture_paths: dict[str, Path], record: dict) -> None:
    table = artifacts.format_rows(
        ["checkpoint", "revision", "size", "status", "seconds"],
        [[r.source.repo_id, r.source.revision[:12], human_size(r.size) if r.size else "",
          r.source.status, f"{r.seconds:.2f}"] for r in rows])
    print(f"== {SESSION}: model source {mode} ==\n{table}", flush=True)
    for r in rows:
        if r.source.reason and mode != "fixture":
            print(f"{r.source.status}: {r.source.repo_id}: {r.source.reason}", flush=True)
    record.update({
        "model_mode": mode,
        "suites": suites or sorted(known_suites(manifest)),
        "checkpoints": [{**asdict(r.source), "size_bytes": r.size, "seconds": r.seconds} for r in rows],
        "fixtures": {name: str(path) for name, path in fixture_paths.items()},
        "tests": [test_entry(r) for r in rows],
    })
    artifacts.write_junit(SESSION, [
        (f"{r.source.repo_id}@{r.source.revision[:12]}", r.source.reason if r.source.status == "missing" else None,
         r.seconds) for r in rows])


def test_entry(row: Row) -> dict:
    """A checkpoint as the summary's test entry: present passes, missing fails with the
    classifier's label (the reasons start with it) as its cause."""
    from specgate.ciside.classify import LABELS

    missing = row.source.status == "missing"
    label = row.source.reason.split(":", 1)[0] if missing else None
    return {"nodeid": f"{row.source.repo_id}@{row.source.revision[:12]}", "outcome": "failed" if missing else "passed",
            "cause": (label if label in (*LABELS, hubcheck.CORRUPT) else "cache-miss") if missing else None,
            "reason": row.source.reason or None, "time_s": row.seconds}

