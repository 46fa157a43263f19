"""FlashAttention-3 for a GPU host without network: the kit's ``sglang-kernel`` wheel lacks
``sgl_kernel/flash_ops.abi3.so`` (1.1 GB), so it is moved to the host as compressed pieces small enough
for one step each (docs/offline-h200.md), and is joined, checked and installed there.

    python -m launch.fa3_kit split [--out .fa3] [--piece-mib 32]   # networked machine: wheel -> pieces + manifest
    python -m launch.fa3_kit join  [--src .fa3] [--site /tmp/site] # host: once per step, one piece each
    python -m launch.fa3_kit serve-check --out $OUT/fa3_serve_check.json   # host: SGLang's default backend

``split`` downloads ``sglang-kernel==0.4.5`` (the version SGLang 0.5.17 pins) with pip, takes the full
library and the unmodified ``flash_attn.py`` from it, compresses the library and cuts it into pieces;
``manifest.json`` lists every piece's SHA-256 and the joined stream's. ``join`` copies the pieces that
reached this step into ``--stash`` (they stay there for the next step), and once every piece is there
checks each one, decompresses the joined stream and installs both files over the kit's stripped
``sgl_kernel`` only when their SHA-256 are the wheel's (:data:`WHEEL_FILES`).

=======================  =========================================================================
file in ``--out``        what
=======================  =========================================================================
``manifest.json``        codec, pieces (name, bytes, sha256), joined stream (bytes, sha256), files
``flash_attn.py``        the wheel's own (the kit's copy only changed its ImportError message)
``flash_ops.abi3.so.``   the compressed library, cut into ``--piece-mib`` pieces ``.00``, ``.01``...
``<codec>.NN``
=======================  =========================================================================
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

WHEEL = "sglang-kernel==0.4.5"
# SHA-256 of the two files as the wheel's RECORD lists them: what the host installs, however it got there.
WHEEL_FILES = {
    "sgl_kernel/flash_ops.abi3.so": "b8feae71ed589f0fa8ea407718b6a59411bf6bb5aac7310abeebad0133dd4216",
    "sgl_kernel/flash_attn.py": "610747f2c68495c5f3ba67f1247f0a1b4e4f7df116e2f89cd8e8983f0271f9ac",
}
LIBRARY = "sgl_kernel/flash_ops.abi3.so"
CHUNK = 1 << 22


@dataclass(frozen=True)
class Codec:
    """A compressor whose output the host can undo without anything the kit lacks."""

    name: str
    suffix: str
    compress: tuple[str, ...]  # command reading the file named last, writing to stdout

    def __post_init__(self):
        if self.name not in ("xz", "zstd"):
            raise ValueError(f"unknown codec {self.name!r}")


CODECS = {
    # the default: smaller than zstd here, and Python's lzma undoes it on any machine (launch/results/fa3_codecs.json)
    "xz": Codec("xz", ".xz", ("xz", "-9", "-T2", "-c")),
    # needs the zstd binary on the host, with the same window (--long=27).
    "zstd": Codec("zstd", ".zst", ("zstd", "-19", "--long=27", "-T2", "-q", "-c")),
}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def download_wheel(dest: Path) -> Path:
    """The sglang-kernel wheel for the host (cp310-abi3, manylinux2014, loads on Python 3.12)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("sglang_kernel-0.4.5-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            + ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64"]
            + ["--dest", str(dest), WHEEL],
            check=True,
        )
        found = sorted(dest.glob("sglang_kernel-0.4.5-*.whl"))
    return found[0]


def extract(wheel: Path, dest: Path, files: dict[str, str] = WHEEL_FILES) -> dict[str, Path]:
    """The named files of ``wheel`` under ``dest``, each checked against its SHA-256."""
    out = {}
    with zipfile.ZipFile(wheel) as z:
        for name, digest in files.items():
            path = Path(z.extract(name, dest))
            if sha256_file(path) != digest:
                raise ValueError(f"{wheel.name}: {name} is not the file this kit expects")
            out[name] = path
    return out


def compress(path: Path, out: Path, codec: Codec) -> None:
    with open(out, "wb") as fh:
        subprocess.run([*codec.compress, str(path)], stdout=fh, check=True)


def cut(stream: Path, out_dir: Path, piece_bytes: int) -> list[dict]:
    """``stream`` cut into ``stream.name + ".NN"`` pieces of at most ``piece_bytes``."""
    pieces = []
    with open(stream, "rb") as fh:
        while block := fh.read(piece_bytes):
            piece = out_dir / f"{stream.name}.{len(pieces):02d}"
            piece.write_bytes(block)
            pieces.append(
                {"name": piece.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()}
            )
    return pieces


