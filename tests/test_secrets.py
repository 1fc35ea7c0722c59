"""Secrets are values, not names: specgate.core.secrets masks credentials and leaves settings alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specgate.core import secrets
from specgate.core.secrets import MASK

TOKEN = "hf_PLANTEDsecretVALUE0123456789"
AGENT = {
    "HF_TOKEN": TOKEN,
    "BUILDKITE_AGENT_ACCESS_TOKEN": "bkaccess-0123456789abcdef",
    "BUILDKITE_STEP_KEY": "cpu_unit",
    "BUILDKITE_BUILD_AUTHOR": "Qwen",
    "TOKENIZERS_PARALLELISM": "false",
    "BUILDKITE_AGENT_META_DATA_QUEUE": "cpu",
    "MY_API_KEY": "not-a-reason-to-mask-by-name",
    "OAUTH_CALLBACK": "https://example.invalid/cb",
    "PIP_INDEX_URL": "https://ci-user:s3cr3t-pass@pypi.example.invalid/simple",
    "DB_PASSWORD": "correct-horse-battery",
    "GITHUB_TOKEN": "1",           # a known name with a flag-like value: nothing to hide
    "SERVICE_TOKEN": "short",      # a guessed name needs a credential-like value
}


@pytest.mark.parametrize("name, value, hidden", [
    ("HF_TOKEN", TOKEN, True),
    ("HUGGING_FACE_HUB_TOKEN", TOKEN, True),
    ("BUILDKITE_AGENT_ACCESS_TOKEN", "bkaccess-0123456789abcdef", True),
    ("BUILDKITE_ANALYTICS_TOKEN", "bkua_0123456789", True),
    ("DB_PASSWORD", "correct-horse-battery", True),
    ("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG", True),
    ("BUILDKITE_STEP_KEY", "cpu_unit", False),
    ("TOKENIZERS_PARALLELISM", "false", False),
    ("BUILDKITE_BUILD_AUTHOR", "Qwen", False),
    ("MY_API_KEY", "not-a-reason-to-mask-by-name", False),
    ("SERVICE_TOKEN", "short", False),
    ("SERVICE_TOKEN", "true", False),
    ("GITHUB_TOKEN", "1", False),
])
def test_a_credential_is_judged_by_its_value(name, value, hidden):
    assert secrets.holds_credential(name, value) is hidden


def test_redact_masks_values_and_url_credentials_and_nothing_else():
    text = (f"token {TOKEN} step cpu_unit author Qwen parallel false "
            f"index https://ci-user:s3cr3t-pass@pypi.example.invalid/simple git@github.com:org/repo")
    out = secrets.redact(text, AGENT)
    assert TOKEN not in out and "s3cr3t-pass" not in out and "ci-user" not in out
    assert "https://***@pypi.example.invalid/simple" in out
    for kept in ("cpu_unit", "Qwen", "false", "git@github.com:org/repo"):
        assert kept in out


def test_a_url_password_alone_is_masked_too():
    """A log that prints only the password part of an index URL still hides it."""
    assert "s3cr3t-pass" not in secrets.redact("auth failed for s3cr3t-pass", AGENT)


def test_json_stays_valid_and_intact_under_an_agent_environment():
    data = {"session": "cpu_unit", "repo": "Qwen/Qwen3-0.6B", "flag": False, "env": {"X": "false"},
            "log": f"Authorization: Bearer {TOKEN}", "quoted": 'say "hi"'}
    clean = secrets.redact_data(data, {**AGENT, "WEIRD_TOKEN": 'abc"def\\ghi-0123'})
    assert clean["session"] == "cpu_unit" and clean["repo"] == "Qwen/Qwen3-0.6B" and clean["flag"] is False
    assert clean["env"] == {"X": "false"} and clean["log"] == f"Authorization: Bearer {MASK}"
    json.loads(json.dumps(clean))


def test_a_secret_escaped_inside_json_text_is_masked():
    value = 'abc"def\\ghi-0123'
    text = json.dumps({"log": f"token={value}"})
    assert "abc" not in secrets.redact(text, {"WEIRD_TOKEN": value})


def test_masked_env_for_banners():
    shown = secrets.masked_env(AGENT)
    assert shown["HF_TOKEN"] == MASK and shown["DB_PASSWORD"] == MASK
    assert shown["BUILDKITE_STEP_KEY"] == "cpu_unit" and shown["TOKENIZERS_PARALLELISM"] == "false"
    assert shown["MY_API_KEY"] == "not-a-reason-to-mask-by-name"
    assert shown["PIP_INDEX_URL"] == "https://***@pypi.example.invalid/simple"


def test_the_command_line_filter_used_by_the_wrapper():
    out = subprocess.run([sys.executable, "-m", "specgate.core.secrets"], input=f"HF_TOKEN={TOKEN} key=cpu_unit\n",
                         capture_output=True, text=True, env={**AGENT}, check=True).stdout
    assert out == f"HF_TOKEN={MASK} key=cpu_unit\n"
