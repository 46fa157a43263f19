"""AIME-style reasoning eval against a running server's OpenAI API (paper §5.4, App. K).

Each problem is asked ``--samples`` times as one chat message::

    Question: {problem}
    Please reason step by step, and put your final answer within \\boxed{}.

with temperature 0.6, top_p 0.95, top_k 20 (sent as an extra body field, which SGLang accepts) and
``--max-tokens`` (the paper: 81,920). The last ``\\boxed{...}`` of the reply (nested braces allowed;
the reasoning text is searched when the answer text has none) is compared with the reference after
normalization; pass@1 is the mean over samples, averaged over problems.

Cache statistics are read from each response's ``usage`` when the server reports them, at the top
level or under ``usage["wgkv"]``: ``mean_kv_tokens_per_head`` (ring + global tokens per KV head,
averaged over layers and heads, at the end of the request) and ``eviction_triggers`` (eviction
events of the request). Absent fields are reported as null.

Usage::

    python -m evals.aime25 --base-url http://127.0.0.1:30000/v1 --model default \\
        --problems aime25.jsonl --samples 4 --concurrency 16 --output report.json

``--problems`` is a JSONL file of ``{"problem": str, "answer": str | int}``; the default is the small
sample shipped for tests (``evals/data/aime_sample.jsonl``, simple problems of our own, no AIME).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPT = "Question: {problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
DEFAULT_PROBLEMS = Path(__file__).parent / "data" / "aime_sample.jsonl"
USAGE_GROUP = "wgkv"
KV_FIELD, TRIGGER_FIELD = "mean_kv_tokens_per_head", "eviction_triggers"


# -- answers ------------------------------------------------------------------------------------
def last_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if
    there is none or it is not closed."""
    if not text:
        return None
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def normalize(answer) -> str:
    """Canonical form for exact match: LaTeX spacing and wrappers dropped; a plain number (AIME
    answers are integers 0..999, written with or without leading zeros) in canonical decimal form."""
    s = str(answer).strip()
    s = _TEXT.sub(r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"[+-]?\d+", s):
        s = str(int(s))
    elif re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+)", s):
        value = float(s)
        s = str(int(value)) if value.is_integer() else repr(value)
    return s


def is_correct(predicted: str | None, reference) -> bool:
    return predicted is not None and normalize(predicted) == normalize(reference)


# -- requests -----------------------------------------------------------------------------------
@dataclass
class Sample:
    problem: int
    sample: int
    predicted: str | None = None
    correct: bool = False
    completion_tokens: int | None = None
    finish_reason: str | None = None
    kv_tokens_per_head: float | None = None
    eviction_triggers: int | None = None
    error: str | None = None
    seconds: float = 0.0


def usage_field(usage: dict | None, name: str):
    """``usage[name]`` or ``usage["wgkv"][name]`` (None when the server does not report it)."""
    if not usage:
        return None
    if name in usage:
        return usage[name]
    group = usage.get(USAGE_GROUP)
    return group.get(name) if isinstance(group, dict) else None


@dataclass
class Settings:
    model: str
    max_tokens: int = 81920
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    retries: int = 2


def ask(client, settings: Settings, problem: str, reference, index: int, sample: int) -> Sample:
    """One chat completion, scored; failures after ``settings.retries`` retries are recorded."""
    out = Sample(index, sample)
    start = time.monotonic()
    for attempt in range(settings.retries + 1):
        try:
            resp = client.chat.completions.create(
                model=settings.model,
                messages=[{"role": "user", "content": PROMPT.format(problem=problem)}],
                temperature=settings.temperature,
                top_p=settings.top_p,
                max_tokens=settings.max_tokens,
                extra_body={"top_k": settings.top_k},
            )
            break
        except Exception as e:  # noqa: BLE001 - any client/server failure is retried, then recorded
            out.error = f"{type(e).__name__}: {e}"
            if attempt == settings.retries:
                out.seconds = time.monotonic() - start
                return out
    out.error = None
    choice = resp.choices[0]
    message = choice.message
    reasoning = getattr(message, "reasoning_content", None)  # servers run with a reasoning parser
    out.predicted = last_boxed(message.content) or last_boxed(reasoning)
    out.correct = is_correct(out.predicted, reference)
    out.finish_reason = choice.finish_reason
    usage = resp.usage.model_dump() if resp.usage is not None else None
    out.completion_tokens = usage_field(usage, "completion_tokens")
    out.kv_tokens_per_head = usage_field(usage, KV_FIELD)
    out.eviction_triggers = usage_field(usage, TRIGGER_FIELD)
    out.seconds = time.monotonic() - start
    return out


