"""`nox -s cpu_e2e`: engine-level speculative-decoding tests in torch.compile mode.

1. Every checkpoint of the [[e2e.configs]] in this shard is resolved under the
   model-source mode (specgate.sources: the pinned hub snapshot, else its fixture);
   known-answer fixtures are built. With --model-source hub a checkpoint that is not
   cached stops the session (exit 75) before any engine starts.
2. The plan (plan.json) tells the tests in tests/e2e what to run; pytest -m e2e runs
   them with JUnit XML, and each test appends what it measured to records.jsonl.
3. summary.json merges both: one test entry per test with what it measured, plus one
   row per engine start with its time.

Exit codes: 0 passed (every skip names its reason), 1 a failure, 2 bad input,
75 --model-source hub and a required checkpoint is missing.

The rest of this module is the logic the engine tests share and that needs no
engine: the plan, the output comparisons, per-position acceptance and the merge.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specgate import artifacts, cli, envpin, exitcodes, lifecycle, pytestrun
from specgate.manifest import REPO_ROOT, SPEC_METHODS, E2EConfig, Manifest, ManifestError, _Reader

SESSION = "cpu_e2e"
PLAN_VAR = "SPECGATE_E2E_PLAN"
RECORDS_VAR = "SPECGATE_E2E_RECORDS"
TESTS_DIR = "tests/e2e"
UPSTREAM_FILE = "tests/v1/e2e/test_cpu_spec_decode.py"
DRAFT_MODEL_METHODS = ("eagle3", "dflash", "mtp")
# What each test entry carries beside the common nodeid/outcome/cause/reason/time_s.
MEASURED_FIELDS = ("method", "model_source", "target", "draft", "revision", "runner", "drafts", "drafted_tokens",
                   "accepted_tokens", "acceptance_len", "threshold", "matches_baseline")


# --------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class Settings:
    """[e2e] plain keys: engine bounds and the prompts every engine of a kind generates."""
    dtype: str
    compile_backend: str           # the backend every engine must compile with (no enforce_eager)
    max_model_len: int
    max_num_seqs: int
    max_tokens: int
    num_logprobs: int
    in_process_engine: bool
    engine_timeout_s: int
    prompts: tuple[str, ...]
    known_answer_prompts: tuple[tuple[int, ...], ...]
    known_answer_max_tokens: int

    @classmethod
    def parse(cls, manifest: Manifest) -> Settings:
        r = _Reader(manifest.path, dict(manifest.e2e_settings), "e2e.")

        def positive(key: str) -> int:
            value = r.get(key, int, "a positive integer")
            if value <= 0:
                raise r.fail(key, "a positive integer", value)
            return value

        known = r.get("known_answer_prompts", list, "a list of token-id lists")
        if not known or not all(isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p)
                                for p in known):
            raise r.fail("known_answer_prompts", "a non-empty list of non-empty token-id lists", known)
        prompts = r.str_list("prompts")
        if not prompts:
            raise r.fail("prompts", "a non-empty list of strings", [])
        return cls(
            dtype=r.str("dtype"),
            compile_backend=r.str("compile_backend"),
            max_model_len=positive("max_model_len"),
            max_num_seqs=positive("max_num_seqs"),
            max_tokens=positive("max_tokens"),
            num_logprobs=positive("num_logprobs"),
            in_process_engine=r.get("in_process_engine", bool, "true or false"),
            engine_timeout_s=positive("engine_timeout_s"),
            prompts=prompts,
            known_answer_prompts=tuple(tuple(p) for p in known),
            known_answer_max_tokens=positive("known_answer_max_tokens"),
        )

    def child_env(self) -> dict[str, str | None]:
        """What the engine settings add to an engine process's environment."""
        # Frontend, engine core and worker in the engine process: no further spawns
        # (each a fresh vLLM import) per engine start; the compiled graphs are the same.
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.in_process_engine else None}


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Model:
    """One checkpoint as this run loads it."""
    name: str              # hub repo id, or the fixture name for a fixture used directly
    source: str            # hub | fixture
    path: str | None       # the folder to load (None: missing)
    revision: str          # the hub commit, or the fixture's content hash
    fixture: str | None    # the fixture that stands in (or is used)
    status: str
    reason: str
    successor: bool        # a known-answer model: greedy continuation is (t + 1) mod V
    vocab_size: int | None
    architecture: str | None

    @property
    def ident(self) -> str:
        """What is loaded: the fixture and its hash, or the hub id and its commit."""
        return f"{self.fixture if self.source == 'fixture' else self.name}@{self.revision[:10]}"


