"""Engine runs: which engine phases each test reads (equal keys are one phase), the engine each
phase runs on (one start per engine key: a target, a drafter, k, the draft method and engine
extras), the order engines start in and phases run in, their LLM(...) arguments and prompts,
and which configs each test covers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Any

from specgate.core.manifest import E2EConfig
from specgate.sessions.e2e.planning import Config, Model, Settings, declared_for

DRAFT_MODEL_METHODS = ("eagle3", "dflash", "mtp")


@dataclass(frozen=True)
class Run:
    """One phase of an engine: a target, a speculative configuration (method "none": none), and
    the requests (the prompt set its target calls for, or a sampling_requests kind) with the
    repair they run under. Runs with equal engine keys share one engine start."""
    target: Model
    draft: Model | None
    method: str
    k: int
    speculative: tuple[tuple[str, Any], ...] = ()
    engine: tuple[tuple[str, Any], ...] = ()
    requests: str = ""            # "": greedy, known answer or text; else a sampling_requests kind
    repair: str | None = None     # a specgate.vllmside.enginehooks repair the engine runs with

    @property
    def known_answer(self) -> bool:
        return self.target.answer_rule is not None

    @property
    def engine_key(self) -> str:
        """The engine this phase runs on: what LLM(...) is built from."""
        parts = [self.target.ident, self.method]
        if self.method != "none":
            parts += [f"k={self.k}", *(f"{k}={v}" for k, v in self.speculative)]
        if self.draft:
            parts.insert(1, self.draft.ident)
        return " ".join(parts + [f"{k}={v}" for k, v in self.engine])

    @property
    def key(self) -> str:
        """The phase: its engine, requests and repair."""
        parts = [f"requests={self.requests}"] * bool(self.requests) + [f"repair={self.repair}"] * bool(self.repair)
        return " ".join([self.engine_key, *parts])

    def baseline(self) -> Run:
        """The same target and requests with no speculation (engine keys that speculation needs
        stay; a repair does not: without drafts no rejection sampler runs)."""
        requests = self.requests if self.requests == TEXT else self.requests and SAMPLED
        return Run(self.target, None, "none", 0, (), self.engine, requests)


def spec_run(config: Config) -> Run:
    """The config's method on its own checkpoints, or on its known-answer pair where fixture
    stand-ins would load the same model classes (folds_into_known_answer)."""
    if folds_into_known_answer(config):
        return known_answer_run(config)
    return Run(config.target, config.draft, config.method, config.k,
               tuple(sorted(config.speculative.items())), tuple(sorted(config.engine.items())))


def folds_into_known_answer(config: Config) -> bool:
    """Whether a config on fixture stand-ins runs its checks on its known-answer pair instead:
    where the pair has the stand-ins' architectures, the same vLLM code runs and the checks stay
    the same, on a target whose every token is known (no second engine for random weights). A
    stand-in of another architecture (Qwen3.5's GDN hybrid for MiMo's MTP) keeps its own engine."""
    known = config.known_answer
    if not known or config.model_source != "fixture":
        return False
    pairs = ((config.target, known["target"]), (config.draft, known["draft"]))
    return all((ours is None) == (theirs is None) and (ours is None or ours.architecture == theirs.architecture)
               for ours, theirs in pairs)


def known_answer_run(config: Config) -> Run:
    """The config's method on its known-answer fixtures; its engine extras belong to the
    hub target (e.g. a workaround) and stay out."""
    known = config.known_answer or {}
    return Run(known["target"], known["draft"], config.method, config.k, tuple(sorted(config.speculative.items())))


SAMPLED, RELEASED = "sampled", "released"
TOP_P_ONLY = "sampled-top-p"   # SAMPLED with top-p in place of top-k (a declared top-k defect)
TOP_K = "top-k"                # the sampled and top-k requests alone: the declared defect's reproduction
TEXT = "text"                  # sampled requests on the config's own checkpoints and text prompts


def text_sampling_run(config: Config, repair: str | None) -> Run:
    """The config's own target and draft (hub checkpoints where cached) sampling text prompts."""
    return Run(config.target, config.draft, config.method, config.k, tuple(sorted(config.speculative.items())),
               tuple(sorted(config.engine.items())), requests=TEXT, repair=repair)


def sampling_run(config: Config, draft_sample_method: str, repair: str | None, requests: str = SAMPLED) -> Run:
    """The config's method on its sampling fixtures, drafts sampled greedily or probabilistically."""
    s = config.sampling or {}
    speculative = {**config.speculative, **({"draft_sample_method": draft_sample_method}
                                            if draft_sample_method != "greedy" else {})}
    if requests == SAMPLED and (s.get("known_defect") or {}).get("applies"):
        requests = TOP_P_ONLY
    draft = s["probabilistic_draft"] if draft_sample_method == "probabilistic" else s["draft"]
    return Run(s["target"], draft, config.method, config.k, tuple(sorted(speculative.items())),
               requests=requests, repair=repair)


