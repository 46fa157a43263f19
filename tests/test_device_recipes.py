"""The device recipes' FlashInfer cache restore (launch/device_common.sh ``fi_cache_restore``), with
the real ninja on a one-file build laid out like FlashInfer's JIT cache: a module in
``~/.cache/flashinfer`` whose depfile names a header of the installed wheel.

Copying the cache and touching every file to "now" makes every module rebuild on a fresh machine
although the cache was moved in: each output is then newer than the mtime ninja's deps log recorded.
The restore unpacks the tarball with its mtimes and dates the freshly installed headers back instead."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NINJA = shutil.which("ninja") or str(Path(os.sys.executable).parent / "ninja")

pytestmark = [pytest.mark.tools, pytest.mark.skipif(not Path(NINJA).exists(), reason="ninja not installed")]


def _install_header(site: Path) -> Path:
    header = site / "flashinfer" / "data" / "include" / "norm.h"
    header.parent.mkdir(parents=True, exist_ok=True)
    header.write_text("// a header of the wheel\n")  # installed now, as pip does
    return header


def _module(home: Path, site: Path) -> Path:
    mod = home / ".cache" / "flashinfer" / "norm"
    mod.mkdir(parents=True)
    (mod / "norm.cu").write_text("// generated source\n")
    header = site / "flashinfer" / "data" / "include" / "norm.h"
    (mod / "build.ninja").write_text(
        "rule cc\n"
        f"  command = cat $in {header} > $out && printf '%s: %s %s\\n' $out $in {header} > $out.d\n"
        "  deps = gcc\n  depfile = $out.d\n"
        f"build {mod}/norm.so: cc {mod}/norm.cu\n"
    )
    return mod


def _ninja_dry_run(mod: Path) -> str:
    """What ninja would do now, with its reasons (``-d explain`` writes them to stderr)."""
    return subprocess.run(
        [NINJA, "-n", "-d", "explain"],
        cwd=mod,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=True,
    ).stdout


def _restore(workdir: Path, home: Path, site: Path, old_recipe: bool = False) -> None:
    if old_recipe:  # the copy-and-touch recipe: cp -r, then one timestamp for every file
        shutil.copytree(workdir / ".fi" / "flashinfer", home / ".cache" / "flashinfer")
        now = int(time.time())
        for f in (home / ".cache" / "flashinfer").rglob("*"):
            os.utime(f, (now, now))
        return
    subprocess.run(
        ["bash", "-c", f". {REPO}/launch/device_common.sh && fi_cache_restore"],
        cwd=workdir,
        env={**os.environ, "HOME": str(home), "KIT_SITE": str(site)},
        check=True,
    )


@pytest.mark.parametrize("old_recipe", [False, True], ids=["fi_cache_restore", "copy_and_touch"])
def test_a_cache_moved_in_is_not_rebuilt(tmp_path, old_recipe):
    home, site, work = tmp_path / "home", tmp_path / "site", tmp_path / "work"
    _install_header(site)
    mod = _module(home, site)
    subprocess.run([NINJA], cwd=mod, capture_output=True, check=True)
    assert "no work to do" in _ninja_dry_run(mod)
    (work / ".fi").mkdir(parents=True)
    # as a step returns it (GNU tar's default format keeps whole seconds: a restored output is
    # then never newer than the mtime ninja recorded; Python's PAX tarfile rounds up to 100 ns)
    subprocess.run(
        ["tar", "czf", str(work / ".fi" / "fi_cache.tgz"), "-C", str(home / ".cache"), "flashinfer"],
        check=True,
    )
    if old_recipe:
        subprocess.run(
            ["tar", "xzf", str(work / ".fi" / "fi_cache.tgz"), "-C", str(work / ".fi")], check=True
        )

    time.sleep(1.1)  # the next machine: later, the wheels installed afresh, the cache restored
    shutil.rmtree(home)
    shutil.rmtree(site)
    _install_header(site)
    _restore(work, home, site, old_recipe)
    out = _ninja_dry_run(mod)
    if old_recipe:
        assert "no work to do" not in out and "stored deps info out of date" in out
    else:
        assert "no work to do" in out, out


@pytest.mark.parametrize("layout", ["tgz", "unpacked"])
def test_triton_cache_restore_takes_the_returned_tgz(tmp_path, layout):
    """``triton_cache_restore`` fills ~/.triton/cache from ``.tc/triton_cache.tgz`` as a step returns it
    (~6 MB, small enough to move in beside .kit2 and .fi) or from an unpacked ``.tc/cache``; a cache the
    machine already has is left alone."""
    home, work = tmp_path / "home", tmp_path / "work"
    src = tmp_path / "made" / "cache" / "abc"
    src.mkdir(parents=True)
    (src / "k.cubin").write_bytes(b"cubin")
    (work / ".tc").mkdir(parents=True)
    if layout == "tgz":
        subprocess.run(
            ["tar", "czf", str(work / ".tc" / "triton_cache.tgz"), "-C", str(tmp_path / "made"), "cache"],
            check=True,
        )
    else:
        shutil.copytree(tmp_path / "made" / "cache", work / ".tc" / "cache")
    home.mkdir()
    restore = ["bash", "-c", f". {REPO}/launch/device_common.sh && triton_cache_restore"]
    subprocess.run(restore, cwd=work, env={**os.environ, "HOME": str(home)}, check=True)
    assert (home / ".triton" / "cache" / "abc" / "k.cubin").read_bytes() == b"cubin"
    (home / ".triton" / "cache" / "abc" / "k.cubin").write_bytes(b"newer")
    subprocess.run(restore, cwd=work, env={**os.environ, "HOME": str(home)}, check=True)
    assert (home / ".triton" / "cache" / "abc" / "k.cubin").read_bytes() == b"newer"
