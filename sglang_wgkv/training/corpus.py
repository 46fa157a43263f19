"""Offline training corpus: local text (Python stdlib and its docs, /usr/share/doc, CMake's manual,
license texts) tokenized into fixed-length rows binned by length, with a held-out split.

Layout of a built corpus directory::

    corpus.npz      train_{L} / heldout_{L}: uint16 [rows, L] token ids for each bin L,
                    plus train_{L}_src / heldout_{L}_src: int32 [rows] indices into manifest "documents"
    manifest.json   tokenizer, bins, prefix, per-bin row counts, the documents used (path, source kind)

A document goes wholly to one split (by a stable hash of its path), so held-out rows never share text
with training rows. Each row is ``prefix`` tokens followed by a contiguous slice of one document.
"""

import glob
import gzip
import hashlib
import json
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

BINS = (1024, 2048, 4096, 8192)
PREFIX = "<|im_start|>user\nPlease analyze and summarize the following text:\n\n"
_MIN_CHARS = 2000


@dataclass(frozen=True)
class CorpusSpec:
    """What to build. ``train_rows`` / ``heldout_rows`` give the row count per bin."""

    bins: tuple[int, ...] = BINS
    train_rows: tuple[int, ...] = (128, 128, 224, 112)
    heldout_rows: tuple[int, ...] = (24, 24, 16, 12)
    heldout_percent: int = 10
    max_doc_tokens: int = 16384
    prefix: str = PREFIX
    seed: int = 0
    sources: tuple[str, ...] = field(default_factory=lambda: tuple(default_sources()))

    def __post_init__(self):
        if not (len(self.bins) == len(self.train_rows) == len(self.heldout_rows)):
            raise ValueError("bins, train_rows and heldout_rows must have the same length")
        if list(self.bins) != sorted(self.bins) or min(self.bins) <= 0:
            raise ValueError(f"bins must be positive and increasing, got {self.bins}")
        if not 0 < self.heldout_percent < 100:
            raise ValueError(f"heldout_percent must be in (0, 100), got {self.heldout_percent}")


def default_sources() -> list[str]:
    """``kind:glob`` patterns of the text this machine has; ``pydoc-topics`` is the stdlib's doc text."""
    stdlib = sysconfig.get_paths()["stdlib"]
    return [
        "pydoc-topics:",
        f"python-stdlib:{stdlib}/[a-z]*.py",
        f"python-stdlib:{stdlib}/[a-z]*/[a-z]*.py",
        "debian-doc:/usr/share/doc/**/*.txt",
        "debian-doc:/usr/share/doc/**/*.md",
        "debian-doc:/usr/share/doc/**/*.rst",
        "cmake-doc:/usr/share/cmake*/Help/**/*.rst",
        "license:/usr/share/common-licenses/*",
    ]


def iter_documents(sources: tuple[str, ...]) -> Iterator[tuple[str, str, str]]:
    """Yield ``(kind, path, text)`` for each readable, mostly-printable file of at least 2,000 chars."""
    for spec in sources:
        kind, _, pattern = spec.partition(":")
        if kind == "pydoc-topics":
            from pydoc_data.topics import topics

            yield kind, "pydoc_data.topics", "\n\n".join(topics[k] for k in sorted(topics))
            continue
        root_len = len(re.split(r"[*?\[]", pattern, maxsplit=1)[0])
        for path in sorted(glob.glob(pattern, recursive=True)):
            # Test suites and third-party packages under a matched tree are not the text we want.
            parts = Path(path[root_len:]).parts
            if any(p.startswith("test") or p in ("site-packages", "idle_test") for p in parts[:-1]):
                continue
            if not Path(path).is_file():
                continue
            text = _read_text(path)
            if text is not None:
                yield kind, path, text


def _read_text(path: str) -> str | None:
    try:
        raw = gzip.open(path).read() if path.endswith(".gz") else Path(path).read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None
    if len(text) < _MIN_CHARS:
        return None
    printable = sum(c.isprintable() or c in "\n\t" for c in text[:20000]) / min(len(text), 20000)
    return text if printable > 0.97 else None


def _split_of(path: str, heldout_percent: int) -> str:
    h = int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if h < heldout_percent else "train"


