"""Say why a CI run failed, from its log alone (stdlib only: the CI wrapper imports
this from a bare host before any venv exists).

Labels, most severe first (``LABELS`` is in this precedence order):

- ``failure``: a retry cannot help: an assertion, a crash, a timeout, a missing local
  path, an unknown repository (404), a malformed config, any error not recognised.
- ``auth``: 401/403, a gated repository, a bad or missing token.
- ``env-blocked``: the machine lacks a piece: the Triton CPU backend, a working
  torchvision (or torchaudio/torchcodec), CUDA, disk space.
- ``transient``: hub or network trouble while online: connection errors, read
  timeouts, HTTP 408, 429 and 5xx.
- ``cache-miss``: a file is missing from the local Hugging Face cache while offline;
  rerunning online fills it.

How a log is read:

1. ANSI colours, Buildkite timestamps and vLLM's ``(EngineCore pid=N) ERROR date
   [file:line]`` prefixes are removed; ``Exception ignored in ...`` blocks (harmless
   ``__del__`` noise such as CPUDNNLGEMMHandler's FakeTensor assertion) are dropped.
2. A pytest log is split into one unit per failed test (the FAILURES/ERRORS blocks,
   else the ``FAILED``/``ERROR`` summary lines); any other text is one unit. Crash
   and timeout markers outside the test blocks form a unit of their own.
3. Every line of a unit is matched against the rules below (first rule wins per
   line). Findings are strong or weak: weak ones (a wrapper message such as
   transformers' "couldn't connect" or vLLM's "Invalid repository ID" whose chained
   cause, when printed, is more precise) count only when no strong finding exists.
   The last exception of a traceback that no rule knows is a strong ``failure``.
   A unit with no finding at all is a ``failure``.
4. The run's label is the most severe unit label, so one unexplained or failing test
   makes the whole run a ``failure`` even if other tests only missed the cache.

Offline or online: the unit's own text decides first (OfflineModeIsEnabled,
"offline mode is enabled", "outgoing traffic has been disabled", HF_HUB_OFFLINE=1/0),
then the whole log, then the caller's hint; without evidence the run counts as online,
so an unexplained LocalEntryNotFoundError is ``transient``, not ``cache-miss``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

LABELS = ("failure", "auth", "env-blocked", "transient", "cache-miss")
_RANK = {label: index for index, label in enumerate(LABELS)}
_REASON_MAX = 200


@dataclass(frozen=True)
class Finding:
    label: str
    reason: str
    weak: bool = False
    order: int = 0  # index of the rule that found it: earlier rules are more specific


_NEUTRAL = Finding("neutral", "")

# --- text clean-up ----------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# Applied in order to the whole text, line by line (re.M): each strips one prefix per line.
_PREFIXES = (
    re.compile(r"^\[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?Z?\]?[^\S\n]?", re.M),  # Buildkite/CI timestamps
    re.compile(r"^\([\w\-]+ pid=\d+\)[^\S\n]?", re.M),  # vLLM child process prefix
    re.compile(r"^(?:ERROR|CRITICAL)[^\S\n]+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?[^\S\n]+\[[^\]\n]*\][^\S\n]?",
               re.M),  # vLLM logger.exception
    re.compile(r"^E(?: +|$)", re.M),  # pytest's exception lines
)
_TRAILING_SPACE = re.compile(r"[^\S\n]+$", re.M)
# vLLM's INFO and DEBUG records (behind the first two prefixes, if any) report progress,
# never a failure. A long engine log is mostly these (400,000 lines in 35 MB), so they
# go first, in one pass, and every later pass reads what is left.
_VLLM_PROGRESS = re.compile(
    "^" + "".join(f"(?:{p.pattern[1:]})?" for p in _PREFIXES[:2])
    + r"(?:INFO|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]\n]*\].*\n?", re.M)
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*?(?:Error|Exception|Exit|Interrupt|Enabled|Failure))(?::\s|:?$)"
)
_CHAIN = re.compile(r"^(?:The above exception was the direct cause|During handling of the above exception)")
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\)")
_SOURCE = "\x00"  # marks a line of source code quoted in a traceback
_FRAME = re.compile(r"^(\s*)File \".*\", line \d+")
_OUTCOME_LINE = re.compile(r"^(?:SKIPPED|XFAIL|XPASS|PASSED)\b|::\S+ (?:SKIPPED|XFAIL|XPASS|PASSED)\b")

# --- pytest structure ---------------------------------------------------------------
_SECTION = re.compile(r"^={3,} (.+?) ={3,}$")
_BLOCK = re.compile(r"^_{3,} (.+?) _{3,}$")
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+\.py(?:::\S+)?)(?: - (.*))?$")
_OUTSIDE = re.compile(
    r"Segmentation fault|core dumped|Fatal Python error|^\+{3,} Timeout \+{3,}$"
    r"|exited with (?:status|code) 124\b|^Killed$"
)

# --- evidence ------------------------------------------------------------------------
_OFFLINE_EVIDENCE = re.compile(
    r"(HF_HUB_OFFLINE['\"]?\s*[=:]?\s*['\"]?(?:1|true|yes|on)\b|OfflineModeIsEnabled|offline mode is enabled"
    r"|outgoing traffic (?:has been|is) disabled|local_files_only=True' as been set)"
    # The lookbehind skips hf's advice "set 'HF_HUB_OFFLINE=0'".
    r"|((?<!set ')HF_HUB_OFFLINE['\"]?\s*[=:]?\s*['\"]?(?:0|false|no|off)\b)",
    re.IGNORECASE,
)
_REPO_PATTERNS = (
    re.compile(r"models--([\w.\-]+?)--([\w.\-]+)"),
    re.compile(r"/(?:api/models/)?([\w.\-]+)/([\w.\-]+)/(?:resolve|revision|tree)/"),
    re.compile(r"repo_id: ([\w.\-]+)/([\w.\-]+),"),
    re.compile(r"snapshot for '([\w.\-]+)/([\w.\-]+)'"),
    re.compile(r"specified: '([\w.\-]+)/([\w.\-]+)'"),
    re.compile(r"weights with [`']([\w.\-]+)/([\w.\-]+)[`']"),
    re.compile(r"(?:Access to model|trying to load) ([\w.\-]+)/([\w.\-]+)"),
    re.compile(r"\bmodel'?\s*[=:]\s*['\"]([\w.\-]+)/([\w.\-]+)['\"]"),
)
_QUOTED_HUB_ID = re.compile(r"""['"]([A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*)['"]""")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*")
_HF_CACHE_PATH = re.compile(r"(?:^|/)models--[^/\s]+--[^/\s]+/snapshots/")
_TRITON_LAUNCH = re.compile(r"\w_kernel\[grid\]|Disabling Triton")
_LOOPBACK = re.compile(r"localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0")


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _REASON_MAX else text[: _REASON_MAX - 3] + "..."


