"""The accuracy summary of an ``evals.run`` result: one row per method at equal memory.

``python -m evals.summary OUT.json RESULTS.json [MORE.json ...]`` (several results: shards of one
evaluation over disjoint samples, pooled per sample) writes ``{"rows": [{"method", "kv_fraction", "nll",
"passkey", "niah_mk", "full_nll", "full_passkey", "full_niah_mk", "lam", "n", "*_answer_nll"}], "command",
"source"}``:
``nll`` is the continuation NLL on held-out corpus rows (``nll_cont``), ``passkey`` / ``niah_mk`` the
task accuracies, ``kv_fraction`` the mean over every sample of the method, all lengths pooled; the
``full_*`` fields repeat the full cache's values on the same samples. A metric the run did not
measure is ``null``.

``--into benchmarks/results/accuracy/summary.json`` also merges the rows (with ``engine``, e.g.
``offline_cpu``, ``budget`` null and the run's ``command``) into the accuracy summary that
``evals.served`` writes its served rows to: one file, one row per (method, budget, engine, λ).
"""

import argparse
import json
from pathlib import Path

METHODS = ("wgkv", "streaming", "snapkv", "random", "equal_budget")
_METRICS = {
    "nll": ("nll", "nll_cont"),
    "passkey": ("passkey", "accuracy"),
    "niah_mk": ("niah_multikey", "accuracy"),
    # finer than a 0/1 accuracy on few samples: the answer tokens' mean NLL under teacher forcing
    "passkey_answer_nll": ("passkey", "answer_nll"),
    "niah_mk_answer_nll": ("niah_multikey", "answer_nll"),
}


def _pooled(summary: list[dict], method: str, lam) -> dict:
    rows = [s for s in summary if s["length"] is None and s["method"] == method and s["lam"] == lam]
    out = {}
    for key, (ev, metric) in _METRICS.items():
        found = [s[metric] for s in rows if s["eval"] == ev and metric in s]
        out[key] = found[0] if found else None
    n = sum(s["n"] for s in rows)
    out["kv_fraction"] = sum(s["kv_fraction"] * s["n"] for s in rows) / n if n else None
    out["n"] = n
    return out


def accuracy_rows(results: dict) -> list[dict]:
    """Rows for every (method in METHODS, λ) present in ``results["summary"]``."""
    summary = results["summary"]
    full = _pooled(summary, "full", None)
    keys = sorted(
        {(s["method"], s["lam"]) for s in summary if s["method"] in METHODS},
        key=lambda k: (METHODS.index(k[0]), k[1] or 0),
    )
    rows = []
    for method, lam in keys:
        r = _pooled(summary, method, lam)
        rows.append(
            {
                "method": method,
                "kv_fraction": r["kv_fraction"],
                "nll": r["nll"],
                "passkey": r["passkey"],
                "niah_mk": r["niah_mk"],
                "full_nll": full["nll"],
                "full_passkey": full["passkey"],
                "full_niah_mk": full["niah_mk"],
                "lam": lam,
                "n": r["n"],
                **{k: r[k] for k in ("passkey_answer_nll", "niah_mk_answer_nll")},
                **{"full_" + k: full[k] for k in ("passkey_answer_nll", "niah_mk_answer_nll")},
            }
        )
    return rows


def merge(parts: list[dict]) -> dict:
    """One results dict from shards over disjoint samples: rows concatenated, the summary recomputed."""
    from evals.run import summarize

    keys = [(r["eval"], r["length"], r["index"]) for p in parts for r in p["rows"] if r["method"] == "full"]
    if len(keys) != len(set(keys)):
        raise ValueError("the shards share samples")
    rows = [r for p in parts for r in p["rows"]]
    return {
        "rows": rows,
        "summary": summarize(rows),
        "complete": all(p["complete"] for p in parts),
        "elapsed_s": sum(p["elapsed_s"] for p in parts),
        "config": parts[0]["config"],
        "shards": [p["config"].get("command") for p in parts],
    }


def merge_summary(path: Path, rows: list[dict]) -> None:
    """Add ``rows`` to the ``{"rows": [...]}`` file at ``path``, replacing rows of the same (method,
    budget, engine, lam) and keeping every other row (offline and served rows live side by side)."""
    data = json.loads(path.read_text()) if path.exists() else {"rows": []}
    key = lambda r: (r.get("method"), r.get("budget"), r.get("engine"), r.get("lam"))
    new = {key(r) for r in rows}
    data["rows"] = [r for r in data.get("rows", []) if key(r) not in new] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("results", nargs="+")
    p.add_argument("--merged", default=None, help="also write the merged results here (for evals.plot)")
    p.add_argument(
        "--into",
        default=None,
        help="also merge the rows into this accuracy summary "
        "(benchmarks/results/accuracy/summary.json, beside evals.served's rows)",
    )
    p.add_argument(
        "--engine", default=None, help="engine label of the --into rows (default offline_<device>)"
    )
    a = p.parse_args(argv)
    parts = [json.loads(Path(r).read_text()) for r in a.results]
    results = merge(parts) if len(parts) > 1 else parts[0]
    if a.merged:
        Path(a.merged).write_text(json.dumps(results, indent=1) + "\n")
    out = {
        "rows": accuracy_rows(results),
        "command": results.get("shards") or results["config"].get("command"),
        "source": a.results,
        "complete": results.get("complete"),
        "config": results.get("config"),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if a.into:
        engine = a.engine or f"offline_{(results.get('config') or {}).get('device', 'unknown')}"
        command = out["command"] if isinstance(out["command"], str) else " && ".join(out["command"] or [])
        merge_summary(
            Path(a.into), [{**r, "budget": None, "engine": engine, "command": command} for r in out["rows"]]
        )
    for r in out["rows"]:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
