"""Tier 1: the C++ extension's JIT cache is keyed by what changes the build output, never by a path.

Two checkouts (copies of moe_comm/ and csrc/ at different paths) and one ``TORCH_EXTENSIONS_DIR``: both
use one build folder, and the second one's first use loads the first one's build - nothing in the folder is
written, ninja is not run and ``torch.utils.cpp_extension`` is not even imported. The folder is seeded with this
process's own build (``.so`` and its ``BUILT_MARK``), so no test here compiles.
The key itself: equal for equal sources at other paths, different for other bytes, flags or compiler.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_comm.kernels import native

REPO = Path(__file__).resolve().parents[2]


def _sources(root: Path):
    return [root / name for name in native._SOURCES]


def _checkout(root: Path) -> Path:
    """A second checkout: the working tree's moe_comm/ and csrc/ (what the package reads) at another path."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "moe_comm", root / "moe_comm", ignore=ignore)
    shutil.copytree(REPO / "csrc", root / "csrc", ignore=ignore)
    return root


def _first_use(checkout: Path, ext_dir: Path) -> dict:
    """A fresh process of ``checkout`` calls ``native.available()``; what it loaded and imported."""
    code = ("import json, sys; from moe_comm.kernels import native; ok = native.available(); "
            "print(json.dumps({'ok': ok, 'native': native.__file__, 'so': native._extension().__file__, "
            "'cpp_extension': 'torch.utils.cpp_extension' in sys.modules}))")
    env = {**os.environ, "PYTHONPATH": str(checkout), "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def built():
    """(name, build folder) of this process's extension."""
    if not native.available():
        if shutil.which("c++"):
            pytest.fail("a C++ compiler exists but moe_comm's native kernels did not build; see the warning")
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    name = native._build_name(_sources(native._CSRC_DIR))
    return name, native._build_dir(name)


def test_key_ignores_the_path_and_follows_the_bytes_flags_and_compiler(tmp_path, monkeypatch):
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    key = native._build_name(_sources(a / "csrc"))
    assert key == native._build_name(_sources(b / "csrc")) == native._build_name(_sources(REPO / "csrc"))
    changed = b / "csrc" / native._SOURCES[0]
    changed.write_bytes(changed.read_bytes() + b"\n")
    assert native._build_name(_sources(b / "csrc")) != key
    monkeypatch.setattr(native, "_CFLAGS", native._CFLAGS + ("-g",))
    assert native._build_name(_sources(a / "csrc")) != key
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")
    assert native._build_name(_sources(a / "csrc")) != key


def test_build_files_name_no_checkout(built):
    # torch writes the sources' paths into build.ninja: they must be the folder's own copies, or a second
    # checkout would rewrite the file and ninja would rebuild everything.
    name, build_dir = built
    ninja = build_dir / "build.ninja"
    if not ninja.is_file():
        pytest.skip(f"{build_dir} holds no build.ninja (its .so was copied in, not built there)")
    text = ninja.read_text()
    assert str(REPO / "csrc") not in text
    for source in native._SOURCES:
        assert f"compile {build_dir / 'src' / source}" in text, text


def test_second_checkout_does_not_rebuild(built, tmp_path):
    name, build_dir = built
    ext_dir = tmp_path / "torch_extensions"
    (ext_dir / name).mkdir(parents=True)
    for file in (f"{name}.so", native.BUILT_MARK):
        shutil.copy2(build_dir / file, ext_dir / name / file)
    before = _files(ext_dir)
    so = str(ext_dir / name / f"{name}.so")
    for checkout in (_checkout(tmp_path / "cloneA"), _checkout(tmp_path / "cloneB")):
        got = _first_use(checkout, ext_dir)
        assert got["native"].startswith(str(checkout)), got  # that checkout's code ran
        assert got["ok"] and got["so"] == so, got
        assert not got["cpp_extension"], got  # loaded, not built or checked by ninja
        assert _files(ext_dir) == before  # nothing written: no rebuild


def test_unmarked_folder_is_built_not_loaded(built, tmp_path):
    # A folder without BUILT_MARK (a build still running, or killed) is left to torch's build and its lock.
    name, build_dir = built
    (tmp_path / name).mkdir()
    shutil.copy2(build_dir / f"{name}.so", tmp_path / name / f"{name}.so")
    assert native._load_built(name, tmp_path / name) is None
    shutil.copy2(build_dir / native.BUILT_MARK, tmp_path / name / native.BUILT_MARK)
    module = native._load_built(name, tmp_path / name)  # (Python hands back the module it loaded already)
    assert module is not None and callable(module.permute_rows)


def test_damaged_build_is_unmarked_and_built_again(built, tmp_path, monkeypatch):
    # A marked .so that does not load (a truncated file): the mark goes first, then the folder is rebuilt.
    name, _ = built
    folder = tmp_path / name
    folder.mkdir()
    (folder / f"{name}{native._LIB_EXT}").write_bytes(b"not an ELF file")
    (folder / native.BUILT_MARK).write_text(name)
    builds = []

    def build(name_, build_dir, sources):
        # the damaged library is gone before the build: ninja relinks it (it would skip a library newer than
        # its objects)
        builds.append((name_, build_dir, (build_dir / native.BUILT_MARK).exists(),
                       (build_dir / f"{name}{native._LIB_EXT}").exists()))
        return native  # stands in for the rebuilt module

    monkeypatch.setattr(native, "_build", build)
    monkeypatch.setattr(native, "_build_dir", lambda name_: tmp_path / name_)
    monkeypatch.delitem(sys.modules, name)  # restored after the test, with the cache of _extension
    native._extension.cache_clear()
    try:
        assert native._extension() is native
    finally:
        monkeypatch.undo()
        native._extension.cache_clear()
    assert builds == [(name, folder, False, False)]
    assert native.available()
