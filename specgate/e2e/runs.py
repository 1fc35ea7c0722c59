"""Engine runs: which engines each test reads (equal keys share one start), the order they
start in, their LLM(...) arguments and prompts, and which configs each test covers."""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import Any

from specgate.e2e.planning import Config, Model, Settings
from specgate.manifest import E2EConfig

DRAFT_MODEL_METHODS = ("eagle3", "dflash", "mtp")


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
        return self.target.answer_rule is not None

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


def process_order(runs: Iterable[Run], expected_to_fail: Set[str] = frozenset()) -> list[Run]:
    """The order engines run in: baselines, then speculation, ngram after those (an ngram
    engine loads numba, after which vLLM 0.32 CPU cannot start another engine in that
    process: see specgate.engine), engines expected to fail at the very end; by key within."""
    unique = {r.key: r for r in runs}
    return sorted(unique.values(), key=lambda r: (r.key in expected_to_fail, r.method == "ngram",
                                                  r.method != "none", r.key))


def models(run: Run) -> list[list[str]]:
    """[architecture, name] of the run's checkpoints, for specgate.engine.environment_block."""
    return [[m.architecture, m.name] for m in (run.target, run.draft) if m is not None and m.architecture]


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
}


def select(configs: Iterable[E2EConfig], test: str) -> list[str]:
    """The config ids `test` runs for."""
    return [c.id for c in configs if SELECTORS[test](c)]


def known_answer_targets(configs: Iterable[E2EConfig]) -> list[str]:
    """Each distinct known-answer target fixture once (its baseline runs once)."""
    return sorted({_known(c)["target"] for c in configs if _known(c).get("target")})