@dataclass(frozen=True)
class Request:
    prompt: list[int] | str
    role: str                      # greedy | sampled | top_k | top_p
    params: dict[str, Any]         # vLLM SamplingParams


def sampling_requests(run: Run, settings: Settings) -> list[Request]:
    """The requests of a sampling engine: greedy ones first (so they share a batch with
    sampled ones), then the sampled, then the truncated; the release's own run (RELEASED)
    has only the sampled ones, shorter; TEXT has short sampled ones on the text prompts."""
    s = settings.sampling
    assert s is not None
    prompts = s.prompts
    # Logprobs where a check reads them: the target alone's (test_sampling_target_follows_design).
    logprobs = {"logprobs": settings.num_logprobs} if run.method == "none" else {}
    common = {"ignore_eos": True, **logprobs, "temperature": s.temperature}
    out: list[Request] = []
    if run.requests == TEXT:
        return [Request(settings.prompts[i % len(settings.prompts)], "sampled",
                        {"ignore_eos": True, "temperature": s.temperature, "seed": s.seed_base + i,
                         "max_tokens": s.text_max_tokens}) for i in range(s.text_requests)]
    if run.requests == RELEASED:
        return [Request(prompts[i % len(prompts)], "sampled",
                        {**common, "seed": s.seed_base + i, "max_tokens": s.released_max_tokens})
                for i in range(s.released_requests)]
    if run.requests == TOP_K:
        return [Request(prompts[i % len(prompts)], "top_k" if i % 2 else "sampled",
                        {**common, **({"top_k": s.top_k} if i % 2 else {}), "seed": s.seed_base + i,
                         "max_tokens": s.released_max_tokens}) for i in range(s.released_requests)]
    for i in range(s.greedy_requests):
        out.append(Request(prompts[i % len(prompts)], "greedy",
                           {**common, "temperature": 0.0, "max_tokens": settings.known_answer_max_tokens}))
    for i in range(s.sampled_requests):
        out.append(Request(prompts[i % len(prompts)], "sampled",
                           {**common, "seed": s.seed_base + i, "max_tokens": s.max_tokens}))
    for i in range(s.truncated_requests):
        top_k = i < s.truncated_requests // 2 and run.requests != TOP_P_ONLY
        role, cut = ("top_k", {"top_k": s.top_k}) if top_k else ("top_p", {"top_p": s.top_p})
        seed = s.seed_base + s.sampled_requests + i
        out.append(Request(prompts[i % len(prompts)], role, {**common, **cut, "seed": seed,
                                                            "max_tokens": s.truncated_max_tokens}))
    return out


def sampling_cases(configs: Iterable[E2EConfig]) -> list[str]:
    """"<config id>/<draft sample method>" for every config with a [sampling] table."""
    cases = []
    for c in configs:
        table = c.raw.get("sampling")
        if isinstance(table, dict):
            cases += [f"{c.id}/{m}" for m in table.get("draft_sample_methods", ["greedy"])]
    return cases


def sampling_targets(configs: Iterable[E2EConfig]) -> list[str]:
    return sorted({c.raw["sampling"]["target"] for c in configs if isinstance(c.raw.get("sampling"), dict)})


def defect_repair(settings: Settings, version: str | None) -> str | None:
    """The repair the sampling phases ask for: the declared defect's, on the versions it covers.
    The engine host applies it only where its probe finds the defect on the build."""
    s = settings.sampling
    return s.defect["repair"] if s and s.defect and declared_for(s.defect, version) else None


def repeated(requests: list[Request]) -> list[int]:
    """Which requests a sampling engine generates a second time (seeded determinism): the
    greedy ones and the first two sampled."""
    sampled = [i for i, r in enumerate(requests) if r.role == "sampled"]   # the same indices in every SAMPLED set
    return [i for i, r in enumerate(requests) if r.role == "greedy"] + sampled[:2]


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