def _clean(text: str) -> list[str]:
    # Whole-text substitutions, not a loop over lines: a 35 MB log has 400,000 lines.
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_SPACE.sub("", _VLLM_PROGRESS.sub("", text))
    for prefix in _PREFIXES:
        text = prefix.sub("", text)
    return _drop_ignored(_mark_source(text.split("\n")))


def _mark_source(lines: list[str]) -> list[str]:
    """Mark source code quoted in tracebacks: the lines (and ^^^ markers) under each
    `File "...", line N` frame, and pytest's indented or `>` lines. Code that mentions
    an error is not that error, but it may name the repository a reason should mention."""
    marked, frame_indent = [], None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if (frame_indent is not None and line.strip() and indent > frame_indent) or line.startswith((">", "    ")):
            marked.append(_SOURCE + line)
            continue
        frame = _FRAME.match(line)
        frame_indent = len(frame.group(1)) if frame else None
        marked.append(line)
    return marked


def _drop_ignored(lines: list[str]) -> list[str]:
    """Remove 'Exception ignored in ...' blocks: Python reports and survives them."""
    kept, skipping = [], 0
    for line in lines:
        if line.startswith("Exception ignored in"):
            skipping = 80
            continue
        if skipping:
            skipping -= 1
            if _EXCEPTION_LINE.match(line):
                skipping = 0
            continue
        kept.append(line)
    return kept


