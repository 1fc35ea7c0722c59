"""Secrets are values, not names: what to mask wherever text leaves the process.

Masked: the values of variables known to hold credentials (HF_TOKEN, Buildkite's
agent, API and Test Engine tokens, ...), the values of other *_TOKEN / *_SECRET /
*_PASSWORD variables when the value looks like a credential (not `false`, `1` or
a short word), and the user:password part of any URL (`scheme://user:pass@host`),
in any text. A name that merely contains KEY or AUTH (BUILDKITE_STEP_KEY) is never
a reason to touch its value.

Stdlib only: the noxfile and scripts/run-cpu-test.sh use it before any venv exists
(`python3 -m specgate.core.secrets` masks standard input).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

MASK = "***"
KNOWN_CREDENTIALS = frozenset({
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_HUB_TOKEN", "HUGGINGFACE_TOKEN",
    "BUILDKITE_AGENT_ACCESS_TOKEN", "BUILDKITE_AGENT_TOKEN", "BUILDKITE_API_TOKEN",
    "BUILDKITE_ANALYTICS_TOKEN", "GITHUB_TOKEN", "GH_TOKEN",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
})
# One word of the name (split on _) says "credential": HF_TOKEN, DB_PASSWORD, but not TOKENIZERS_PARALLELISM.
CREDENTIAL_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD"})
NOT_CREDENTIALS = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null", "unset", "0", "1"})
MIN_KNOWN_LEN = 4    # shorter values of known credentials would mask ordinary words
MIN_GUESSED_LEN = 8  # a *_TOKEN value shorter than this is a setting, not a credential
URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/\s@:]*:[^/\s@]*|[^/\s@:]+)@")


def credential_named(name: str) -> bool:
    return name.upper() in KNOWN_CREDENTIALS or bool(CREDENTIAL_WORDS & set(name.upper().split("_")))


def holds_credential(name: str, value: str | None) -> bool:
    """Whether this variable's value is a credential worth masking."""
    if not value or value.strip().lower() in NOT_CREDENTIALS:
        return False
    if name.upper() in KNOWN_CREDENTIALS:
        return len(value) >= MIN_KNOWN_LEN
    return credential_named(name) and len(value) >= MIN_GUESSED_LEN and not any(c.isspace() for c in value)


def _url_passwords(value: str) -> list[str]:
    found = []
    for match in URL_USERINFO.finditer(value):
        userinfo = match["userinfo"]
        found += [part for part in userinfo.split(":", 1) if len(part) >= MIN_KNOWN_LEN]
    return found


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every value worth scrubbing from text, longest first (so no secret is half-masked)."""
    environ = os.environ if environ is None else environ
    values: set[str] = set()
    for name, value in environ.items():
        if holds_credential(name, value):
            values.add(value)
        values.update(_url_passwords(value or ""))
    return sorted(values, key=len, reverse=True)


def redactor(environ: Mapping[str, str] | None = None) -> Callable[[str], str]:
    """`redact` with the environment's secrets found once: for many texts (every line of a log,
    every string of a summary), where finding them again for each took seconds of CPU."""
    values = secret_values(environ)

    def scrub(text: str) -> str:
        for value in values:
            text = text.replace(value, MASK)
            escaped = json.dumps(value)[1:-1]
            if escaped != value:
                text = text.replace(escaped, MASK)
        return URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)

    return scrub


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """Text with every secret value (raw, or as it appears inside JSON) and every URL's
    user:password masked."""
    return redactor(environ)(text)


def redact_data(data: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A JSON-ready structure with every string redacted, so masking never breaks its syntax."""
    scrub = redactor(environ)

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            return scrub(item)
        if isinstance(item, dict):
            return {key: walk(value) for key, value in item.items()}
        if isinstance(item, (list, tuple)):
            return [walk(value) for value in item]
        return item

    return walk(data)


def masked_env(env: Mapping[str, str | None]) -> dict[str, str | None]:
    """An environment for display: credentials as ***, URLs without their user:password."""
    scrub = redactor()
    return {name: (MASK if holds_credential(name, value) else scrub(value) if value else value)
            for name, value in env.items()}


if __name__ == "__main__":
    sys.stdout.write(redact(sys.stdin.read()))