def write_kit(
    library: Path, attn: Path, out_dir: Path, codec: Codec, piece_bytes: int, files: dict[str, str]
) -> dict:
    """Pieces, ``flash_attn.py`` and ``manifest.json`` in ``out_dir`` (emptied first)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        stream = Path(tmp) / (library.name + codec.suffix)
        compress(library, stream, codec)
        manifest = {
            "wheel": WHEEL,
            "codec": codec.name,
            "joined": {"name": stream.name, "bytes": stream.stat().st_size, "sha256": sha256_file(stream)},
            "pieces": cut(stream, out_dir, piece_bytes),
            "files": files,
        }
    shutil.copy(attn, out_dir / "flash_attn.py")
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


class Decompressor:
    """Streaming decompression of one codec (xz in-process; zstd through its binary)."""

    def __init__(self, codec: str, out):
        self.out, self.proc = out, None
        if codec == "xz":
            self.lz = lzma.LZMADecompressor()
        elif codec == "zstd":
            if shutil.which("zstd") is None:
                raise RuntimeError(
                    "these pieces are zstd and this machine has no zstd: split with --codec xz"
                )
            self.proc = subprocess.Popen(
                ["zstd", "-d", "--long=27", "-q", "-c"], stdin=subprocess.PIPE, stdout=out
            )
        else:
            raise ValueError(f"unknown codec {codec!r}")

    def feed(self, block: bytes) -> None:
        if self.proc is None:
            self.out.write(self.lz.decompress(block))
        else:
            self.proc.stdin.write(block)

    def close(self) -> None:
        if self.proc is None:
            if not self.lz.eof:
                raise ValueError("the joined stream ends early")
            return
        self.proc.stdin.close()
        if self.proc.wait() != 0:
            raise ValueError("zstd could not decompress the joined stream")


def missing_pieces(manifest: dict, stash: Path) -> list[str]:
    return [p["name"] for p in manifest["pieces"] if not (stash / p["name"]).exists()]


def join_pieces(manifest: dict, stash: Path, out: Path) -> None:
    """The pieces in ``stash`` checked one by one, joined, decompressed into ``out`` and checked
    against the library's SHA-256; ValueError naming the first piece or stream that differs."""
    joined = hashlib.sha256()
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as fh:
        dec = Decompressor(manifest["codec"], fh)
        for p in manifest["pieces"]:
            block = (stash / p["name"]).read_bytes()
            if len(block) != p["bytes"] or hashlib.sha256(block).hexdigest() != p["sha256"]:
                tmp.unlink()
                raise ValueError(f"piece {p['name']} is corrupt (SHA-256 differs): copy it again")
            joined.update(block)
            for at in range(0, len(block), CHUNK):  # bounded output per feed: memory ~ a few chunks
                dec.feed(block[at : at + CHUNK])
        dec.close()
    if joined.hexdigest() != manifest["joined"]["sha256"]:
        tmp.unlink()
        raise ValueError("the joined stream differs from the manifest's")
    if sha256_file(tmp) != manifest["files"][LIBRARY]:
        tmp.unlink()
        raise ValueError(f"the decompressed {LIBRARY} differs from the wheel's")
    tmp.replace(out)


def stash_step(src: Path, stash: Path) -> dict:
    """The manifest, ``flash_attn.py`` and whatever pieces reached this step copied into ``stash``
    (which outlives the step); returns the manifest."""
    stash.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*")) if src.is_dir() else []:
        shutil.copy(path, stash / path.name)
    if not (stash / "manifest.json").exists():
        raise RuntimeError(f"no manifest.json in {src} or {stash}: move .fa3/manifest.json in with this step")
    return json.loads((stash / "manifest.json").read_text())