@dataclass(frozen=True)
class Config:
    """One [[e2e.configs]] entry with its checkpoints resolved."""
    id: str
    method: str
    runner: str
    k: int
    floors: dict[str, float]
    target: Model
    draft: Model | None
    speculative: dict[str, Any]        # extra speculative_config keys (e.g. prompt_lookup_min)
    engine: dict[str, Any]             # extra LLM(...) keys (e.g. enable_prefix_caching)
    known_answer: dict[str, Any] | None  # {"target": Model, "draft": Model|None, "floor", "exact_drafts"}
    known_defect: dict[str, Any] | None  # {"raises", "symptom", "reason"}
    measured: dict[str, Any]

    @property
    def model_source(self) -> str:
        return "fixture" if "fixture" in (self.target.source, self.draft.source if self.draft else None) else "hub"

    @property
    def threshold(self) -> float | None:
        return self.floors.get(self.model_source)


def _folder_facts(path: str | None) -> tuple[int | None, str | None]:
    """(vocab_size, architecture) from a checkpoint folder's config.json."""
    config = Path(path or "") / "config.json"
    if not path or not config.is_file():
        return None, None
    data = json.loads(config.read_text(encoding="utf-8"))
    text = data.get("text_config") or {}
    return data.get("vocab_size") or text.get("vocab_size"), (data.get("architectures") or [None])[0]


def resolved_model(manifest: Manifest, repo_id: str, mode: str) -> Model:
    from specgate import fixtures, sources

    src = sources.resolve(manifest, repo_id, mode)
    vocab, arch = _folder_facts(src.path)
    if src.source == "fixture":
        facts = fixtures.describe(manifest, src.fixture)
        return Model(repo_id, "fixture", src.path, facts["hash"], src.fixture, src.status, src.reason,
                     bool(facts.get("successor")), vocab, arch)
    return Model(repo_id, "hub", src.path, src.revision, src.fixture, src.status, src.reason, False, vocab, arch)


def fixture_model(manifest: Manifest, name: str) -> Model:
    """A fixture used directly (the known-answer pairs), in every model-source mode."""
    from specgate import fixtures

    path = str(fixtures.ensure(manifest, name))
    facts = fixtures.describe(manifest, name)
    vocab, arch = _folder_facts(path)
    return Model(name, "fixture", path, facts["hash"], name, "fixture", "known-answer fixture",
                 bool(facts.get("successor")), vocab, arch)


def _known_answer(manifest: Manifest, config: E2EConfig) -> dict[str, Any] | None:
    raw = config.raw.get("known_answer")
    if raw is None:
        return None
    r = _Reader(manifest.path, raw, f"e2e.configs[{config.id}].known_answer.")
    target = r.str("target")
    draft = r.str("draft", default=None)
    for key, name in (("target", target), ("draft", draft)):
        if name is not None and name not in manifest.fixtures:
            raise r.fail(key, "a fixture declared under [fixtures]", name)
    floor = r.get("floor", (int, float), "a number >= 1.0", None)
    if floor is not None and floor < 1.0:
        raise r.fail("floor", "a number >= 1.0", floor)
    return {"target": target, "draft": draft, "floor": floor,
            "exact_drafts": r.get("exact_drafts", bool, "true or false", False),
            "note": r.str("note", default=None)}


def _known_defect(manifest: Manifest, config: E2EConfig) -> dict[str, Any] | None:
    raw = config.raw.get("known_defect")
    if raw is None:
        return None
    r = _Reader(manifest.path, raw, f"e2e.configs[{config.id}].known_defect.")
    return {"raises": r.str("raises"), "symptom": r.str("symptom"), "reason": r.str("reason")}


