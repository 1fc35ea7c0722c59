"""The plan: the [e2e] settings and every [[e2e.configs]] entry with its checkpoints resolved
under the model-source mode, written to plan.json by the session and read back by the tests."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from specgate.contract import summary
from specgate.core.manifest import E2EConfig, Manifest, ManifestError, _Reader

PLAN_VAR = "SPECGATE_E2E_PLAN"
SEED_VAR = "SPECGATE_SAMPLING_SEED"     # another seed set for the sampling requests (the control study)


@dataclass(frozen=True)
class Sampling:
    """[e2e.sampling]: the requests every sampling engine generates and the bounds its checks
    hold (specgate.sessions.e2e.sampling), and the vLLM defect declared for the versions that have it."""
    temperature: float
    top_k: int
    top_p: float
    false_alarm: float
    power: float
    tv_shift: float
    seed_base: int
    greedy_requests: int
    sampled_requests: int
    truncated_requests: int
    max_tokens: int
    truncated_max_tokens: int
    released_requests: int          # the release's own run and the top-k defect's reproduction:
    released_max_tokens: int        # requests, and tokens in each
    text_requests: int              # the two-sample check on a config's own checkpoints: requests,
    text_max_tokens: int            # and tokens in each (one continuation is one draw)
    prompts: list[list[int]]        # cycled over the requests
    defect: dict[str, Any] | None   # {"issue", "reason", "versions" (a PEP 440 specifier), "repair", "evidence"}
    unseeded_drafts: dict[str, Any] | None = None   # {"reason", "versions"}: seeds do not hold for spread drafts

    @classmethod
    def parse(cls, manifest: Manifest, table: dict[str, Any]) -> Sampling:
        r = _Reader(manifest.path, table, "e2e.sampling.")
        counts = {key: r.get(key, int, "a positive integer") for key in (
            "seed_base", "greedy_requests", "sampled_requests", "truncated_requests", "max_tokens",
            "truncated_max_tokens", "released_requests", "released_max_tokens", "text_requests", "text_max_tokens")}
        for key, value in counts.items():
            if value <= 0:
                raise r.fail(key, "a positive integer", value)
        seed = os.environ.get(SEED_VAR)
        if seed is not None:
            if not seed.isdigit():
                raise ManifestError(f"{SEED_VAR}={seed!r}: expected a non-negative integer (the first request's seed)")
            counts["seed_base"] = int(seed)
        unit = {key: r.get(key, float, "a number in (0, 1)") for key in ("top_p", "false_alarm", "power", "tv_shift")}
        for key, value in unit.items():
            if not 0 < value < 1:
                raise r.fail(key, "a number in (0, 1)", value)
        prompts = r.get("prompts", list, "a list of token-id lists")
        if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p)
                                  for p in prompts):
            raise r.fail("prompts", "a non-empty list of non-empty token-id lists", prompts)
        run = r.get("ngram_prompt_run", list, "[first, end] of a token run", None)
        if run is not None:
            if not (len(run) == 2 and all(isinstance(t, int) for t in run) and 0 <= run[0] < run[1] - 2):
                raise r.fail("ngram_prompt_run", "[first, end] of a token run", run)
            prompts = [*prompts, [*range(run[0], run[1]), run[0], run[0] + 1]]
        return cls(temperature=r.get("temperature", float, "a temperature > 0"),
                   top_k=r.get("top_k", int, "an integer >= 1"), **unit, **counts, prompts=[list(p) for p in prompts],
                   defect=_sampling_defect(r), unseeded_drafts=_unseeded_drafts(r))


def _sampling_defect(r: _Reader) -> dict[str, Any] | None:
    """[e2e.sampling.known_defect], if declared. `versions` is a PEP 440 specifier, so the
    declaration also covers the dev and local versions a PR's build carries (0.33.1.dev5+g1a2b)."""
    if not isinstance(r.data.get("known_defect"), dict):
        return None
    d = r.table("known_defect")
    versions = _specifier(d)
    evidence = d.str("evidence")
    if evidence.count("/") != 1:
        raise d.fail("evidence", "a sampling case, <config id>/<draft sample method>", evidence)
    return {"issue": d.str("issue"), "reason": d.str("reason"), "versions": versions,
            "repair": d.str("repair", choices=("vllm-55005",)), "evidence": evidence}