def _offline(lines: list[str]) -> bool | None:
    """True/False from the last offline or online marker in the lines, None without one."""
    verdict = None
    for line in lines:
        low = line.lower()
        mentions = "offline" in low or "traffic" in low or "local_files_only" in low
        if line.startswith(_SOURCE) or not mentions:
            continue
        for match in _OFFLINE_EVIDENCE.finditer(line):
            verdict = match.group(1) is not None
    return verdict


def _repo(lines: list[str]) -> str | None:
    """The hub repository a unit is about: from error messages, else a quoted
    owner/name in the quoted source (e.g. `LLM(model="Qwen/Qwen3-0.6B")`)."""
    for pattern in _REPO_PATTERNS:
        for line in lines:
            if not line.startswith(_SOURCE) and (match := pattern.search(line)):
                return f"{match.group(1)}/{match.group(2)}"
    for line in lines:
        if line.startswith(_SOURCE) and (match := _QUOTED_HUB_ID.search(line)):
            return match.group(1)
    return None


def _is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.fullmatch(value))


# --- rules -------------------------------------------------------------------------------
@dataclass
class _Context:
    lines: list[str]
    offline: bool | None  # None: no evidence either way
    raw: str  # the whole log as given, source lines included

    @cached_property
    def repo(self) -> str:
        return _repo(self.lines) or "a checkpoint"


Rule = tuple[re.Pattern, Callable[[re.Match, _Context, str], "Finding | None"]]


def _fixed(label: str, reason: str, weak: bool = False):
    return lambda m, ctx, line: Finding(label, reason.format(m=m, repo=ctx.repo, line=_clip(line)), weak)


def _cache_miss(m, ctx, line) -> Finding:
    return Finding("cache-miss", f"cache miss: {ctx.repo} not in the local HF cache (offline)")


def _local_entry(m, ctx, line) -> Finding:
    """LocalEntryNotFoundError or transformers' "couldn't connect": the cause decides."""
    if ctx.offline:
        return Finding("cache-miss", f"cache miss: {ctx.repo} not in the local HF cache (offline)", weak=True)
    return Finding("transient", f"transient: the hub could not be reached for {ctx.repo} (online)", weak=True)


def _invalid_repo(m, ctx, line) -> Finding:
    value = m.group(1)
    if _HF_CACHE_PATH.search(value) or (_is_hub_id(value) and ctx.offline is not False):
        repo = _repo([value]) or value
        return Finding("cache-miss", f"cache miss: {repo} not in the local HF cache (offline)", weak=True)
    if _is_hub_id(value):
        return Finding("failure", f"failure: hub id {value} could not be resolved online", weak=True)
    return Finding("failure", f"failure: local path {value} is missing or has no config.json")


def _no_weights(m, ctx, line) -> Finding:
    value = m.group(1)
    if _HF_CACHE_PATH.search(value) or (_is_hub_id(value) and ctx.offline):
        repo = _repo([value]) or value
        return Finding("cache-miss", f"cache miss: {repo} weights not in the local HF cache (offline)")
    if _is_hub_id(value):
        return Finding("failure", f"failure: repository {value} has no weight files")
    return Finding("failure", f"failure: local path {value} has no weight files")


def _repo_not_found(m, ctx, line) -> Finding:
    if m.group(1) == "401":
        return Finding("auth", f"auth: HTTP 401 for {ctx.repo} (private repository or missing/invalid HF_TOKEN)")
    return Finding("failure", f"failure: repository {ctx.repo} not found on the hub ({m.group(1) or '404'})")


def _connection(m, ctx, line) -> Finding:
    if _LOOPBACK.search(line):
        return Finding("failure", f"failure: a local server refused or dropped the connection: {_clip(line)}")
    return Finding("transient", f"transient: network error reaching the hub ({_clip(m.group(0))})")