def _table(manifest: Manifest, config: E2EConfig, key: str) -> dict[str, Any]:
    value = config.raw.get(key, {})
    if not isinstance(value, dict):
        raise ManifestError(f"{manifest.path.name}: key 'e2e.configs[{config.id}].{key}': expected a table, got {value!r}")
    return dict(value)


def resolve_config(manifest: Manifest, config: E2EConfig, mode: str) -> Config:
    known = _known_answer(manifest, config)
    if known is not None:
        known["target"] = fixture_model(manifest, known["target"])
        known["draft"] = fixture_model(manifest, known["draft"]) if known["draft"] else None
    if config.method != "none" and config.num_speculative_tokens < 1:
        raise ManifestError(f"{manifest.path.name}: key 'e2e.configs[{config.id}].num_speculative_tokens': "
                            f"expected a positive integer for method {config.method}, got {config.num_speculative_tokens}")
    return Config(
        id=config.id, method=config.method, runner=config.runner, k=config.num_speculative_tokens,
        floors=dict(config.floors),
        target=resolved_model(manifest, config.target, mode),
        draft=resolved_model(manifest, config.draft, mode) if config.draft else None,
        speculative=_table(manifest, config, "speculative"),
        engine=_table(manifest, config, "engine"),
        known_answer=known,
        known_defect=_known_defect(manifest, config),
        measured=_table(manifest, config, "measured"),
    )


def missing_models(configs: Iterable[Config]) -> list[Model]:
    seen: dict[str, Model] = {}
    for c in configs:
        for m in (c.target, c.draft):
            if m is not None and m.path is None:
                seen[m.name] = m
    return list(seen.values())


def plan_dict(mode: str, settings: Settings, configs: list[Config], shard: tuple[int, int]) -> dict[str, Any]:
    return {"model_mode": mode, "shard": {"num_shards": shard[0], "shard_id": shard[1]},
            "settings": asdict(settings), "configs": [asdict(c) for c in configs]}


def _model(data: dict[str, Any] | None) -> Model | None:
    return Model(**data) if data else None


def config_from_dict(data: dict[str, Any]) -> Config:
    data = dict(data)
    data["target"], data["draft"] = _model(data["target"]), _model(data["draft"])
    if data["known_answer"]:
        data["known_answer"] = {**data["known_answer"], "target": _model(data["known_answer"]["target"]),
                                "draft": _model(data["known_answer"]["draft"])}
    return Config(**data)