def _unseeded_drafts(r: _Reader) -> dict[str, Any] | None:
    """[e2e.sampling.unseeded_drafts], if declared: the versions whose probabilistic drafts ignore
    the request's seed, so a seeded request with drafts from a spread q does not reproduce."""
    if not isinstance(r.data.get("unseeded_drafts"), dict):
        return None
    d = r.table("unseeded_drafts")
    return {"reason": d.str("reason"), "versions": _specifier(d)}


def declared_for(defect: dict[str, Any] | None, version: str | None) -> bool:
    """Whether a declared defect covers vLLM `version` (pre-releases and dev builds too)."""
    return bool(defect and version and SpecifierSet(defect["versions"]).contains(version, prereleases=True))


DTYPES = ("bfloat16", "float32")   # what the fixtures' designs (and their sampling logits) hold in


@dataclass(frozen=True)
class Settings:
    """[e2e] plain keys: engine bounds and the prompts every engine of a kind generates."""
    dtype: str                     # what every engine computes in: [e2e] dtype, or the fallback below
    dtype_fallback_reason: str | None   # why [e2e] dtype_without_native_bf16 replaced it (None: it did not)
    compile_backend: str           # the backend every engine must compile with (no enforce_eager)
    max_model_len: int
    max_num_seqs: int
    max_tokens: int
    num_logprobs: int
    in_process_engine: bool
    engine_timeout_s: int
    engine_lanes: int
    prompts: tuple[str, ...]
    known_answer_prompts: tuple[tuple[int, ...], ...]
    known_answer_max_tokens: int
    sampling: Sampling | None = None

    @classmethod
    def parse(cls, manifest: Manifest, host: dict[str, Any] | None = None) -> Settings:
        """`host`: a summary.host() record (default: this machine's), which decides the dtype."""
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
        dtype, reason = r.str("dtype", choices=DTYPES), None
        fallback = r.str("dtype_without_native_bf16", choices=DTYPES)
        if dtype == "bfloat16" and fallback != dtype and not summary.bf16_native(host):
            dtype, reason = fallback, (f"this CPU has no AVX512-BF16, so vLLM's bf16 linear layers fall back to "
                                       f"torch's widening GEMM ([e2e] dtype_without_native_bf16 = {fallback!r})")
        return cls(
            dtype=dtype,
            dtype_fallback_reason=reason,
            compile_backend=r.str("compile_backend"),
            max_model_len=positive("max_model_len"),
            max_num_seqs=positive("max_num_seqs"),
            max_tokens=positive("max_tokens"),
            num_logprobs=positive("num_logprobs"),
            in_process_engine=r.get("in_process_engine", bool, "true or false"),
            engine_timeout_s=positive("engine_timeout_s"),
            engine_lanes=positive("engine_lanes"),
            prompts=prompts,
            known_answer_prompts=tuple(tuple(p) for p in known),
            known_answer_max_tokens=positive("known_answer_max_tokens"),
            sampling=Sampling.parse(manifest, r.data["sampling"]) if "sampling" in r.data else None,
        )

    def child_env(self) -> dict[str, str | None]:
        """What the engine settings add to an engine process's environment."""
        # Frontend, engine core and worker in the engine process: no further spawns
        # (each a fresh vLLM import) per engine start; the compiled graphs are the same.
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.in_process_engine else None}


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
    answer_rule: str | None  # a known-answer target's specgate.vllmside.knownanswer rule
    vocab_size: int | None
    architecture: str | None
    # a sampling target's logits on answer + j by engine dtype (specgate.sessions.e2e.sampling)
    answer_logits: dict[str, list[float]] | None = None

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
    known_defect: dict[str, Any] | None  # {"raises", "symptom", "reason", "versions", "applies"}
    measured: dict[str, Any]
    sampling: dict[str, Any] | None = None  # {"target": Model, "draft": Model|None, "draft_sample_methods"}

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
    from specgate.vllmside import fixtures, sources

    src = sources.resolve(manifest, repo_id, mode)
    vocab, arch = _folder_facts(src.path)
    if src.source == "fixture":
        facts = fixtures.describe(manifest, src.fixture)
        return Model(repo_id, "fixture", src.path, facts["hash"], src.fixture, src.status, src.reason,
                     facts.get("known_answer"), vocab, arch, facts.get("answer_logits"))
    return Model(repo_id, "hub", src.path, src.revision, src.fixture, src.status, src.reason, None, vocab, arch)


