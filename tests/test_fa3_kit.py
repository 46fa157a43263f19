"""launch/fa3_kit.py: a library cut into compressed pieces is moved in one piece per step and is
installed only when every piece, the joined stream and the decompressed files have their SHA-256
(a small stand-in library here; the real split runs on sglang-kernel's 1.1 GB flash_ops)."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from launch import fa3_kit

pytestmark = [pytest.mark.tools, pytest.mark.skipif(shutil.which("xz") is None, reason="no xz binary")]


def _kit(tmp_path: Path, piece_bytes: int = 4096) -> tuple[Path, dict, bytes]:
    lib = tmp_path / "wheel" / "flash_ops.abi3.so"
    lib.parent.mkdir()
    payload = os.urandom(6000) + bytes(range(256)) * 200  # part noise, part compressible
    lib.write_bytes(payload)
    attn = tmp_path / "wheel" / "flash_attn.py"
    attn.write_text("from sgl_kernel import flash_ops\n")
    files = {
        fa3_kit.LIBRARY: hashlib.sha256(payload).hexdigest(),
        "sgl_kernel/flash_attn.py": fa3_kit.sha256_file(attn),
    }
    out = tmp_path / ".fa3"
    manifest = fa3_kit.write_kit(lib, attn, out, fa3_kit.CODECS["xz"], piece_bytes, files)
    return out, manifest, payload


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "sgl_kernel").mkdir(parents=True)
    (site / "sgl_kernel" / "__init__.py").write_text("")
    (site / "sgl_kernel" / "flash_attn.py").write_text("raise ImportError('stripped')\n")
    return site


def _step(tmp_path: Path, out: Path, names: list[str], i: int) -> Path:
    """What one step moves in: the manifest, flash_attn.py and the named pieces."""
    src = tmp_path / f"step{i}" / ".fa3"
    src.mkdir(parents=True)
    for name in ["manifest.json", "flash_attn.py", *names]:
        shutil.copy(out / name, src / name)
    return src


def test_pieces_move_in_one_per_step_and_install_checked(tmp_path):
    out, manifest, payload = _kit(tmp_path)
    pieces = [p["name"] for p in manifest["pieces"]]
    assert len(pieces) >= 2 and all((out / n).stat().st_size <= 4096 for n in pieces)
    site, stash = _site(tmp_path), tmp_path / "stash"
    for i, name in enumerate(pieces[:-1]):
        status = fa3_kit.install(_step(tmp_path, out, [name], i), stash, site, manifest["files"])
        assert status.startswith(f"{i + 1} of {len(pieces)} pieces")
        assert not (site / "sgl_kernel" / "flash_ops.abi3.so").exists()
    status = fa3_kit.install(_step(tmp_path, out, [pieces[-1]], 99), stash, site, manifest["files"])
    assert status.startswith("FA3 installed")
    assert (site / "sgl_kernel" / "flash_ops.abi3.so").read_bytes() == payload
    assert (site / "sgl_kernel" / "flash_attn.py").read_text() == "from sgl_kernel import flash_ops\n"


def test_a_corrupt_piece_installs_nothing(tmp_path):
    out, manifest, _ = _kit(tmp_path)
    bad = out / manifest["pieces"][1]["name"]
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF
    bad.write_bytes(bytes(data))
    site = _site(tmp_path)
    with pytest.raises(ValueError, match=f"piece {bad.name} is corrupt"):
        fa3_kit.install(out, tmp_path / "stash", site, manifest["files"])
    assert sorted(p.name for p in (site / "sgl_kernel").iterdir()) == ["__init__.py", "flash_attn.py"]


def test_a_library_other_than_the_wheels_is_refused(tmp_path):
    """Pieces consistent with their manifest but of another library (the file SHA-256 the script
    pins differs) are not installed."""
    out, manifest, _ = _kit(tmp_path)
    files = {**manifest["files"], fa3_kit.LIBRARY: "0" * 64}
    manifest["files"] = files
    (out / "manifest.json").write_text(__import__("json").dumps(manifest))
    site = _site(tmp_path)
    with pytest.raises(ValueError, match="differs from the wheel's"):
        fa3_kit.install(out, tmp_path / "stash", site, files)
    assert not list((site / "sgl_kernel").glob("flash_ops*"))


def test_the_kit_needs_the_stripped_wheel_installed_first(tmp_path):
    out, manifest, _ = _kit(tmp_path)
    with pytest.raises(RuntimeError, match="install the kit's sglang-kernel wheel first"):
        fa3_kit.install(out, tmp_path / "stash", tmp_path / "empty_site", manifest["files"])
