"""evals/aime25.py: answer extraction and scoring, and the CLI against a fake OpenAI HTTP server."""

import importlib.util
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# evals/ is not an installed package: load the CLI module from its file.
_spec = importlib.util.spec_from_file_location("evals_aime25", ROOT / "evals" / "aime25.py")
aime25 = sys.modules["evals_aime25"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aime25)

pytestmark = pytest.mark.evictor


@pytest.mark.parametrize(
    "text,want",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{7}", "7"),  # the last one counts
        (r"\boxed{\frac{1}{\sqrt{2}}} done", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"\boxed {  12 }", "12"),
        (r"\fbox{3}", "3"),
        (r"\boxed{5", None),  # never closed
        ("no box here", None),
        (None, None),
        (r"\boxed{a} and \boxed{b{c}", None),  # the last is unclosed
    ],
)
def test_last_boxed(text, want):
    assert aime25.last_boxed(text) == want


@pytest.mark.parametrize(
    "pred,ref,ok",
    [
        ("042", 42, True),
        ("42.", "42", True),
        ("$42$", "42", True),
        (r"\text{42}", "42", True),
        ("1,000", "1000", True),
        ("42.0", "42", True),
        (r"\dfrac{1}{2}", r"\frac{1}{2}", True),
        (r"\left( 1, 2 \right)", "(1,2)", True),
        (r"90^\circ", "90", True),
        ("43", "42", False),
        ("4 2", "42", True),
        ("0.5", r"\frac{1}{2}", False),
        (None, "42", False),
        ("-7", "7", False),
        ("12345678901234567891", "12345678901234567890", False),
    ],
)
def test_is_correct(pred, ref, ok):
    assert aime25.is_correct(pred, ref) is ok


def test_load_problems_rejects_rows_without_answer(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"problem": "1+1?", "answer": 2}\n\n{"problem": "2+2?"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3"):
        aime25.load_problems(path)


def test_shipped_sample_loads():
    problems = aime25.load_problems(aime25.DEFAULT_PROBLEMS)
    assert len(problems) >= 5 and all(aime25.normalize(p["answer"]).isdigit() for p in problems)


# -- a fake OpenAI server -------------------------------------------------------------------------
PROBLEMS = [  # (problem, answer, behaviour)
    ("What is 17 + 25?", "42", "correct, usage grouped"),
    ("What is 2^10 mod 7?", "2", "answer only in reasoning_content, usage flat"),
    ("How many divisors does 36 have?", "9", "text-wrapped box"),
    ("Sum of 1..10?", "55", "wrong, truncated"),
    ("Smallest prime above 50?", "53", "first call right, second wrong"),
    ("If 3x + 7 = 25, what is x?", "6", "first call fails with HTTP 500"),
]


class FakeOpenAI(BaseHTTPRequestHandler):
    requests = []
    calls = {}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        if self.path != "/v1/chat/completions":
            return self._reply(404, {"error": {"message": "not found"}})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][0]["content"]
        index = next(i for i, (p, _, _) in enumerate(PROBLEMS) if content.startswith(f"Question: {p}\n"))
        with self.lock:
            self.requests.append(body)
            call = self.calls[index] = self.calls.get(index, 0) + 1
        message, finish, usage = (
            {"role": "assistant", "content": f"Thus \\boxed{{{PROBLEMS[index][1]}}}."},
            "stop",
            {"prompt_tokens": 20, "completion_tokens": 10 * (index + 1), "total_tokens": 0},
        )
        if index == 0:
            usage["wgkv"] = {"mean_kv_tokens_per_head": 100.0, "eviction_triggers": 2}
        elif index == 1:
            message = {"role": "assistant", "content": "See above.", "reasoning_content": "so \\boxed{2}"}
            usage.update(mean_kv_tokens_per_head=50.0, eviction_triggers=0)
        elif index == 2:
            message["content"] = "\\boxed{\\text{9}}"
        elif index == 3:
            message["content"], finish = "\\boxed{54}", "length"
        elif index == 4 and call == 2:
            message["content"] = "\\boxed{5{3}}"
        elif index == 5 and call == 1:
            return self._reply(500, {"error": {"message": "try again"}})
        self._reply(
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
            },
        )


@pytest.fixture
def fake_server():
    FakeOpenAI.requests, FakeOpenAI.calls = [], {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_cli_end_to_end_against_fake_server(fake_server, tmp_path):
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a, _ in PROBLEMS))
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "evals.aime25",
            "--base-url",
            fake_server,
            "--model",
            "m1",
            "--problems",
            str(problems),
            "--samples",
            "2",
            "--concurrency",
            "4",
            "--max-tokens",
            "128",
            "--output",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "aime25" in proc.stderr  # the progress bar
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rep = json.loads(out.read_text())
    assert summary["accuracy"] == rep["accuracy"] == pytest.approx(4.5 / 6)
    assert rep["pass@k"] == pytest.approx(5 / 6)
    assert [p["pass@1"] for p in rep["problems"]] == [1.0, 1.0, 1.0, 0.0, 0.5, 1.0]
    assert rep["mean_kv_tokens_per_head"] == pytest.approx(75.0)
    assert rep["mean_eviction_triggers"] == pytest.approx(1.0)
    assert rep["truncated"] == 2 and rep["errors"] == 0
    assert rep["mean_completion_tokens"] == pytest.approx(35.0)
    assert len(rep["samples"]) == 12
    assert len(FakeOpenAI.requests) == 12 + 1  # one retry after the 500
    for body in FakeOpenAI.requests:
        assert body["model"] == "m1" and body["max_tokens"] == 128
        assert body["temperature"] == 0.6 and body["top_p"] == 0.95 and body["top_k"] == 20
        (msg,) = body["messages"]
        assert msg["role"] == "user"
        assert msg["content"].endswith(
            "\nPlease reason step by step, and put your final answer within \\boxed{}."
        )


def test_failures_are_recorded_not_raised(fake_server):
    from openai import OpenAI

    client = OpenAI(base_url=fake_server, api_key="x", max_retries=0)
    settings = aime25.Settings("m", max_tokens=16, retries=0)
    problems = [{"problem": PROBLEMS[5][0], "answer": "6"}, {"problem": PROBLEMS[0][0], "answer": "42"}]
    samples = aime25.run(problems, client, settings, k=1, concurrency=2, progress=False)
    rep = aime25.report(problems, samples, settings, fake_server, 1)
    assert rep["errors"] == 1 and "500" in rep["samples"][0]["error"]
    assert rep["accuracy"] == 0.5
    assert rep["mean_kv_tokens_per_head"] == 100.0


def test_bad_cli_arguments_exit_with_usage_error():
    with pytest.raises(SystemExit):
        aime25.parse_args(["--samples", "0"])
