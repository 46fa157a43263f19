"""Corpus builder and gate trainer on a tiny random Llama (CPU, seconds)."""

import json
import math

import numpy as np
import pytest
import torch
from test_training_backbone import tiny_lm

from sglang_wgkv.gate import load_gates
from sglang_wgkv.training.backbone import Backbone
from sglang_wgkv.training.corpus import Corpus, CorpusSpec, build_corpus
from sglang_wgkv.training.trainer import GateTrainer, TrainConfig, lam_dir, lr_lambda

pytestmark = pytest.mark.training


class CharTokenizer:
    """One token per byte (ids < 97 after folding), enough for the corpus builder."""

    name_or_path = "chars"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b % 97 for b in text.encode()]}

    def __len__(self):
        return 97


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "gate", "write"]
    for i in range(40):
        n = int(rng.integers(400, 2000))
        (d / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, n)) + "\n")
    return d


def build(text_dir, out, **kw):
    spec = CorpusSpec(
        bins=(64, 128),
        train_rows=(20, 10),
        heldout_rows=(4, 2),
        heldout_percent=20,
        prefix="Summarize:\n",
        sources=(f"txt:{text_dir}/*.txt",),
        **kw,
    )
    return build_corpus(CharTokenizer(), spec, out, progress=False)


def test_corpus_bins_split_and_reload(text_dir, tmp_path):
    manifest = build(text_dir, tmp_path / "c")
    assert manifest["rows"] == {"train_64": 20, "train_128": 10, "heldout_64": 4, "heldout_128": 2}
    assert manifest["short_bins"] == {}
    c = Corpus(tmp_path / "c")
    assert c.bin("train", 128).shape == (10, 128)
    prefix = [b % 97 for b in b"Summarize:\n"]
    assert c.bin("heldout", 64)[0, : len(prefix)].tolist() == prefix
    assert c.rows("train", 64).shape == (20 + 2 * 10, 64)  # the 128 bin is cut into two rows of 64
    docs = manifest["documents"]
    train_src = {docs[i]["path"] for i in c.arrays["train_64_src"]}
    held_src = {docs[i]["path"] for i in c.arrays["heldout_64_src"]}
    assert train_src and held_src and not train_src & held_src
    again = build(text_dir, tmp_path / "c2")
    assert again["rows"] == manifest["rows"]
    np.testing.assert_array_equal(Corpus(tmp_path / "c2").bin("train", 64), c.bin("train", 64))


def test_lr_schedule_warmup_then_cosine():
    f = lr_lambda(warmup_steps=10, total_steps=100)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(100) == pytest.approx(0.0, abs=1e-12)


def make_trainer(text_dir, tmp_path, **kw):
    build(text_dir, tmp_path / "c")
    cfg = TrainConfig(
        model="tiny",
        corpus=str(tmp_path / "c"),
        out_dir=str(tmp_path / "run"),
        lams=(0.0, 1.0),
        seq_len=128,
        local_window=16,
        lr=2e-2,
        val_every=3,
        val_rows=2,
        ckpt_every=3,
        log_every=1,
        dtype="fp32",
        device="cpu",
        **kw,
    )
    return GateTrainer(cfg, backbone=Backbone(tiny_lm()))


def test_trainer_steps_checkpoints_and_resumes(text_dir, tmp_path):
    tr = make_trainer(text_dir, tmp_path, steps=6)
    before = [p.detach().clone() for p in tr.gates[1].parameters()]
    records = tr.fit(progress=False)
    assert [r["step"] for r in records] == [3, 6]
    v = records[-1]["validation"]
    assert set(v) == {"soft_mse", "hard_mse", "kv_fraction", "global_fraction"}
    assert all(len(x) == 2 for x in v.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.gates[1].parameters()))
    # λ = 1 pushes gates shut faster than λ = 0
    steps = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl") if '"sparsity"' in line]
    assert steps[-1]["sparsity"][1] < steps[-1]["sparsity"][0]
    for lam in (0.0, 1.0):
        g = load_gates(lam_dir(tmp_path / "run", lam))
        assert g.config.lam == lam and g.config.local_window == 16 and g.config.num_layers == 2
        training = json.loads((lam_dir(tmp_path / "run", lam) / "gates.json").read_text())["training"]
        assert training["step"] == 6 and training["lams"] == [0.0, 1.0] and training["seq_len"] == 128
    # a longer run picks up at step 6 with the saved optimizer state
    tr2 = make_trainer(text_dir, tmp_path, steps=8)
    assert tr2.resume() and tr2.step == 6
    for a, b in zip(tr.gates[1].parameters(), tr2.gates[1].parameters()):
        torch.testing.assert_close(a, b)
    tr2.fit(progress=False)
    assert tr2.step == 8


def test_resume_refuses_other_lams(text_dir, tmp_path):
    make_trainer(text_dir, tmp_path, steps=3).fit(progress=False)
    build(text_dir, tmp_path / "c")
    cfg = TrainConfig(
        model="tiny",
        corpus=str(tmp_path / "c"),
        out_dir=str(tmp_path / "run"),
        lams=(0.5,),
        seq_len=128,
        local_window=16,
        steps=3,
        dtype="fp32",
        device="cpu",
    )
    with pytest.raises(ValueError, match="lams"):
        GateTrainer(cfg, backbone=Backbone(tiny_lm())).resume()


def test_train_config_validation():
    with pytest.raises(ValueError):
        TrainConfig(model="m", corpus="c", out_dir="o", lams=())
    with pytest.raises(ValueError):
        TrainConfig(model="m", corpus="c", out_dir="o", seq_len=128, local_window=256)


def test_sigterm_checkpoints_the_step_in_flight_and_resumes(text_dir, tmp_path):
    """`timeout` ends a time-limited run with SIGTERM: the run saves the step it reached (not a ckpt_every multiple)."""
    import os
    import signal

    tr = make_trainer(text_dir, tmp_path, steps=9)
    step = tr.train_step

    def step_then_signal():
        out = step()
        if tr.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    tr.train_step = step_then_signal
    before = signal.getsignal(signal.SIGTERM)
    tr.fit(progress=False)
    assert tr.step == 4 and signal.getsignal(signal.SIGTERM) is before
    tr2 = make_trainer(text_dir, tmp_path, steps=9)
    assert tr2.resume() and tr2.step == 4
    for a, b in zip(tr.gates[0].parameters(), tr2.gates[0].parameters()):
        torch.testing.assert_close(a, b)
    assert any('"stopped_by": "SIGTERM"' in line for line in open(tmp_path / "run" / "log.jsonl"))
    tr2.fit(progress=False)
    assert tr2.step == 9
