"""The torchvision trap: PyPI's torchvision/torchaudio/torchcodec are CUDA builds,
and beside torch+cpu `import torchvision` fails ("operator torchvision::nms does
not exist"), which breaks transformers' model imports.

`python -m specgate.core.torchprobe` prints, as JSON, which of them fail to import in
this interpreter (each probed in its own process). The installer decides
(specgate.vllmside.buildenv): install CPU builds when an index is configured, else
remove them and record the degradation here, in the venv, for every summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# Set to the PyTorch CPU wheel index to get CPU builds of the companions instead of removing them.
CPU_INDEX_VAR = "SPECGATE_TORCH_CPU_INDEX"
RECORD = "specgate-degraded.json"


def import_error(module: str, python: str = sys.executable) -> str | None:
    """The last line of the error `import module` raises in a fresh interpreter, or None.

    A package that is not installed at all is not broken: nothing imports it by accident."""
    code = (
        "import importlib.util, sys\n"
        f"sys.exit(0) if importlib.util.find_spec({module!r}) is None else __import__({module!r})"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit code {proc.returncode}"


def probe(modules: tuple[str, ...] = TORCH_COMPANIONS, python: str = sys.executable) -> dict[str, str]:
    """module -> import error, for the modules that are installed but do not import."""
    errors = {m: import_error(m, python) for m in modules}
    return {m: e for m, e in errors.items() if e is not None}


def degradation(broken: dict[str, str], action: str = "removed") -> list[dict[str, str]]:
    """What the summaries record about the broken packages (removed, or left as an installed build has them)."""
    return [
        {
            "package": module,
            "action": action,
            "reason": f"{module} failed to import beside torch+cpu ({error}); "
                      "set SPECGATE_TORCH_CPU_INDEX to the PyTorch CPU wheel index to install CPU builds",
        }
        for module, error in sorted(broken.items())
    ]


def record_path(prefix: str = sys.prefix) -> Path:
    return Path(prefix) / RECORD


def write_record(entries: list[dict[str, str]], prefix: str) -> None:
    record_path(prefix).write_text(json.dumps(entries, indent=2) + "\n")


def read_degradation(prefix: str = sys.prefix) -> list[dict[str, str]]:
    """The degradations recorded for this venv (empty when nothing was removed)."""
    path = record_path(prefix)
    return json.loads(path.read_text()) if path.is_file() else []


if __name__ == "__main__":
    print(json.dumps(probe()))
