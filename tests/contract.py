"""The result contract as tests check it: every summary.json validates against
specgate/contract/summary.schema.json (jsonschema, with date-time formats checked)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from jsonschema import Draft202012Validator, FormatChecker

from specgate.contract import summary

VALIDATOR = Draft202012Validator(summary.load_schema(), format_checker=FormatChecker())
# One `tests` entry ($defs/test): the schema asks nothing of the array but that each entry is one.
ENTRY_VALIDATOR = VALIDATOR.evolve(schema={**VALIDATOR.schema["$defs"]["test"], "$defs": VALIDATOR.schema["$defs"]})


def entry_errors(entry: dict) -> list[str]:
    """What is wrong with one `tests` entry, as 'path: message' lines."""
    return list(_entry_errors(json.dumps(entry, sort_keys=True)))


# jsonschema spends ~70 us an entry; synthetic histories repeat the same entries hundreds of times.
@lru_cache(maxsize=4096)
def _entry_errors(entry: str) -> tuple[str, ...]:
    return tuple(_lines(ENTRY_VALIDATOR, json.loads(entry)))


def _lines(validator: Draft202012Validator, data: object) -> list[str]:
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.path))
    return [f"{'/'.join(map(str, e.path)) or '(root)'}: {e.message}" for e in errors]


def assert_valid(data: dict) -> dict:
    tests = data.get("tests")
    if isinstance(tests, list):   # each entry on its own (cached), the rest with no entries
        errors = _lines(VALIDATOR, {**data, "tests": []})
        errors += [f"tests/{i}/{line}" for i, entry in enumerate(tests) for line in entry_errors(entry)]
    else:
        errors = _lines(VALIDATOR, data)
    assert not errors, "; ".join(errors)
    return data


def read_valid(path: Path) -> dict:
    return assert_valid(json.loads(path.read_text(encoding="utf-8")))