def fixture_model(manifest: Manifest, name: str) -> Model:
    """A fixture used directly (the known-answer pairs), in every model-source mode."""
    from specgate.vllmside import fixtures

    path = str(fixtures.ensure(manifest, name))
    facts = fixtures.describe(manifest, name)
    vocab, arch = _folder_facts(path)
    return Model(name, "fixture", path, facts["hash"], name, "fixture", "known-answer fixture",
                 facts.get("known_answer"), vocab, arch, facts.get("answer_logits"))


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
    exact = r.get("exact_drafts", bool, "true or false", False)
    # Where the answer is not a successor chain, the successor drafts' first wrong position.
    wrong_at = r.get("wrong_at", int, "a draft position (0 .. num_speculative_tokens - 1)", None)
    if exact and (wrong_at is None or not 0 <= wrong_at < config.num_speculative_tokens):
        raise r.fail("wrong_at", "a draft position (0 .. num_speculative_tokens - 1) with exact_drafts", wrong_at)
    return {"target": target, "draft": draft, "floor": floor, "exact_drafts": exact, "wrong_at": wrong_at,
            "note": r.str("note", default=None)}


def _sampling(manifest: Manifest, config: E2EConfig, version: str | None) -> dict[str, Any] | None:
    raw = config.raw.get("sampling")
    if raw is None:
        return None
    r = _Reader(manifest.path, raw, f"e2e.configs[{config.id}].sampling.")
    target, draft = r.str("target"), r.str("draft", default=None)
    # Probabilistic drafts on a drafter of their own: one whose q is spread (a one-hot q tests
    # neither min(1, p / q) nor the residual max(0, p - q) beyond what greedy drafts do).
    spread_draft = r.str("probabilistic_draft", default=None)
    for key, name in (("target", target), ("draft", draft), ("probabilistic_draft", spread_draft)):
        if name is not None and name not in manifest.fixtures:
            raise r.fail(key, "a fixture declared under [fixtures]", name)
    methods = r.str_list("draft_sample_methods", default=("greedy",))
    if not methods or set(methods) - {"greedy", "probabilistic"}:
        raise r.fail("draft_sample_methods", "a non-empty list of greedy, probabilistic", list(methods))
    if spread_draft is not None and "probabilistic" not in methods:
        raise r.fail("probabilistic_draft", "a fixture only where draft_sample_methods has probabilistic", spread_draft)
    defect = r.get("known_defect", dict, "a table", None)
    if defect is not None:
        d = _Reader(manifest.path, defect, f"e2e.configs[{config.id}].sampling.known_defect.")
        defect = {**_declared_defect(d, version), "requests": d.str("requests", choices=("top_k",))}
    draft_model = fixture_model(manifest, draft) if draft else None
    return {"target": fixture_model(manifest, target), "draft": draft_model,
            "probabilistic_draft": fixture_model(manifest, spread_draft) if spread_draft else draft_model,
            "draft_sample_methods": list(methods), "known_defect": defect}


def _known_defect(manifest: Manifest, config: E2EConfig, version: str | None) -> dict[str, Any] | None:
    raw = config.raw.get("known_defect")
    if raw is None:
        return None
    return _declared_defect(_Reader(manifest.path, raw, f"e2e.configs[{config.id}].known_defect."), version)


def _declared_defect(r: _Reader, version: str | None) -> dict[str, Any]:
    """A config's declared vLLM defect: its exception, symptom and reason, and the versions it is
    declared for (a PEP 440 specifier). `applies`: whether it covers the version under test; where
    it does not, the defect's requests run as any others and an error is a failure."""
    versions = _specifier(r)
    return {"raises": r.str("raises"), "symptom": r.str("symptom"), "reason": r.str("reason"),
            "versions": versions, "applies": declared_for({"versions": versions}, version)}


