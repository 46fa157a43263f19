"""The background runner of interpreter checks (sglang_wgkv/testing/interp.py) on stand-in scripts."""

import time

import pytest

from sglang_wgkv.testing.interp import InterpCheck, InterpRunner, assert_seed_ok, seed_lines

pytestmark = pytest.mark.core

SCRIPT = """
import os, sys, time
print(os.environ["TRITON_INTERPRET"], repr(os.environ["CUDA_VISIBLE_DEVICES"]), *sys.argv[1:], flush=True)
time.sleep(float(os.environ.get("SLEEP_S", "0")) if "sleep" not in sys.argv else 60)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "check.py"
    path.write_text(SCRIPT)
    return str(path)


def test_checks_run_interpreted_on_cpu_with_their_arguments(script):
    runner = InterpRunner()
    try:
        first, second = InterpCheck(script, ("a", "1")), InterpCheck(script, ("b",))
        runner.submit(first)
        assert runner.result(second).stdout.split() == ["1", "''", "b"]
        assert runner.result(first).stdout.split() == ["1", "''", "a", "1"]
        assert runner.result(first).returncode == 0
    finally:
        runner.close()


def test_a_check_past_its_timeout_is_killed_and_says_so(script):
    runner = InterpRunner()
    try:
        result = runner.result(InterpCheck(script, ("sleep",), timeout=2))
        assert result.returncode != 0 and "timed out after 2" in result.stderr
    finally:
        runner.close()


def test_close_ends_running_checks(script):
    runner = InterpRunner()
    runner.submit(InterpCheck(script, ("sleep",), timeout=600))
    time.sleep(1)
    start = time.monotonic()
    runner.close()
    assert time.monotonic() - start < 30


STAMP = """
import pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text(str(time.monotonic()))
time.sleep(float(sys.argv[2]))
"""


def test_one_check_at_a_time_and_one_more_while_a_result_is_awaited(tmp_path):
    path = tmp_path / "stamp.py"
    path.write_text(STAMP)
    runner = InterpRunner()
    try:
        first, second, third = (InterpCheck(str(path), (str(tmp_path / name), "3")) for name in "abc")
        for check in (first, second, third):
            runner.submit(check)
        time.sleep(1.5)
        assert (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # the test process runs
        runner.result(third)  # waiting: the second runs beside the first, then the third
        started = {name: float((tmp_path / name).read_text()) for name in "abc"}
        assert started["b"] - started["a"] < 2.5 and started["c"] - started["a"] < 5
    finally:
        runner.close()


def test_seed_lines_and_verdicts():
    class Run:
        stdout = "ok seed 1: 3 pages\nFAIL seed 2/8: SystemExit: differs\nnoise\n"
        returncode, stderr = 1, ""

    assert seed_lines(Run.stdout) == {"1": "ok seed 1: 3 pages", "2/8": "FAIL seed 2/8: SystemExit: differs"}
    assert assert_seed_ok(Run, 1) == "ok seed 1: 3 pages"
    with pytest.raises(AssertionError):
        assert_seed_ok(Run, "2/8")
    with pytest.raises(AssertionError):
        assert_seed_ok(Run, 3)

    class Crashed:
        stdout, returncode, stderr = "ok seed 1\n", 1, "Segmentation fault"

    with pytest.raises(AssertionError, match="Segmentation"):
        assert_seed_ok(Crashed, 1)


def test_discarded_checks_end_or_never_start(tmp_path, script):
    path = tmp_path / "stamp.py"
    path.write_text(STAMP)
    runner = InterpRunner()
    try:
        running, queued = InterpCheck(script, ("sleep",)), InterpCheck(str(path), (str(tmp_path / "q"), "0"))
        runner.submit(running)
        runner.submit(queued)
        time.sleep(1)
        start = time.monotonic()
        runner.discard(queued)
        runner.discard(running)  # killed: the slot is free again
        kept = InterpCheck(script, ("c",))
        assert runner.result(kept).stdout.split() == ["1", "''", "c"]
        assert time.monotonic() - start < 30 and not (tmp_path / "q").exists()
        with pytest.raises(RuntimeError, match="discarded"):
            runner.submit(running)
    finally:
        runner.close()