def build_corpus(tokenizer, spec: CorpusSpec, out_dir: str | Path, progress: bool = True) -> dict:
    """Tokenize the spec's sources into ``out_dir`` (see module docstring); returns the manifest.

    Documents are visited in a seeded shuffle, interleaving source kinds, truncated to
    ``max_doc_tokens`` and cut into consecutive rows; each row goes to the bin that is least full (relative to its quota) among those it fits.
    """
    from tqdm import tqdm

    rng = np.random.default_rng(spec.seed)
    prefix = tokenizer(spec.prefix, add_special_tokens=False)["input_ids"]
    by_kind: dict[str, list[tuple[str, str, str]]] = {}
    for kind, path, text in iter_documents(spec.sources):
        by_kind.setdefault(kind, []).append((kind, path, text))
    for docs in by_kind.values():
        rng.shuffle(docs)
    order = _interleave(list(by_kind.values()))
    quota = {
        "train": dict(zip(spec.bins, spec.train_rows)),
        "heldout": dict(zip(spec.bins, spec.heldout_rows)),
    }
    rows = {(s, b): [] for s in quota for b in spec.bins}
    documents = []
    bar = tqdm(total=sum(spec.train_rows) + sum(spec.heldout_rows), desc="corpus rows", disable=not progress)
    for kind, path, text in order:
        split = _split_of(path, spec.heldout_percent)
        if all(len(rows[split, b]) >= quota[split][b] for b in spec.bins):
            if all(len(rows[s, b]) >= quota[s][b] for s in quota for b in spec.bins):
                break
            continue
        # A cap per document keeps a few huge changelogs from dominating the mix.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: spec.max_doc_tokens]
        doc_index = len(documents)
        used = False
        start = 0
        while True:
            remaining = len(ids) - start
            fits = [
                b for b in spec.bins if b - len(prefix) <= remaining and len(rows[split, b]) < quota[split][b]
            ]
            if not fits:
                break
            b = min(fits, key=lambda L: (len(rows[split, L]) / quota[split][L], -L))
            body = ids[start : start + b - len(prefix)]
            rows[split, b].append((prefix + body, doc_index))
            start += len(body)
            used = True
            bar.update(1)
        if used:
            documents.append({"path": path, "kind": kind, "split": split, "tokens": len(ids)})
    bar.close()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for (split, b), rs in rows.items():
        arrays[f"{split}_{b}"] = np.array([r for r, _ in rs], dtype=np.uint16).reshape(len(rs), b)
        arrays[f"{split}_{b}_src"] = np.array([d for _, d in rs], dtype=np.int32)
    np.savez_compressed(out_dir / "corpus.npz", **arrays)
    manifest = {
        "spec": asdict(spec),
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "vocab_size": len(tokenizer),
        "rows": {f"{s}_{b}": len(rs) for (s, b), rs in rows.items()},
        "documents": documents,
    }
    manifest["short_bins"] = {
        f"{s}_{b}": [len(rs), quota[s][b]] for (s, b), rs in rows.items() if len(rs) < quota[s][b]
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _interleave(lists: list[list]) -> list:
    out, i = [], 0
    while any(i < len(lst) for lst in lists):
        out.extend(lst[i] for lst in lists if i < len(lst))
        i += 1
    return out


class Corpus:
    """A built corpus: ``rows(split, length)`` returns ``[N, length]`` int64 token rows.

    Rows of a longer bin are cut into ``length``-token pieces, so a 4K trainer also uses the 8K bin.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if not (path / "corpus.npz").is_file():
            raise FileNotFoundError(
                f"{path}: no corpus.npz (build one with `python -m sglang_wgkv.training corpus`)"
            )
        data = np.load(path / "corpus.npz")
        self.arrays = {k: data[k] for k in data.files}
        self.manifest = json.loads((path / "manifest.json").read_text())
        self.bins = tuple(self.manifest["spec"]["bins"])

    def bin(self, split: str, length: int) -> np.ndarray:
        return self.arrays[f"{split}_{length}"].astype(np.int64)

    def rows(self, split: str, length: int) -> np.ndarray:
        pieces = []
        for b in self.bins:
            if b < length:
                continue
            a = self.bin(split, b)
            n = b // length
            pieces.append(a[:, : n * length].reshape(-1, length))
        if not pieces:
            raise ValueError(f"no bin of the corpus is at least {length} tokens long (bins {self.bins})")
        return np.concatenate(pieces)