def _grid_launch(m, ctx, line) -> Finding | None:
    """The Triton placeholder returns plain functions, so `kernel[grid](...)` fails."""
    if _TRITON_LAUNCH.search(ctx.raw):
        return Finding("env-blocked", "env-blocked: Triton CPU backend missing (a Triton kernel was launched)")
    return None


def _unknown_value_error(m, ctx, line) -> Finding:
    return Finding("failure", f"failure: invalid configuration: {_clip(m.group(1))}")


_RULES: list[Rule] = [
    # The server under test (not the hub) answered an error status.
    (re.compile(r"^(?:openai\.)?\w+Error: Error code: (\d{3})"),
     _fixed("failure", "failure: the server under test answered HTTP {m[1]} ({line})")),
    # Wrappers whose root cause is printed elsewhere in the same unit.
    (re.compile(r"Engine core initialization failed|EngineCore encountered an issue|WorkerProc initialization failed"
                r"|Frontend process failed during engine core|\d+ validation errors? for \w+"
                r"|Could not detect config format for no config file found|Engine core process \S+ died unexpectedly"
                r"|There was a specific connection error when trying to load"
                r"|^(?:[\w.]+\.)?HfHubHTTPError: \(Request ID"), lambda m, ctx, line: _NEUTRAL),
    # Offline cache misses stated by huggingface_hub itself.
    (re.compile(r"OfflineModeIsEnabled|offline mode is enabled|outgoing traffic (?:has been|is) disabled"
                r"|local_files_only=True' as been set", re.IGNORECASE), _cache_miss),
    # Environment gaps.
    (re.compile(r"operator torchvision::nms does not exist"),
     _fixed("env-blocked", "env-blocked: torchvision is not importable (operator torchvision::nms does not exist)")),
    (re.compile(r"No module named '(torchvision|torchaudio|torchcodec)[\w.]*'"),
     _fixed("env-blocked", "env-blocked: {m[1]} is not importable (No module named '{m[1]}')")),
    (re.compile(r"requires the (Torchvision|Torchaudio) library but it was not found"),
     _fixed("env-blocked", "env-blocked: {m[1]} is not importable (transformers requires it)")),
    (re.compile(r"requires Triton\.(?:\s|$)|module 'triton(?:\.language)?' has no attribute|No module named 'triton"
                r"|0 active drivers \(\[\]\)\. There should only be one"
                r"|Triton CPU backend (?:is )?(?:missing|not available)"),
     _fixed("env-blocked", "env-blocked: Triton CPU backend missing ({line})")),
    (re.compile(r"'function' object is not subscriptable"), _grid_launch),
    (re.compile(r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available"
                r"|CUDA driver initialization failed|libcuda\.so[.\d]*: cannot open|Failed to infer device type"
                r"|CUDA is not available"),
     _fixed("env-blocked", "env-blocked: CUDA not available ({m[0]})")),
    (re.compile(r"No space left on device"), _fixed("env-blocked", "env-blocked: disk full (No space left on device)")),
    # Authentication and gated repositories.
    (re.compile(r"GatedRepoError|Cannot access gated repo|You are trying to access a gated repo"
                r"|Access to model \S+ is restricted"),
     _fixed("auth", "auth: {repo} is a gated repository and the token has no access")),
    (re.compile(r"RepositoryNotFoundError: (\d{3})?"), _repo_not_found),
    (re.compile(r"\b401 (?:Client Error|Unauthorized)|'401 Unauthorized'|HTTP(?: Error)? 401\b|Invalid user token"
                r"|Invalid credentials in Authorization header|LocalTokenNotFoundError"
                r"|Token is required \(`token=True`\)"),
     _fixed("auth", "auth: HTTP 401 for {repo} (missing or invalid HF_TOKEN)")),
    (re.compile(r"\b403 (?:Client Error|Forbidden)|'403 Forbidden'|HTTP(?: Error)? 403\b"),
     _fixed("auth", "auth: HTTP 403 for {repo} (token lacks permission)")),
    # Failures no retry can fix.
    (re.compile(r"RevisionNotFoundError|is not a valid git identifier"),
     _fixed("failure", "failure: pinned revision not found for {repo}")),
    (re.compile(r"(?:Remote)?EntryNotFoundError: 404|Entry Not Found for url"),
     _fixed("failure", "failure: a file of {repo} does not exist on the hub (404)")),
    (re.compile(r"\b404 Client Error"), _fixed("failure", "failure: repository {repo} not found on the hub (404)")),
    (re.compile(r"HFValidationError|Repo id must be in the form|Repo id must use alphanumeric"),
     _fixed("failure", "failure: model value is neither an existing local path nor a hub id ({line})")),
    (re.compile(r"^Failed: Timeout \(?>|^\+{3,} Timeout \+{3,}$"),
     _fixed("failure", "failure: test timed out (pytest-timeout)")),
    (re.compile(r"exited with (?:status|code) 124\b"), _fixed("failure", "failure: timed out (exit 124)")),
    (re.compile(r"Segmentation fault|core dumped|Fatal Python error: [A-Za-z ]+|SIGSEGV|SIGABRT"
                r"|died with exit code -(?:6|9|11)\b|^Killed$"),
     _fixed("failure", "failure: crashed ({m[0]})")),
    (re.compile(r"^(?:AssertionError\b.*|assert .*)$"), _fixed("failure", "failure: {line}")),
    (re.compile(r"^Failed: "), _fixed("failure", "failure: {line}")),
    # Hub or network trouble (before the generic LocalEntryNotFoundError wording).
    (re.compile(r"(?:Server error '|HTTP Error |HfHubHTTPError: |\b)(5\d\d)"
                r"(?: Server Error|' for url| thrown| Internal Server Error| Bad Gateway| Service Unavailable"
                r"| Gateway Time-?out)"),
     _fixed("transient", "transient: HTTP {m[1]} from the hub")),
    (re.compile(r"\b429\b[^\n]*Too Many Requests|Too Many Requests for url|429 Client Error|HTTP Error 429"
                r"|Rate limited\."),
     _fixed("transient", "transient: rate limited by the hub (HTTP 429)")),
    (re.compile(r"\b408 (?:Request Timeout|Client Error)|HTTP Error 408"),
     _fixed("transient", "transient: HTTP 408 from the hub")),
    (re.compile(r"Connect(?:ion)?Error|ConnectTimeout|ReadTimeout(?:Error)?|WriteTimeout|PoolTimeout|RemoteProtocolError"
                r"|ConnectionResetError|Connection reset by peer|Connection refused|NewConnectionError|MaxRetryError"
                r"|Max retries exceeded|Name or service not known|Temporary failure in name resolution"
                r"|Network is unreachable|No route to host|Server disconnected without sending a response"
                r"|IncompleteRead|ChunkedEncodingError|SSLError|SSLEOFError|The read operation timed out|Read timed out"
                r"|^(?:socket\.timeout|TimeoutError): timed out$"),
     _connection),
    # Wrappers whose verdict depends on the cause or on offline evidence.
    (re.compile(r"Invalid repository ID or local directory specified:\s*'([^']+)'"), _invalid_repo),
    (re.compile(r"Cannot find any model weights with [`']([^`']+)[`']"), _no_weights),
    (re.compile(r"LocalEntryNotFoundError|IncompleteSnapshotError|We couldn't connect to '[^']*' to load"
                r"|couldn't connect to '[^']*' to load this (?:file|model)"), _local_entry),
    (re.compile(r"is not a local folder and is not a valid model identifier"),
     _fixed("failure", "failure: {repo} is not a local folder nor a repository the hub knows", weak=True)),
    (re.compile(r"^\s*Value error, (.*)"), _unknown_value_error),
]