def _specifier(r: _Reader) -> str:
    versions = r.str("versions")
    try:
        SpecifierSet(versions)
    except InvalidSpecifier:
        raise r.fail("versions", "a PEP 440 version specifier such as '>=0.31.0'", versions) from None
    return versions


def _table(manifest: Manifest, config: E2EConfig, key: str) -> dict[str, Any]:
    value = config.raw.get(key, {})
    if not isinstance(value, dict):
        raise ManifestError(f"{manifest.path.name}: key 'e2e.configs[{config.id}].{key}': "
                            f"expected a table, got {value!r}")
    return dict(value)


def resolve_config(manifest: Manifest, config: E2EConfig, mode: str, version: str | None) -> Config:
    """The config as `mode` resolves its checkpoints, its declared defects judged for vLLM `version`."""
    known = _known_answer(manifest, config)
    if known is not None:
        known["target"] = fixture_model(manifest, known["target"])
        known["draft"] = fixture_model(manifest, known["draft"]) if known["draft"] else None
    if config.method != "none" and config.num_speculative_tokens < 1:
        raise ManifestError(f"{manifest.path.name}: key 'e2e.configs[{config.id}].num_speculative_tokens': "
                            f"expected a positive integer for method {config.method}, "
                            f"got {config.num_speculative_tokens}")
    return Config(
        id=config.id, method=config.method, runner=config.runner, k=config.num_speculative_tokens,
        floors=dict(config.floors),
        target=resolved_model(manifest, config.target, mode),
        draft=resolved_model(manifest, config.draft, mode) if config.draft else None,
        speculative=_table(manifest, config, "speculative"),
        engine=_table(manifest, config, "engine"),
        known_answer=known,
        known_defect=_known_defect(manifest, config, version),
        measured=_table(manifest, config, "measured"),
        sampling=_sampling(manifest, config, version),
    )


def missing_models(configs: Iterable[Config]) -> list[Model]:
    seen: dict[str, Model] = {}
    for c in configs:
        for m in (c.target, c.draft):
            if m is not None and m.path is None:
                seen[m.name] = m
    return list(seen.values())


def unrecorded_floors(manifest: Manifest, version: str) -> str | None:
    """Why the acceptance floors are not applied to this vLLM version (None: they were measured
    on it). A version without floors of its own is not judged against another version's numbers."""
    recorded = _Reader(manifest.path, dict(manifest.e2e_settings), "e2e.").str_list("floors_recorded_on")
    if version in recorded:
        return None
    return (f"no acceptance floors recorded for vLLM {version} (manifest [e2e] floors_recorded_on: "
            f"{', '.join(recorded)}): acceptance is measured and shown, not judged")


def without_floors(config: Config) -> Config:
    """The config with no acceptance floor to hold its runs to; exact checks stay."""
    known = {**config.known_answer, "floor": None} if config.known_answer else None
    return replace(config, floors={}, known_answer=known)


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
    if data.get("sampling"):
        data["sampling"] = {**data["sampling"], **{key: _model(data["sampling"][key])
                                                   for key in ("target", "draft", "probabilistic_draft")}}
    return Config(**data)


def load_plan(path: str | Path) -> tuple[str, Settings, list[Config]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    settings = data["settings"]
    settings = Settings(**{**settings, "prompts": tuple(settings["prompts"]),
                           "known_answer_prompts": tuple(tuple(p) for p in settings["known_answer_prompts"]),
                           "sampling": Sampling(**settings["sampling"]) if settings.get("sampling") else None})
    return data["model_mode"], settings, [config_from_dict(c) for c in data["configs"]]


def planned_ids(plan_path: str | None) -> list[str] | None:
    """The config ids a session's plan holds (None: no plan, all of the manifest's)."""
    if not plan_path:
        return None
    return [c["id"] for c in json.loads(Path(plan_path).read_text(encoding="utf-8"))["configs"]]