def install(src: Path, stash: Path, site: Path, files: dict[str, str] = WHEEL_FILES) -> str:
    """What this step did: its pieces stashed; with all of them, the two files installed into
    ``site/sgl_kernel`` (the kit's stripped sglang-kernel must be installed there first)."""
    manifest = stash_step(src, stash)
    if manifest["files"] != files:
        raise ValueError("manifest.json is for other files than this script's WHEEL_FILES")
    missing = missing_pieces(manifest, stash)
    if missing:
        have = len(manifest["pieces"]) - len(missing)
        return (
            f"{have} of {len(manifest['pieces'])} pieces in {stash}; still to move in: {', '.join(missing)}"
        )
    target = site / "sgl_kernel"
    if not (target / "__init__.py").exists():
        raise RuntimeError(f"no sgl_kernel in {site}: install the kit's sglang-kernel wheel first (.kit2)")
    if sha256_file(stash / "flash_attn.py") != files["sgl_kernel/flash_attn.py"]:
        raise ValueError("flash_attn.py differs from the wheel's: move .fa3/flash_attn.py in again")
    join_pieces(manifest, stash, target / Path(LIBRARY).name)
    shutil.copy(stash / "flash_attn.py", target / "flash_attn.py")
    shutil.rmtree(target / "__pycache__", ignore_errors=True)  # the stripped flash_attn's bytecode
    return f"FA3 installed in {target} ({len(manifest['pieces'])} pieces, SHA-256 checked)"


def serve_check(out: Path, timeout_s: float) -> dict:
    """``python -m sglang.launch_server`` with no ``--attention-backend`` (the Llama-3.1-8B config,
    dummy weights): healthy, the backend it chose, and one greedy ``/generate`` answered."""
    import re

    import requests

    from benchmarks.served_speed import model_dir
    from sglang_wgkv.server_process import ServerProcess, free_port

    model, port = model_dir(Path("/tmp/served_speed_model")), free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port)]
    cmd += ["--load-format", "dummy", "--context-length", "8192", "--mem-fraction-static", "0.5"]
    cmd += ["--cuda-graph-max-bs", "4", "--sampling-backend", "pytorch"]
    env = {**os.environ, "SGLANG_PLUGINS": "none"}
    srv = ServerProcess(cmd, out.with_suffix(".log"), port=port, env=env, cwd="/tmp", stop_timeout_s=60)
    result = {"kind": "fa3_serve_check", "command": " ".join(cmd)}
    try:
        result["startup_s"] = srv.wait_healthy(timeout_s, path="/health", probe_timeout_s=10)
        body = {
            "input_ids": list(range(1000, 1512)),
            "sampling_params": {"max_new_tokens": 16, "temperature": 0},
        }
        answer = requests.post(srv.url + "/generate", json=body, timeout=120).json()
        result["output_ids"] = answer.get("output_ids")
        log = srv.log_path.read_text(errors="replace")
        # "Attention backend not specified. Use fa3 backend by default." (SGLang's server_args)
        result["attention_backend"] = (re.findall(r"Use (\w+) backend by default", log) or [None])[0]
        result["ok"] = result["attention_backend"] == "fa3" and len(result["output_ids"] or []) == 16
    except Exception as exc:  # recorded: the log says why
        result |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}
    finally:
        srv.stop()
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="networked machine: wheel -> compressed pieces + manifest")
    s.add_argument("--out", default=".fa3")
    s.add_argument("--wheel-dir", default=os.path.join(tempfile.gettempdir(), "fa3_wheel"))
    s.add_argument("--piece-mib", type=int, default=32, help="the tree (~20 MiB) + one piece < 64 MiB")
    s.add_argument("--codec", choices=sorted(CODECS), default="xz")
    j = sub.add_parser("join", help="host: stash this step's pieces; with all of them, install")
    j.add_argument("--src", default=".fa3")
    j.add_argument("--stash", default="/tmp/fa3")
    j.add_argument("--site", default=os.environ.get("KIT_SITE", "/tmp/site"))
    c = sub.add_parser("serve-check", help="host: SGLang with no --attention-backend serves")
    c.add_argument("--out", default="/tmp/out/fa3_serve_check.json")
    c.add_argument("--startup-timeout", type=float, default=480)
    a = p.parse_args(argv)
    if a.cmd == "split":
        wheel = download_wheel(Path(a.wheel_dir))
        with tempfile.TemporaryDirectory() as tmp:
            got = extract(wheel, Path(tmp))
            m = write_kit(
                got[LIBRARY],
                got["sgl_kernel/flash_attn.py"],
                Path(a.out),
                CODECS[a.codec],
                a.piece_mib << 20,
                WHEEL_FILES,
            )
        print(f"{len(m['pieces'])} pieces, {m['joined']['bytes']} bytes ({m['codec']}) in {a.out}")
        for piece in m["pieces"]:
            print(piece["name"])
    elif a.cmd == "join":
        print(install(Path(a.src), Path(a.stash), Path(a.site)))
    else:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        result = serve_check(Path(a.out), a.startup_timeout)
        print(json.dumps({k: result.get(k) for k in ("ok", "attention_backend", "startup_s", "error")}))
        sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
