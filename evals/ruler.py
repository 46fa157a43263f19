"""RULER-style synthetic long-context tasks, generated offline and stored as token ids.

Tasks (Hsieh et al., 2024, simplified to one query each):

* ``passkey`` -- a 5-digit pass key hidden in repeated filler sentences.
* ``niah_multikey`` -- four "special magic number" needles with different keys hidden in held-out
  corpus text; the question names one key (7-digit answer).
* ``vt`` -- variable tracking: a chain ``VAR A = 12345, VAR B = VAR A, ...`` spread through filler; the
  question asks for the variables that hold the value (answer: the chain's names in order).

Each sample is ``{"task", "length", "prompt": [ids], "answer": [ids]}`` in the SmolLM2 chat format,
ending with an answer prefix so that the answer tokens come next (numeric answers: the prefix ends
with the space token, which SmolLM2's tokenizer keeps apart from the digits). A model answers correctly when
greedy decoding emits exactly the answer tokens, i.e. when every answer token is the argmax under
teacher forcing (scored by :mod:`evals.run`). ``len(prompt) + len(answer) <= length``.

CLI: ``python -m evals.ruler --tokenizer DIR --corpus DIR --out FILE [--lengths ...] [--samples N]``.
"""

import argparse
import gzip
import json
import random
from pathlib import Path

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_WORDS = (
    "apple",
    "river",
    "candle",
    "falcon",
    "marble",
    "violin",
    "harbor",
    "pepper",
    "glacier",
    "lantern",
    "orchid",
    "saddle",
    "thunder",
    "walnut",
    "copper",
    "meadow",
    "anchor",
    "biscuit",
    "compass",
    "dolphin",
    "ember",
    "fossil",
    "garnet",
    "hazel",
    "igloo",
    "jasmine",
    "kettle",
    "lagoon",
    "mosaic",
    "nectar",
)
TASKS = ("passkey", "niah_multikey", "vt")


class _Builder:
    def __init__(self, tokenizer, haystack_ids: list[list[int]]):
        self.tok = tokenizer
        self.haystack_ids = haystack_ids
        self.noise = self.ids(NOISE)

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def assemble(
        self,
        rng,
        head: str,
        needles: list[str],
        tail: str,
        answer: str,
        length: int,
        haystack: str,
        depths: list[float] | None = None,
    ) -> dict:
        head_ids, tail_ids, answer_ids = self.ids(head), self.ids(tail), self.ids(answer)
        needle_ids = [self.ids("\n" + n + "\n") for n in needles]
        room = length - len(head_ids) - len(tail_ids) - len(answer_ids) - sum(map(len, needle_ids))
        if room <= 0:
            raise ValueError(f"length {length} leaves no room for the haystack")
        if haystack == "noise":
            hay = (self.noise * max(1, room // len(self.noise)))[:room]
        else:
            hay = []
            for row in rng.sample(self.haystack_ids, len(self.haystack_ids)):
                hay.extend(row)
                if len(hay) >= room:
                    break
            hay = hay[:room]
        depths = depths if depths is not None else sorted(rng.random() for _ in needles)
        cuts = [int(d * len(hay)) for d in depths]
        body, prev = [], 0
        for cut, nid in sorted(zip(cuts, needle_ids), key=lambda x: x[0]):
            body.extend(hay[prev:cut])
            body.extend(nid)
            prev = cut
        body.extend(hay[prev:])
        return {"prompt": head_ids + body + tail_ids, "answer": answer_ids}

    def passkey(self, rng, length):
        key = str(rng.randint(10000, 99999))
        head = (
            "<|im_start|>user\nThere is an important info hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the important information there.\n\n"
        )
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        tail = "\n\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is "
        return self.assemble(rng, head, [needle], tail, key, length, "noise")

    def niah_multikey(self, rng, length):
        words = rng.sample(KEY_WORDS, 4)
        values = [str(rng.randint(1000000, 9999999)) for _ in words]
        target = rng.randrange(len(words))
        head = (
            "<|im_start|>user\nSome special magic numbers are hidden within the following text. "
            "Make sure to memorize it. I will quiz you about the numbers afterwards.\n\n"
        )
        needles = [f"One of the special magic numbers for {w} is: {v}." for w, v in zip(words, values)]
        tail = (
            f"\n\nWhat is the special magic number for {words[target]} mentioned in the provided text?"
            f"<|im_end|>\n<|im_start|>assistant\nThe special magic number for {words[target]} "
            "mentioned in the provided text is: "
        )
        return self.assemble(rng, head, needles, tail, values[target], length, "corpus")

    def vt(self, rng, length, hops: int = 4):
        names = []
        while len(names) < hops + 1:
            name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}."] + [
            f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)
        ]
        head = (
            "<|im_start|>user\nMemorize and track the chain(s) of variable assignment hidden in the "
            "following text.\n\n"
        )
        tail = (
            f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above."
            f"<|im_end|>\n<|im_start|>assistant\nAnswer: According to the chain(s) of variable assignment "
            f"in the text above, {hops + 1} variables are assigned the value {value}, they are:"
        )
        depths = sorted(rng.random() for _ in chain)
        return self.assemble(rng, head, chain, tail, " " + " ".join(names), length, "noise", depths)


def load_samples(
    path: str | Path, samples: int | None = None, lengths: str | None = None, tasks: str | None = None
) -> list[dict]:
    """The samples of a file written by this module (``.json`` or ``.json.gz``), optionally only the
    first ``samples`` per (task, length) and the comma-separated ``lengths`` / ``tasks`` (the filters
    every consumer takes: evals.run, evals.served and evals.prompt_window then see one sample set)."""
    raw = Path(path).read_bytes()
    out = json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)["samples"]
    if samples is not None:
        out = [s for s in out if int(s["index"]) < samples]
    if lengths:
        keep = {int(x) for x in lengths.split(",")}
        out = [s for s in out if int(s["length"]) in keep]
    if tasks:
        out = [s for s in out if s["task"] in tasks.split(",")]
    return out


def generate(
    tokenizer,
    haystack_ids: list[list[int]],
    tasks=TASKS,
    lengths=(2048, 4096, 8192),
    samples: int = 16,
    seed: int = 0,
) -> list[dict]:
    """All samples, deterministic in ``seed``; ``haystack_ids`` are held-out corpus rows (prefix removed)."""
    b = _Builder(tokenizer, haystack_ids)
    out = []
    for task in tasks:
        for length in lengths:
            rng = random.Random(f"{seed}-{task}-{length}")
            for i in range(samples):
                s = getattr(b, task)(rng, length)
                out.append({"task": task, "length": length, "index": i, **s})
    return out


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from sglang_wgkv.training.corpus import Corpus

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory")
    p.add_argument("--corpus", required=True, help="built corpus (held-out rows give the NIAH haystack)")
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    corpus = Corpus(a.corpus)
    n_prefix = len(tok(corpus.manifest["spec"]["prefix"], add_special_tokens=False)["input_ids"])
    hay = [row[n_prefix:].tolist() for L in corpus.bins for row in corpus.bin("heldout", L)]
    samples = generate(
        tok, hay, a.tasks.split(","), [int(x) for x in a.lengths.split(",")], a.samples, a.seed
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"tokenizer": a.tokenizer, "seed": a.seed, "samples": samples}))
    print(f"{len(samples)} samples -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