def process_order(runs: Iterable[Run], expected_to_fail: Set[str] = frozenset()) -> list[list[Run]]:
    """The engines to start, each as its phases, in the order they run. Engines: baselines, then
    speculation, ngram after those (an ngram engine loads numba, after which vLLM 0.32 CPU cannot
    start another engine in that process: see specgate.vllmside.engine), an engine with a phase
    expected to fail at the very end; by key within. Phases of an engine: those without a repair
    first (memory a repaired phase wrote must not mask a defect), the one expected to fail last
    (it ends the engine), by request kind within."""
    engines: dict[str, dict[str, Run]] = {}
    for run in runs:
        engines.setdefault(run.engine_key, {})[run.key] = run
    kinds = ("", TEXT, RELEASED, SAMPLED, TOP_P_ONLY, TOP_K)
    ordered = [sorted(phases.values(), key=lambda r: (r.key in expected_to_fail, r.repair is not None,
                                                      kinds.index(r.requests), r.key))
               for phases in engines.values()]
    return sorted(ordered, key=lambda phases: (any(r.key in expected_to_fail for r in phases),
                                               phases[0].method == "ngram", phases[0].method != "none",
                                               phases[0].engine_key))


def engine_lanes(engines: list[list[Run]], settings: Settings) -> int:
    """How many engine hosts run these engines at once: [e2e] engine_lanes where every engine
    loads fixtures, else one (a hub checkpoint may want the machine's whole memory)."""
    tiny = all(m.source == "fixture" for phases in engines for m in (phases[0].target, phases[0].draft) if m)
    return settings.engine_lanes if tiny else 1


def models(run: Run) -> list[list[str]]:
    """[architecture, name] of the run's checkpoints, for specgate.vllmside.engine.environment_block."""
    return [[m.architecture, m.name] for m in (run.target, run.draft) if m is not None and m.architecture]


def speculative_config(run: Run) -> dict[str, Any] | None:
    if run.method == "none":
        return None
    spec: dict[str, Any] = {"method": run.method, "num_speculative_tokens": run.k, **dict(run.speculative)}
    if run.draft is not None:
        spec["model"] = run.draft.path
    return spec


ONE_BATCH = (SAMPLED, TOP_P_ONLY)   # request kinds generated in a single batch, all at once


def batch_size(run: Run, settings: Settings) -> int:
    """Requests per generate call of a phase: the main sampling phases take all theirs in one batch
    (many short requests: steps, not tokens, are what an engine pays for on a tiny model); the
    rest keep [e2e] max_num_seqs, the declared defects' reproductions in the shape they were seen in."""
    if run.requests in ONE_BATCH:
        return max(settings.max_num_seqs, len(sampling_requests(run, settings)))
    return settings.max_num_seqs


def llm_kwargs(phases: Sequence[Run], settings: Settings) -> dict[str, Any]:
    """LLM(...) arguments of the engine the phases share, its batch bound the largest any phase
    needs. No enforce_eager: the engine compiles (CPU: inductor)."""
    run = phases[0]
    kwargs: dict[str, Any] = {
        "model": run.target.path,
        "dtype": settings.dtype,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": max(batch_size(phase, settings) for phase in phases),
        "seed": 0,
        "disable_log_stats": False,
        **dict(run.engine),
    }
    one_step = max((prefill_budget(phase, settings) for phase in phases if phase.requests in ONE_BATCH), default=0)
    if one_step > VLLM_CPU_BATCHED_TOKENS:
        kwargs["max_num_batched_tokens"] = one_step
    spec = speculative_config(run)
    if spec is not None:
        kwargs["speculative_config"] = spec
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    return kwargs


VLLM_CPU_BATCHED_TOKENS = 4096   # vLLM's CPU default max_num_batched_tokens for LLM(...) (engine/arg_utils.py)


def prefill_budget(run: Run, settings: Settings) -> int:
    """Tokens a one-batch phase needs in one step: its first step prefills every prompt whole,
    later ones verify every request. A prompt that does not fit is prefilled in chunks, and vLLM
    0.32 CPU crashes on a seeded request's chunk ("CPU Generator does not use offset": its
    sampler rewinds the request's generator, which only CUDA generators allow)."""
    requests = sampling_requests(run, settings)
    return max(sum(len(r.prompt) for r in requests), len(requests) * (run.k + 1))


def prompts_for(run: Run, settings: Settings) -> tuple[list[Any], int]:
    """(prompts, max_tokens): token ids for known-answer targets, text otherwise."""
    if run.known_answer:
        return [list(p) for p in settings.known_answer_prompts], settings.known_answer_max_tokens
    return list(settings.prompts), settings.max_tokens


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
    "text_sampling": lambda c: c.runner == "v1" and "known_defect" not in c.raw,
}


def select(configs: Iterable[E2EConfig], test: str) -> list[str]:
    """The config ids `test` runs for."""
    return [c.id for c in configs if SELECTORS[test](c)]


def known_answer_targets(configs: Iterable[E2EConfig]) -> list[str]:
    """Each distinct known-answer target fixture once (its baseline runs once)."""
    return sorted({_known(c)["target"] for c in configs if _known(c).get("target")})