def load_plan(path: str | Path) -> tuple[str, Settings, list[Config]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    settings = data["settings"]
    settings = Settings(**{**settings, "prompts": tuple(settings["prompts"]),
                           "known_answer_prompts": tuple(tuple(p) for p in settings["known_answer_prompts"])})
    return data["model_mode"], settings, [config_from_dict(c) for c in data["configs"]]


# --------------------------------------------------------------------------- engine runs

@dataclass(frozen=True)
class Run:
    """One engine: a target, a speculative configuration (method "none": none) and the
    prompt set its target calls for. Runs with equal keys share one engine start."""
    target: Model
    draft: Model | None
    method: str
    k: int
    speculative: tuple[tuple[str, Any], ...] = ()
    engine: tuple[tuple[str, Any], ...] = ()

    @property
    def known_answer(self) -> bool:
        return self.target.successor

    @property
    def key(self) -> str:
        parts = [self.target.ident, self.method]
        if self.method != "none":
            parts += [f"k={self.k}", *(f"{k}={v}" for k, v in self.speculative)]
        if self.draft:
            parts.insert(1, self.draft.ident)
        parts += [f"{k}={v}" for k, v in self.engine]
        return " ".join(parts)

    def baseline(self) -> Run:
        """The same target with no speculation (engine keys that speculation needs stay)."""
        return Run(self.target, None, "none", 0, (), self.engine)


def spec_run(config: Config) -> Run:
    return Run(config.target, config.draft, config.method, config.k,
               tuple(sorted(config.speculative.items())), tuple(sorted(config.engine.items())))


def known_answer_run(config: Config) -> Run:
    """The config's method on its known-answer fixtures; its engine extras belong to the
    hub target (e.g. a workaround) and stay out."""
    known = config.known_answer or {}
    return Run(known["target"], known["draft"], config.method, config.k, tuple(sorted(config.speculative.items())))


def runs_for(test: str, config: Config) -> list[Run]:
    """The engines a test of `config` reads (test: a SELECTORS key)."""
    if test in ("ngram", "v1_matches_baseline"):
        run = spec_run(config)
        return [run.baseline(), run]
    if test == "known_answer":
        run = known_answer_run(config)
        return [run.baseline(), run]
    if test in ("per_position", "one_token_prompt"):
        return [known_answer_run(config)]
    if test in ("v2_smoke", "known_defect"):
        return [spec_run(config)]
    raise KeyError(test)


def known_answer_baseline_run(configs: Iterable[Config], fixture: str) -> Run:
    target = next(c.known_answer["target"] for c in configs
                  if c.known_answer and c.known_answer["target"].name == fixture)
    return Run(target, None, "none", 0)


def process_order(runs: Iterable[Run], expected_to_fail: set[str] = frozenset()) -> list[Run]:
    """The order engines run in: baselines, then speculation, ngram after those (an ngram
    engine loads numba, after which vLLM 0.32 CPU cannot start another engine in that
    process: see specgate.engine), engines expected to fail at the very end; by key within."""
    unique = {r.key: r for r in runs}
    return sorted(unique.values(), key=lambda r: (r.key in expected_to_fail, r.method == "ngram",
                                                  r.method != "none", r.key))


def environment_block(run: Run) -> str | None:
    """Why this machine cannot load the run's checkpoints (a model class vLLM cannot
    import here, e.g. torchvision missing), or None. Imports vLLM."""
    from specgate import engine

    for model in (run.target, run.draft):
        if model is not None and model.architecture:
            error = engine.model_import_error(model.architecture)
            if error:
                return f"environment-blocked: {model.architecture} ({model.name}): {error}"
    return None


def speculative_config(run: Run) -> dict[str, Any] | None:
    if run.method == "none":
        return None
    spec: dict[str, Any] = {"method": run.method, "num_speculative_tokens": run.k, **dict(run.speculative)}
    if run.draft is not None:
        spec["model"] = run.draft.path
    return spec


def llm_kwargs(run: Run, settings: Settings) -> dict[str, Any]:
    """LLM(...) arguments. No enforce_eager: the engine compiles (CPU: inductor)."""
    kwargs: dict[str, Any] = {
        "model": run.target.path,
        "dtype": settings.dtype,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "seed": 0,
        "disable_log_stats": False,
        **dict(run.engine),
    }
    spec = speculative_config(run)
    if spec is not None:
        kwargs["speculative_config"] = spec
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    return kwargs


def prompts_for(run: Run, settings: Settings) -> tuple[list[Any], int]:
    """(prompts, max_tokens): token ids with a known answer for successor targets, text otherwise."""
    if run.known_answer:
        return [list(p) for p in settings.known_answer_prompts], settings.known_answer_max_tokens
    return list(settings.prompts), settings.max_tokens


# --------------------------------------------------------------------------- comparisons

def acceptance_len(drafts: int, accepted: int) -> float:
    """Mean acceptance length as vLLM's tests compute it: 1 + accepted / drafts (1 without drafts)."""
    return 1.0 if drafts <= 0 else 1.0 + accepted / drafts


def token_mismatches(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                     names: tuple[str, str] = ("expected", "got")) -> list[str]:
    """One line per request whose token ids differ: where, and what each side has there."""
    lines = []
    if len(expected) != len(got):
        return [f"{len(expected)} {names[0]} sequences vs {len(got)} {names[1]}"]
    for i, (a, b) in enumerate(zip(expected, got)):
        a, b = list(a), list(b)
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lines.append(f"request {i}: first difference at output position {at}: "
                     f"{names[0]} {a[at:at + 5]}, {names[1]} {b[at:at + 5]} (lengths {len(a)} vs {len(b)})")
    return lines


def logprobs_not_close(ref: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]],
                       got: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]],
                       names: tuple[str, str] = ("baseline", "spec")) -> list[str]:
    """vLLM's check_logprobs_close (tests/models/utils.py) with always_check_logprobs: at
    every sampled position each side's token must be among the other's top-k logprobs.
    Returns one line per request that breaks it (empty: close)."""
    lines = []
    for i, ((ids0, lps0), (ids1, lps1)) in enumerate(zip(ref, got)):
        for pos, (t0, t1) in enumerate(zip(ids0, ids1)):
            top0, top1 = lps0[pos] or {}, lps1[pos] or {}
            if t0 not in top1 or t1 not in top0:
                lines.append(f"request {i} position {pos}: {names[0]} token {t0} (top-k {sorted(top0)}), "
                             f"{names[1]} token {t1} (top-k {sorted(top1)})")
                break
    return lines