def _is_terminal(lines: list[str], index: int) -> bool:
    """An exception line ends its traceback unless a chain marker follows its message."""
    for line in lines[index + 1 : index + 60]:
        if line.startswith(_SOURCE):
            continue
        if _CHAIN.match(line):
            return False
        if _TRACEBACK.match(line) or _EXCEPTION_LINE.match(line) or _BLOCK.match(line) or _SECTION.match(line):
            return True
    return True


def _unit_findings(lines: list[str], offline: bool | None, raw: str) -> list[Finding]:
    ctx = _Context(lines, offline, raw)
    findings = []
    for index, line in enumerate(lines):
        if not line.strip() or line.startswith(_SOURCE) or _OUTCOME_LINE.search(line):
            continue
        finding = None
        for order, (pattern, handler) in enumerate(_RULES):
            if (match := pattern.search(line)) and (finding := handler(match, ctx, line)) is not None:
                finding = replace(finding, order=order)
                break
        if finding is None and _EXCEPTION_LINE.match(line) and _is_terminal(lines, index):
            finding = Finding("failure", f"failure: {_clip(line)}", order=len(_RULES))
        if finding is not None and finding.label != _NEUTRAL.label:
            findings.append(finding)
    return findings


def _decide(findings: list[Finding]) -> Finding:
    pool = [f for f in findings if not f.weak] or findings
    if not pool:
        return Finding("failure", "failure: no recognised problem in the log")
    return min(pool, key=lambda f: (_RANK[f.label], f.order))


