"""Environment pinning, installer pass-through and secret masking.

Stdlib only: the noxfile uses it before any venv exists.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from specgate.manifest import Manifest

SECRET_NAME_RE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
MASK = "***"
# pip reads these, uv does not: each PIP_ name maps to the uv name it means.
PIP_TO_UV = {
    "PIP_FIND_LINKS": "UV_FIND_LINKS",
    "PIP_INDEX_URL": "UV_INDEX_URL",
    "PIP_EXTRA_INDEX_URL": "UV_EXTRA_INDEX_URL",
}
# Variables vLLM, torch or the hub read that the report should show even when unpinned.
SHOWN_PREFIXES = ("VLLM_", "HF_", "HUGGINGFACE", "OMP_", "MKL_", "TORCH", "UV_", "PIP_", "SPECGATE_")


def session_env(manifest: Manifest, session: str) -> dict[str, str | None]:
    """The variables a session pins: its own values, and None (removal) for every
    variable another session pins, so no phase inherits another's settings."""
    pinned: dict[str, str | None] = {name: None for name in manifest.managed_env_names()}
    pinned.update(manifest.session(session).env)
    return pinned


def online_env(manifest: Manifest) -> dict[str, str]:
    """The online retry phase: the manifest's [online.env], declared to the envcheck plugin."""
    return {**manifest.online_env, "SPECGATE_PHASE_OVERRIDES": ",".join(sorted(manifest.online_env))}


def installer_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """uv equivalents of the user's pip settings, where uv's own are not set.

    pip separates several find-links or extra index URLs with spaces, as does uv."""
    return {
        uv: environ[pip]
        for pip, uv in PIP_TO_UV.items()
        if environ.get(pip) and not environ.get(uv)
    }


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME_RE.search(name))


def masked(env: Mapping[str, str | None]) -> dict[str, str | None]:
    return {k: (MASK if v and is_secret(k) else v) for k, v in env.items()}


def secret_values(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Values of secret-named variables, longest first, worth scrubbing from text."""
    return sorted({v for k, v in environ.items() if is_secret(k) and len(v) >= 4}, key=len, reverse=True)


def redact(text: str, environ: Mapping[str, str] = os.environ) -> str:
    for value in secret_values(environ):
        text = text.replace(value, MASK)
    return text


def effective_env(environ: Mapping[str, str] = os.environ, pinned: Mapping[str, str | None] = {}) -> dict[str, str | None]:
    """The variables worth showing: every pinned one (None = removed) and any
    relevant one inherited from outside."""
    shown = {k: environ.get(k) for k in pinned}
    shown.update({k: v for k, v in environ.items() if k.startswith(SHOWN_PREFIXES) or is_secret(k)})
    return dict(sorted(masked(shown).items()))


def session_report(manifest: Manifest, session: str, environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """The masked effective environment of a session, for banners and summaries."""
    return effective_env(environ, session_env(manifest, session))


def format_table(env: Mapping[str, str | None], title: str = "effective environment") -> str:
    width = max((len(k) for k in env), default=0)
    rows = [f"{k.ljust(width)}  {'(unset)' if v is None else v}" for k, v in env.items()]
    return "\n".join([f"== {title} ==", *rows])


def mismatches(manifest: Manifest, session: str, observed: Mapping[str, str]) -> list[str]:
    """Lines describing where an observed environment departs from the manifest."""
    problems = []
    for name, want in session_env(manifest, session).items():
        got = observed.get(name)
        if got != want:
            problems.append(f"{name}: manifest says {want if want is not None else '(unset)'}, "
                            f"process saw {got if got is not None else '(unset)'}")
    return problems