def max_logprob_gap(ref: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]],
                    got: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]]) -> float:
    """Largest |logprob difference| of the sampled token where both sides sampled the same one."""
    gap = 0.0
    for (ids0, lps0), (ids1, lps1) in zip(ref, got):
        for pos, (t0, t1) in enumerate(zip(ids0, ids1)):
            if t0 == t1 and lps0[pos] and lps1[pos] and t0 in lps0[pos] and t0 in lps1[pos]:
                gap = max(gap, abs(lps0[pos][t0] - lps1[pos][t0]))
    return gap


def successor_expected(prompts: Sequence[Sequence[int]], n: int, vocab: int) -> list[list[int]]:
    from specgate import fixtures

    return [fixtures.expected_successor(list(p), n, vocab) for p in prompts]


@dataclass
class PositionReport:
    """Per-position acceptance of one request from its per-step drafted/accepted counts."""
    drafted: list[int] = field(default_factory=list)     # drafts that reached position p
    accepted: list[int] = field(default_factory=list)    # of those, accepted at position p
    rejections: list[tuple[int, int]] = field(default_factory=list)  # (step, first rejected position)


def positions(per_step_drafted: Sequence[int], per_step_accepted: Sequence[int], k: int) -> PositionReport:
    """Acceptance is a prefix: a step that accepted a of d drafts accepted positions 0..a-1
    and rejected position a (when a < d)."""
    report = PositionReport([0] * k, [0] * k)
    for step, (d, a) in enumerate(zip(per_step_drafted, per_step_accepted)):
        for p in range(min(d, k)):
            report.drafted[p] += 1
            report.accepted[p] += p < a
        if a < d:
            report.rejections.append((step, a))
    return report


def first_step_fully_rejected(per_step_drafted: Sequence[int], per_step_accepted: Sequence[int]) -> bool:
    """The symptom of the 1-token-prompt defect: the first draft step accepted none of its drafts."""
    return bool(per_step_drafted) and per_step_drafted[0] > 0 and per_step_accepted[0] == 0


# --------------------------------------------------------------------------- records and the summary

