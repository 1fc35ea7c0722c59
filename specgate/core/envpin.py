"""Environment pinning and installer pass-through (secret masking: specgate.core.secrets).

Stdlib only: the noxfile uses it before any venv exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from specgate.core.manifest import Manifest
from specgate.core.secrets import credential_named, masked_env

ONLINE_VAR = "SPECGATE_ONLINE"  # "1": a rerun by scripts/run-cpu-test.sh, online by the manifest's [online.env]
# pip reads these, uv does not: each PIP_ name maps to the uv name it means.
PIP_TO_UV = {
    "PIP_FIND_LINKS": "UV_FIND_LINKS",
    "PIP_INDEX_URL": "UV_INDEX_URL",
    "PIP_EXTRA_INDEX_URL": "UV_EXTRA_INDEX_URL",
}
# Variables vLLM, torch or the hub read that the report should show even when unpinned.
SHOWN_PREFIXES = ("VLLM_", "HF_", "HUGGINGFACE", "OMP_", "MKL_", "TORCH", "UV_", "PIP_", "SPECGATE_")


def session_env(manifest: Manifest, session: str, environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """The variables a session pins: its own values, and None (removal) for every
    variable another session pins, so no phase inherits another's settings. In the
    online phase (SPECGATE_ONLINE=1 in environ) the manifest's [online.env] applies on top."""
    pinned: dict[str, str | None] = {name: None for name in manifest.managed_env_names()}
    pinned.update(manifest.session(session).env)
    if environ.get(ONLINE_VAR) == "1":
        pinned.update(online_env(manifest))
    return pinned


def online_env(manifest: Manifest) -> dict[str, str]:
    """The online phase: the manifest's [online.env], marked so every child process knows the phase."""
    return {**manifest.online_env, ONLINE_VAR: "1"}


def installer_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """uv equivalents of the user's pip settings, where uv's own are not set.

    pip separates several find-links or extra index URLs with spaces, as does uv."""
    return {
        uv: environ[pip]
        for pip, uv in PIP_TO_UV.items()
        if environ.get(pip) and not environ.get(uv)
    }


def effective_env(environ: Mapping[str, str] = os.environ,
                  pinned: Mapping[str, str | None] = {}) -> dict[str, str | None]:
    """The variables worth showing: every pinned one (None = removed) and any
    relevant one inherited from outside."""
    shown = {k: environ.get(k) for k in pinned}
    shown.update({k: v for k, v in environ.items() if k.startswith(SHOWN_PREFIXES) or credential_named(k)})
    return dict(sorted(masked_env(shown).items()))


def session_report(manifest: Manifest, session: str, environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """The masked effective environment of a session, for banners and summaries."""
    return effective_env(environ, session_env(manifest, session, environ))


def format_table(env: Mapping[str, str | None], title: str = "effective environment") -> str:
    width = max((len(k) for k in env), default=0)
    rows = [f"{k.ljust(width)}  {'(unset)' if v is None else v}" for k, v in env.items()]
    return "\n".join([f"== {title} ==", *rows])


def mismatches(manifest: Manifest, session: str, observed: Mapping[str, str]) -> list[str]:
    """Lines describing where an observed environment departs from the manifest."""
    problems = []
    for name, want in session_env(manifest, session, observed).items():
        got = observed.get(name)
        if got != want:
            problems.append(f"{name}: manifest says {want if want is not None else '(unset)'}, "
                            f"process saw {got if got is not None else '(unset)'}")
    return problems
