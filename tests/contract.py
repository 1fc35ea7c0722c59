"""The result contract as tests check it: every summary.json validates against
specgate/contract/summary.schema.json (jsonschema, with date-time formats checked)."""

from __future__ import annotations

import json
from pathlib import Path

from jsonschema import Draft202012Validator, FormatChecker

from specgate.contract import summary

VALIDATOR = Draft202012Validator(summary.load_schema(), format_checker=FormatChecker())


def assert_valid(data: dict) -> dict:
    errors = sorted(VALIDATOR.iter_errors(data), key=lambda e: list(e.path))
    assert not errors, "; ".join(f"{'/'.join(map(str, e.path)) or '(root)'}: {e.message}" for e in errors)
    return data


def read_valid(path: Path) -> dict:
    return assert_valid(json.loads(path.read_text(encoding="utf-8")))