class Recorder:
    """Appends one JSON object per line; the tests write, the session reads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def write(self, kind: str, **fields: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")
            handle.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_identity(run: Run) -> dict[str, Any]:
    """The summary fields that say what a test ran: method, sources, checkpoints, revisions."""
    sources = {run.target.source, run.draft.source if run.draft else run.target.source}
    return {
        "method": run.method,
        "model_source": "fixture" if "fixture" in sources else "hub",
        "target": run.target.name,
        "draft": run.draft.name if run.draft else None,
        "revision": run.target.revision if run.draft is None else f"{run.target.revision} + {run.draft.revision}",
    }


# Which configs each engine test covers, from the manifest entry alone (collection stays cheap).
def _known(c: E2EConfig) -> dict[str, Any]:
    value = c.raw.get("known_answer")
    return value if isinstance(value, dict) else {}


SELECTORS = {
    "ngram": lambda c: c.method == "ngram",
    "v2_smoke": lambda c: c.runner == "v2",
    "v1_matches_baseline": lambda c: (c.runner == "v1" and c.method in DRAFT_MODEL_METHODS
                                      and "known_defect" not in c.raw),
    "known_answer": lambda c: bool(_known(c)),
    "per_position": lambda c: bool(_known(c).get("exact_drafts")) and c.method in DRAFT_MODEL_METHODS,
    "one_token_prompt": lambda c: bool(_known(c).get("exact_drafts")) and c.method in ("eagle3", "mtp"),
    "known_defect": lambda c: "known_defect" in c.raw,
}


def select(configs: Iterable[E2EConfig], test: str) -> list[str]:
    """The config ids `test` runs for."""
    return [c.id for c in configs if SELECTORS[test](c)]


def known_answer_targets(configs: Iterable[E2EConfig]) -> list[str]:
    """Each distinct known-answer target fixture once (its baseline runs once)."""
    return sorted({_known(c)["target"] for c in configs if _known(c).get("target")})


def planned_ids(plan_path: str | None) -> list[str] | None:
    """The config ids a session's plan holds (None: no plan, all of the manifest's)."""
    if not plan_path:
        return None
    return [c["id"] for c in json.loads(Path(plan_path).read_text(encoding="utf-8"))["configs"]]


def merge_results(results: Sequence[pytestrun.TestResult], records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One test entry per JUnit test case, filled from what the test recorded (the last record
    wins per field); outcome, reason (skip or failure message) and time come from JUnit."""
    by_test: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.get("kind") == "test":
            by_test.setdefault(record["test"], {}).update({k: v for k, v in record.items() if k not in ("kind", "test")})
    rows = []
    for result in results:
        measured = {**dict.fromkeys(MEASURED_FIELDS), **by_test.get(result.nodeid, {})}
        outcome = _outcome(result, measured)
        rows.append(result.entry(cause=_cause(result, outcome), **measured) | {"outcome": outcome})
    return rows


def _cause(result: pytestrun.TestResult, outcome: str) -> str | None:
    """specgate.classify's label for a failure (failure, env-blocked, cache-miss, ...);
    env-blocked or skip for a skip; known-defect for an xfail; None for a pass."""
    from specgate import classify

    if outcome == "passed":
        return None
    if outcome == "xfailed":
        return "known-defect"
    label, _ = classify.explain(result.text or result.message)
    if outcome == "skipped":
        return label if label == "env-blocked" else "skip"
    return label


def _outcome(result: pytestrun.TestResult, row: dict[str, Any]) -> str:
    """passed / failed / error / skipped, and xfailed: a declared defect that showed its
    symptom (JUnit calls it skipped; the test recorded that it expected the failure)."""
    if result.outcome == "skipped" and row.get("expected_failure"):
        return "xfailed"
    return result.outcome


def engine_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "kind"} for r in records if r.get("kind") == "engine"]


def compile_backend(engines: Sequence[dict[str, Any]]) -> str | None:
    """The one backend every engine compiled with, or "mixed: a, b" (None: no engine started)."""
    backends = sorted({e["compilation"]["backend"] for e in engines if e.get("compilation")})
    if not backends:
        return None
    return backends[0] if len(backends) == 1 else "mixed: " + ", ".join(backends)


def session_exit_code(pytest_code: int, rows: Sequence[dict[str, Any]]) -> int:
    """pytest's code in the exit-code model; a failed or errored row fails whatever pytest said."""
    failed = any(r["outcome"] in ("failed", "error") for r in rows)
    return exitcodes.worst(exitcodes.from_pytest(pytest_code), exitcodes.FAILURE if failed else exitcodes.OK)


def format_report(rows: Sequence[dict[str, Any]], engines: Sequence[dict[str, Any]]) -> str:
    short = [[_short_test(r["nodeid"]), r["method"], r["model_source"], r["runner"], r["outcome"],
              r["drafts"], r["drafted_tokens"], r["accepted_tokens"], _fmt(r["acceptance_len"]), _fmt(r["threshold"]),
              r["matches_baseline"], r["time_s"]] for r in rows]
    lines = [artifacts.format_rows(["test", "method", "source", "runner", "outcome", "drafts", "drafted", "accepted",
                                    "accept_len", "floor", "=baseline", "time_s"], short)]
    reasons = [f"  {_short_test(r['nodeid'])}: {r['reason']}" for r in rows if r["outcome"] != "passed" and r["reason"]]
    if reasons:
        lines += ["", "reasons:", *reasons]
    if engines:
        lines += ["", "engine starts:", artifacts.format_rows(
            ["engine", "process", "runner", "compile", "import_s", "start_s", "generate_s", "shutdown_s", "error"],
            [[e["key"], e.get("process"), e.get("runner"), _compile(e), e.get("import_s"), e.get("init_s"),
              e.get("generate_s"), e.get("shutdown_s"), e.get("error")] for e in engines])]
        starts = [e["init_s"] for e in engines if e.get("init_s") is not None]
        if starts:
            lines.append(f"{len(starts)} engine starts: {sum(starts):.1f} s in all, "
                         f"{sum(starts) / len(starts):.1f} s each on average, {max(starts):.1f} s at most")
    return "\n".join(lines)