def _units(lines: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(name, lines) per failed test of a pytest log, and the lines outside them.
    A log without pytest structure is one unit named ''."""
    blocks: list[tuple[str, list[str]]] = []
    summaries: list[tuple[str, list[str]]] = []
    outside: list[str] = []
    in_failures = False
    current: list[str] | None = None
    for line in lines:
        if section := _SECTION.match(line):
            in_failures = section.group(1) in ("FAILURES", "ERRORS")
            current = None
            outside.append(line)
        elif in_failures and (block := _BLOCK.match(line)):
            current = []
            blocks.append((block.group(1), current))
        elif current is not None:
            current.append(line)
        else:
            outside.append(line)
            if summary := _SUMMARY.match(line):
                summaries.append((summary.group(2), [summary.group(3) or ""]))
    if not blocks and not summaries:
        return [("", lines)], []
    units = list(blocks)
    for nodeid, body in summaries:
        test = nodeid.rsplit("::", 1)[-1]
        if not any(test in title for title, _ in blocks):
            units.append((nodeid, body))
    return units, outside


def _analyse(text: str, offline: bool | None) -> tuple[Finding, Counter]:
    lines = _clean(text)
    global_offline = _offline(lines)
    units, outside = _units(lines)
    crash = [line for line in outside if _OUTSIDE.search(line)]
    if crash:
        units.append(("outside the test blocks", crash))
    verdicts = []
    for name, body in units:
        evidence = _offline(body)
        if evidence is None:
            evidence = global_offline if global_offline is not None else offline
        verdict = _decide(_unit_findings(body, evidence, text))
        if name and len(units) > 1:
            verdict = Finding(verdict.label, f"{verdict.reason} [{name}]")
        verdicts.append(verdict)
    return min(verdicts, key=lambda f: _RANK[f.label]), Counter(v.label for v in verdicts)


def explain(text: str, *, offline: bool | None = None) -> tuple[str, str]:
    """(label, one-line reason) for a log, a pytest run or a single test's traceback.

    ``offline`` is the caller's knowledge of HF_HUB_OFFLINE, used only when the text
    itself shows no offline or online evidence."""
    verdict, counts = _analyse(text, offline)
    reason = verdict.reason
    if len(counts) > 1:
        mix = ", ".join(f"{counts[label]} {label}" for label in LABELS if counts[label])
        reason = f"{reason} (mixed run: {mix})"
    return verdict.label, " ".join(reason.split())


def classify(text: str, *, offline: bool | None = None) -> str:
    """The label for the run as a whole (one of LABELS)."""
    return explain(text, offline=offline)[0]
