"""``launch/served_speed.sh chain`` and ``collect``: runs that outlast a device step, from a copy of
the tree of their own, and their results packed for a later step to bring back."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.tools]


def test_chain_runs_its_lines_from_a_copy_of_its_own_and_collect_packs_them(tmp_path):
    """``served_speed.sh chain``: the lines run one after another, detached, with ``OUT`` and ``$S``
    set, from a copy of the tree taken at the start (a later step's copy of the checkout does not
    reach them), a failing line logged and the rest run; ``collect`` packs the results and the log
    without traces or caches."""
    import tarfile

    tree, chains, out = tmp_path / "tree", tmp_path / "chains", tmp_path / "out"
    (tree / "launch").mkdir(parents=True)
    chains.mkdir()
    shutil.copy(REPO / "launch" / "served_speed.sh", tree / "launch")
    (tree / "marker").write_text("as started\n")
    env = {**os.environ, "CHAIN_DIR": str(chains), "OUT": str(out)}
    script = str(tree / "launch" / "served_speed.sh")
    lines = [
        'sleep 1; cat marker > "$OUT/first"',
        'echo "$S" > "$OUT/second"',
        "false",
        'echo after > "$OUT/third"; echo trace > "$OUT/x.trace.json.gz"',
    ]
    subprocess.run(["bash", script, "chain", "c1", *lines], env=env, check=True, timeout=30)
    (tree / "marker").write_text("replaced by a later step\n")
    log = chains / "c1.log"
    for _ in range(100):
        if log.exists() and "chain: all done" in log.read_text():
            break
        time.sleep(0.2)
    assert (chains / "c1" / "first").read_text() == "as started\n"
    assert (chains / "c1" / "second").read_text().strip() == "bash launch/served_speed.sh run"
    assert "chain: rc=1 for: false" in log.read_text() and (chains / "c1" / "third").exists()
    subprocess.run(["bash", script, "collect", "c1", "0"], env=env, check=True, timeout=30)
    names = tarfile.open(out / "c1.tgz").getnames()
    assert "c1/first" in names and "c1.log" in names and not any("trace" in n for n in names)