def _compile(engine: dict[str, Any]) -> str | None:
    c = engine.get("compilation")
    return f"{c['mode']}/{c['backend']}" if c else None


def _fmt(value: Any) -> Any:
    return f"{value:.3f}" if isinstance(value, float) else value


def _short_test(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


# --------------------------------------------------------------------------- upstream's own e2e file

def stand_in_hub_cache(manifest: Manifest, mode: str, dest: Path) -> dict[str, str]:
    """An HF hub cache for upstream's file: every cpu_e2e checkpoint that resolves to its
    fixture appears as a snapshot at its pinned revision (refs/main pointing at it) whose
    files link to the fixture's; one resolved to the hub links to its real cache folder.
    Returns hub id -> what stands behind it.

    VLLM_MODEL_REDIRECT_PATH cannot do this in vLLM 0.32: with HF_HUB_OFFLINE=1 EngineArgs
    swaps a hub id for its offline snapshot (arg_utils.py, get_model_path), and
    maybe_override_with_speculators reads the id's config from the hub, both before
    ModelConfig consults the redirect."""
    import shutil

    from specgate import sources

    shutil.rmtree(dest, ignore_errors=True)
    behind = {}
    for checkpoint in manifest.checkpoints_for([SESSION]):
        src = sources.resolve(manifest, checkpoint.repo_id, mode)
        folder = sources.repo_folder(checkpoint.repo_id, dest)
        if src.source == "hub":
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.symlink_to(sources.repo_folder(checkpoint.repo_id), target_is_directory=True)
            behind[checkpoint.repo_id] = f"hub cache {src.path}"
            continue
        snapshot = folder / "snapshots" / checkpoint.revision
        snapshot.mkdir(parents=True)
        for item in Path(src.path).iterdir():
            (snapshot / item.name).symlink_to(item)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(checkpoint.revision)
        behind[checkpoint.repo_id] = f"fixture {src.fixture} ({src.path})"
    return behind


def upstream_rows(results: Sequence[pytestrun.TestResult], behind: dict[str, str]) -> list[dict[str, Any]]:
    """Summary rows for upstream's tests: what JUnit says, the method from the test's name."""
    rows = merge_results(results, [])
    for row in rows:
        name = row["nodeid"].split("::")[-1]
        param = name[name.find("[") + 1:-1] if name.endswith("]") else ""
        row["method"] = "ngram" if "ngram" in name else (param if param in SPEC_METHODS else None)
        row["model_source"] = "fixture" if any(v.startswith("fixture") for v in behind.values()) else "hub"
        row["nodeid"] = f"upstream:{row['nodeid']}"
    return rows


def run_upstream(manifest: Manifest, mode: str, env: dict[str, str], out: Path,
                 pytest_args: list[str]) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    """Upstream's tests/v1/e2e/test_cpu_spec_decode.py from the upstream test tree, run
    offline over the stand-in hub cache (fixtures where the checkpoints resolve to them).
    Returns the session exit code this part earns, its rows and what the summary says."""
    from specgate import upstream

    try:
        root = upstream.tree(upstream.installed_version())
    except upstream.UpstreamError as exc:
        print(f"upstream e2e: {exc}", flush=True)
        return exc.exit_code, [], {"error": str(exc)}
    cache = out / "upstream-hub-cache"
    behind = stand_in_hub_cache(manifest, mode, cache)
    for repo_id, what in behind.items():
        print(f"upstream e2e: {repo_id} -> {what}", flush=True)
    junit = out / "junit-upstream.xml"
    junit.unlink(missing_ok=True)
    code = pytestrun.run_pytest(["-rA", "-p", "no:cacheprovider", UPSTREAM_FILE, *pytest_args], junit, cwd=root,
                                env={**env, "HF_HUB_CACHE": str(cache)}, log=out / "pytest-upstream.log")
    rows = upstream_rows(pytestrun.read_junit(junit) if junit.is_file() else [], behind)
    return session_exit_code(code, rows), rows, {"tree": str(root), "file": UPSTREAM_FILE, "hub_cache": str(cache),
                                                 "checkpoints": behind, "pytest_exit_code": code}


# --------------------------------------------------------------------------- the session

def build_parser():
    p = cli.parser(SESSION, "Engine-level spec-decode tests in torch.compile mode.", shards=True, model_source=True)
    p.add_argument("--upstream-e2e", action="store_true",
                   help="also run upstream's tests/v1/e2e/test_cpu_spec_decode.py from the upstream test tree, "
                        "its models redirected to their stand-ins where they resolve to fixtures")
    return p


def step(ctx: lifecycle.Context) -> int:
    args, manifest, record = ctx.args, ctx.manifest, ctx.record
    out = artifacts.artifacts_dir(SESSION)
    record.update({"model_mode": args.model_source, "configs": [], "compile_backend": None, "engines": []})
    try:
        settings = Settings.parse(manifest)
        chosen = cli.shard(list(manifest.e2e), args.num_shards, args.shard_id)
        configs = [resolve_config(manifest, c, args.model_source) for c in chosen]
    except ManifestError as exc:
        raise cli.BadInput(str(exc)) from None
    record["configs"] = [c.id for c in configs]
    missing = missing_models(configs)
    if missing:
        for m in missing:
            print(f"missing: {m.name}: {m.reason}", flush=True)
        record.update(error=f"--model-source {args.model_source}: {len(missing)} required checkpoint(s) not cached",
                      missing=[asdict(m) for m in missing])
        return exitcodes.INCOMPLETE
    if not configs:
        print(f"shard {args.shard_id} of {args.num_shards}: no configs to run")
        ctx.expects_tests = False
        return exitcodes.OK

    plan, records, junit = out / "plan.json", out / "records.jsonl", out / "junit.xml"
    artifacts.write_json(plan, plan_dict(args.model_source, settings, configs, (args.num_shards, args.shard_id)))
    for stale in (records, junit):
        stale.unlink(missing_ok=True)
    from specgate import compilecache

    env = pytestrun.child_env({**envpin.session_env(manifest, SESSION), "SPECGATE_SESSION": SESSION,
                               **compilecache.compile_cache_env(),
                               PLAN_VAR: str(plan), RECORDS_VAR: str(records)})
    record["env"] = envpin.effective_env(env, envpin.session_env(manifest, SESSION))
    record["engine_process_env"] = settings.child_env()
    print("compile caches: " + ", ".join(f"{k}={env[k]}" for k in sorted(compilecache.compile_cache_env()))
          + "; engine processes add " + ", ".join(f"{k}={v}" for k, v in settings.child_env().items()), flush=True)
    code = pytestrun.run_pytest(["-m", "e2e", "-rA", "-p", "no:cacheprovider", TESTS_DIR, *args.pytest_args],
                                junit, cwd=REPO_ROOT, env=env, log=out / "pytest.log")
    recorded = Recorder(records).read()
    rows = merge_results(pytestrun.read_junit(junit) if junit.is_file() else [], recorded)
    exit_code = session_exit_code(code, rows)
    record["pytest_exit_code"] = code
    if args.upstream_e2e:
        upstream_code, upstream_results, record["upstream_e2e"] = run_upstream(
            manifest, args.model_source, env, out, args.pytest_args)
        rows += upstream_results
        exit_code = exitcodes.worst(exit_code, upstream_code)
    engines = engine_rows(recorded)
    record.update(tests=rows, engines=engines, compile_backend=compile_backend(engines))
    if rows or engines:
        print(format_report(rows, engines), flush=True)
    return exit_code


if __name__ == "__main__":
    lifecycle.main(SESSION, build_parser(), step)