def load_problems(path: Path) -> list[dict]:
    problems = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "problem" not in row or "answer" not in row:
                raise ValueError(f"{path}:{line_no}: each line needs 'problem' and 'answer'")
            problems.append(row)
    if not problems:
        raise ValueError(f"{path}: no problems")
    return problems


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def report(problems: list[dict], samples: list[Sample], settings: Settings, base_url: str, k: int) -> dict:
    """Accuracy = pass@1 averaged over problems (each problem: fraction of its k samples correct)."""
    by_problem = [[s for s in samples if s.problem == i] for i in range(len(problems))]
    per_problem = [
        {
            "problem": i,
            "answer": str(p["answer"]),
            "pass@1": statistics.fmean(s.correct for s in rows),
            "predicted": [s.predicted for s in rows],
        }
        for i, (p, rows) in enumerate(zip(problems, by_problem))
    ]
    return {
        "model": settings.model,
        "base_url": base_url,
        "num_problems": len(problems),
        "samples_per_problem": k,
        "sampling": {
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
            "max_tokens": settings.max_tokens,
        },
        "accuracy": statistics.fmean(row["pass@1"] for row in per_problem),
        "pass@k": statistics.fmean(any(s.correct for s in rows) for rows in by_problem),
        "mean_completion_tokens": _mean(s.completion_tokens for s in samples),
        "mean_kv_tokens_per_head": _mean(s.kv_tokens_per_head for s in samples),
        "mean_eviction_triggers": _mean(s.eviction_triggers for s in samples),
        "truncated": sum(s.finish_reason == "length" for s in samples),
        "errors": sum(s.error is not None for s in samples),
        "problems": per_problem,
        "samples": [asdict(s) for s in samples],
    }


def run(
    problems: list[dict], client, settings: Settings, k: int, concurrency: int, progress: bool = True
) -> list[Sample]:
    from tqdm import tqdm

    jobs = [(i, j) for i in range(len(problems)) for j in range(k)]
    results = []
    with (
        ThreadPoolExecutor(max_workers=concurrency) as pool,
        tqdm(total=len(jobs), desc="aime25", unit="sample", disable=not progress) as bar,
    ):
        futures = [
            pool.submit(ask, client, settings, problems[i]["problem"], problems[i]["answer"], i, j)
            for i, j in jobs
        ]
        for future in as_completed(futures):
            sample = future.result()
            results.append(sample)
            bar.update(1)
            bar.set_postfix(acc=f"{statistics.fmean(s.correct for s in results):.3f}")
    return sorted(results, key=lambda s: (s.problem, s.sample))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1", help="OpenAI API root of the server")
    p.add_argument("--model", default="default", help="model name sent in each request")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument(
        "--problems", type=Path, default=DEFAULT_PROBLEMS, help="JSONL with 'problem' and 'answer'"
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N problems")
    p.add_argument("--samples", "-k", type=int, default=1, help="samples per problem (pass@1 over them)")
    p.add_argument("--max-tokens", type=int, default=81920)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--output", type=Path, default=None, help="JSON report path (default: stdout only)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("samples", "max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    from openai import OpenAI

    args = parse_args(argv)
    problems = load_problems(args.problems)[: args.limit]
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=args.timeout, max_retries=0)
    settings = Settings(args.model, args.max_tokens, args.temperature, args.top_p, args.top_k, args.retries)
    samples = run(problems, client, settings, args.samples, args.concurrency, progress=not args.no_progress)
    result = report(problems, samples, settings, args.base_url, args.samples)
    text = json.dumps(result, indent=2)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    summary = {
        key: result[key]
        for key in (
            "accuracy",
            "pass@k",
            "mean_completion_tokens",
            "mean_kv_tokens_per_head",
            "mean_eviction_triggers",
            "truncated",
            "errors",
        )
    }
    print(json.dumps(summary), file=sys.stdout)
    return result


if __name__ == "__main__":
    main()
