"""Summarise torch-profiler traces (Chrome JSON, optionally gzipped) of a server's decode steps:
GPU kernel time by phase and by kernel, GPU busy time against the traced span (the idle rest is time
the GPU waited for the host), per profiled step.

    python -m benchmarks.trace_summary TRACE_DIR [--steps N]
    python -m benchmarks.trace_summary --layer PART.json ...   (a part's prefill profiles: one layer, the waits)
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# (phase, regex on the kernel name), first match wins.
PHASES = [
    ("wgkv_gate", r"decode_gate|prefill_gate"),
    ("wgkv_ring_write", r"decode_write|prefill_write"),
    ("wgkv_promotion", r"promote"),
    ("wgkv_decode_attention", r"_split_kernel|_merge_kernel|folded"),
    ("wgkv_prefill_attention", r"_vertical_slash_fwd"),
    ("wgkv_prefill_compact", r"_compact_fwd"),
    ("scan_search", r"scan|searchsorted|cumsum"),
    ("wgkv_evictor", r"snapkv|evict|observe"),
    ("rmsnorm", r"rms|norm"),
    ("flashinfer_attention", r"BatchDecode|BatchPrefill|flashinfer|PersistentVariableLength|Paged"),
    ("kv_append", r"append|store_kv|set_kv|copy_kv|kv_buffer"),
    ("fa3_attention", r"flash::"),  # FA3's kernels are cutlass kernels: before the GEMMs
    ("gemm", r"gemm|nvjet|cutlass|sm90_xmma|ampere_|cublas|Kernel2|splitK|dot_kernel"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|act_and_mul|gelu"),
    ("sampling_logits", r"argmax|softmax|sampl|topk|top_k|logit|reduce"),
    ("copy_fill_elementwise", r"copy|fill|elementwise|vectorized|Memcpy|Memset|index|scatter|gather|cat"),
]

# Host calls that launch work: the runtime's and the driver's (``cuLaunchKernel``: Triton's kernels and
# the served GEMMs, which went unmatched without it: launch/results/served_speed/M1D_h100_int32/trace_layer.txt).
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def phase_of(name: str) -> str:
    for phase, pattern in PHASES:
        if re.search(pattern, name, re.IGNORECASE):
            return phase
    return "other"


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def summarize_events(events: list[dict], steps: int | None = None) -> dict:
    kernels = [
        e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    if not kernels:
        return {"kernels": 0}
    by_phase, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in kernels:
        by_phase[phase_of(e["name"])] += e["dur"]
        by_name[e["name"][:140]] += e["dur"]
        count[e["name"][:140]] += 1
    gaps = idle_gaps(kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = span - sum(b - a for a, b, *_ in gaps)
    runtime = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS:
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e["dur"]
    host_ops = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            host_ops[e["name"][:100]][0] += 1
            host_ops[e["name"][:100]][1] += e["dur"]
    per = steps or 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:30]
    return {
        "steps": steps,
        "kernels": len(kernels),
        "kernels_per_step": len(kernels) / per,
        "span_us_per_step": span / per,
        "gpu_busy_us_per_step": busy / per,
        "gpu_idle_us_per_step": (span - busy) / per,
        "phase_us_per_step": {k: v / per for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": n, "phase": phase_of(n), "us_per_step": t / per, "calls_per_step": count[n] / per}
            for n, t in top
        ],
        "cuda_runtime_calls": {
            k: {"calls": c, "us": round(t, 1)}
            for k, (c, t) in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:12]
        },
        "host_ops_per_step": {  # nested ops count in their callers too
            k: {"calls": c / per, "us": round(t / per, 1)}
            for k, (c, t) in sorted(host_ops.items(), key=lambda kv: -kv[1][1])[:25]
        },
        "idle_in_gaps_over_1ms_us_per_step": sum(g - a for a, g, *_ in gaps if g - a > 1000) / per,
        "largest_idle_gaps": [
            describe_gap(g, events) for g in sorted(gaps, key=lambda g: g[0] - g[1])[:TOP_GAPS]
        ],
        "one_layer": one_layer(kernels, events),
        "host_waits": host_waits(events),
        "forwards": forwards(kernels, steps),
        "annotated_steps": annotated_steps(events, kernels),
        "host_self_us_per_step": {k: round(v / per, 1) for k, v in host_self_time(events).items()},
        "project_frames_us_per_step": {
            k: round(v / per, 1) for k, v in host_self_time(events, inclusive=PROJECT_FRAME).items()
        },
    }


# CPU-side trace events whose overlap with an idle gap says what the host was doing meanwhile.
HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
TOP_GAPS = 8


def idle_gaps(kernels: list[dict]) -> list[tuple[float, float, str, str]]:
    """``(start, end, kernel before, kernel after)`` of every stretch with no kernel running."""
    order = sorted(kernels, key=lambda e: e["ts"])
    gaps, end, last = [], order[0]["ts"] + order[0]["dur"], order[0]["name"]
    for e in order[1:]:
        if e["ts"] > end:
            gaps.append((end, e["ts"], last, e["name"]))
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e["name"]
    return gaps


def describe_gap(gap: tuple[float, float, str, str], events: list[dict], top: int = 5) -> dict:
    """One idle gap: its length, the kernels around it, the host events overlapping it most
    (shortest first among equal overlaps: the innermost call, not the step around it), and under
    ``inside`` the host calls that ran mostly within it (at least half of their own time), largest
    overlap first: when no single call covers the gap (several calls in turn), these say which."""
    a, b, before, after = gap
    host, inside = [], []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS:
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 0:
                row = (-overlap, e["dur"], e["name"][:100], e["cat"])
                host.append(row)
                if overlap >= 0.5 * e["dur"] and e["dur"] < b - a:
                    inside.append(row)
    host.sort()
    inside.sort()

    def rows(found):
        return [
            {"name": n, "cat": c, "overlap_us": round(-o, 1), "dur_us": round(d, 1)}
            for o, d, n, c in found[:top]
        ]

    return {
        "idle_us": round(b - a, 1),
        "after_kernel": before[:100],
        "before_kernel": after[:100],
        "host": rows(host),
        "inside": rows(inside),
    }


# A kernel every decoder layer launches once (the MLP's gated activation): consecutive launches bound
# one layer's kernels.
LAYER_ANCHOR = r"act_and_mul|silu_and_mul|gelu_and_mul"


def _frames_near(events: list[dict], calls: list[dict]) -> list[dict]:
    """The project's Python frames (traces taken with stacks) around the host calls ``calls``."""
    if not calls:
        return []
    lo, hi = min(r["ts"] for r in calls), max(r["ts"] + r["dur"] for r in calls)
    return [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "python_function"
        and e["ts"] <= hi
        and e["ts"] + e["dur"] >= lo
        and not e["name"].startswith(("torch/", "<built-in", "triton/"))
    ]


def _caller(call: dict | None, frames: list[dict]) -> str | None:
    """The innermost of ``frames`` around the host call ``call`` on its thread."""
    if call is None:
        return None
    around = [
        f
        for f in frames
        if f.get("tid") == call.get("tid")
        and f["ts"] <= call["ts"]
        and f["ts"] + f["dur"] >= call["ts"] + call["dur"]
    ]
    return min(around, key=lambda f: f["dur"])["name"][:90] if around else None


def one_layer(kernels: list[dict], events: list[dict]) -> dict | None:
    """The kernels of one middle decoder layer in launch order, each with the GPU idle before it and
    the innermost project frame that launched it (through the launch's correlation id; traces taken
    with stacks): which launches a fusion would remove, and where the GPU waited for the host. The
    layer runs from one :data:`LAYER_ANCHOR` kernel to the next; None with fewer than three."""
    order = sorted(kernels, key=lambda e: e["ts"])
    anchors = [i for i, e in enumerate(order) if re.search(LAYER_ANCHOR, e["name"])]
    if len(anchors) < 3:
        return None
    mid = len(anchors) // 2
    layer = order[anchors[mid - 1] + 1 : anchors[mid] + 1]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    mine = [launches.get(k.get("args", {}).get("correlation")) for k in layer]
    frames = _frames_near(events, [r for r in mine if r is not None])
    rows, end = [], order[anchors[mid - 1]]["ts"] + order[anchors[mid - 1]]["dur"]
    for k, r in zip(layer, mine):
        rows.append(
            {
                "name": k["name"][:80],
                "us": round(k["dur"], 1),
                "idle_before_us": round(max(0.0, k["ts"] - end), 1),
                "launched_by": _caller(r, frames),
            }
        )
        end = max(end, k["ts"] + k["dur"])
    return {
        "kernels": len(rows),
        "gpu_us": round(sum(r["us"] for r in rows), 1),
        "idle_us": round(sum(r["idle_before_us"] for r in rows), 1),
        "sequence": rows,
    }


def forwards(kernels: list[dict], steps: int | None) -> dict | None:
    """Each profiled forward's span in ms, in order: the trace cut at every forward's last
    :data:`LAYER_ANCHOR` kernel (``layers``: the anchors over ``steps``), so a segment holds a forward's
    last layers' tail, the sampling and the next forward up to its last MLP; the first forward has
    no segment; ``idle_ms``: each segment's time with no kernel running, the GPU waiting for the host
    (Python stacks slow the host several times: read it from a trace taken without them,
    ``served_speed --profile-host ops`` or ``gpu``). Forwards whose GEMMs take over 3x the median's
    carry prompt tokens (``prefill_ms``, ``prefill_idle_ms``): under load, the prefill passes against
    the decode steps around them. Only the anchor count when the anchors do not divide into whole
    forwards; None without two steps."""
    order = sorted(kernels, key=lambda e: e["ts"])
    anchors = [i for i, e in enumerate(order) if re.search(LAYER_ANCHOR, e["name"])]
    if not steps or steps < 2:
        return None
    if not anchors or len(anchors) % steps:
        return {"anchors": len(anchors), "steps": steps}
    layers = len(anchors) // steps
    cuts = anchors[layers - 1 :: layers]
    spans, gemms, idles = [], [], []
    for a, b in zip(cuts, cuts[1:]):
        spans.append((order[b]["ts"] - order[a]["ts"]) / 1e3)
        gemms.append(sum(e["dur"] for e in order[a:b] if phase_of(e["name"]) == "gemm") / 1e3)
        idles.append(sum(hi - lo for lo, hi, *_ in idle_gaps(order[a : b + 1])) / 1e3)
    median_gemm = sorted(gemms)[len(gemms) // 2]
    decode = sorted(x for x, g in zip(spans, gemms) if g <= 3 * median_gemm)
    return {
        "layers": layers,
        "span_ms": [round(x, 2) for x in spans],
        "idle_ms": [round(x, 2) for x in idles],
        "prefill_ms": [round(x, 2) for x, g in zip(spans, gemms) if g > 3 * median_gemm],
        "prefill_idle_ms": [round(x, 2) for x, g in zip(idles, gemms) if g > 3 * median_gemm],
        "decode_median_ms": round(decode[len(decode) // 2], 2),
    }


# SGLang's host range around a forward's launch, named by its mode and size ("step[EXTEND bs=2 toks=8192]");
# the profiler also projects it onto the GPU's timeline (``gpu_user_annotation``), where no launch is.
STEP_ANNOTATION = re.compile(r"^step\[")


def annotated_steps(events: list[dict], kernels: list[dict]) -> list[dict]:
    """Each forward the host annotated (``step[...]``), from the kernels its launches made (the launch
    calls inside its host range, matched through their correlation ids): kernel count, GPU span,
    busy and idle time, GEMM and attention time. A trace that also caught other forwards (a decode
    step beside a profiled prefill) keeps each forward's numbers apart."""
    launches = sorted(
        (e["ts"], e["args"]["correlation"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    )
    by_corr = defaultdict(list)  # a CUDA graph's replay: one launch, all its kernels
    for k in kernels:
        if "correlation" in k.get("args", {}):
            by_corr[k["args"]["correlation"]].append(k)
    out = []
    ends = sorted(k["ts"] + k["dur"] for k in kernels)
    for step in sorted(
        (
            e
            for e in events
            if e.get("ph") == "X"
            and e.get("cat") == "user_annotation"
            and STEP_ANNOTATION.match(e.get("name", ""))
        ),
        key=lambda e: e["ts"],
    ):
        lo, hi = step["ts"], step["ts"] + step["dur"]
        mine = [k for t, c in launches if lo <= t <= hi for k in by_corr.get(c, ())]
        if not mine:
            out.append({"name": step["name"], "kernels": 0})
            continue
        first = min(k["ts"] for k in mine)
        span = max(k["ts"] + k["dur"] for k in mine) - first
        idle = sum(b - a for a, b, *_ in idle_gaps(mine))
        # the GPU's wait for this forward: from the last kernel that ended before its first one
        before = bisect.bisect_right(ends, first)
        phases = defaultdict(float)
        for k in mine:
            phases[phase_of(k["name"])] += k["dur"]
        out.append(
            {
                "name": step["name"],
                "kernels": len(mine),
                "span_us": round(span, 1),
                "gpu_busy_us": round(span - idle, 1),
                "gpu_idle_us": round(idle, 1),
                "idle_before_us": round(first - ends[before - 1], 1) if before else None,
                "gemm_us": round(phases["gemm"], 1),
                "attention_us": round(sum(t for ph, t in phases.items() if ph.endswith("attention")), 1),
                # a mixed forward's prefill and decode attention, gate and copies apart
                "phase_us": {ph: round(t, 1) for ph, t in sorted(phases.items(), key=lambda kv: -kv[1])},
            }
        )
    return out


# host events that nest on one thread: each one's own time is its duration less its children's
SELF_CATS = ("python_function", "cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
PROJECT_FRAME = "sglang_wgkv/"


def host_self_time(events: list[dict], top: int = 30, inclusive: str | None = None) -> dict[str, float]:
    """The host's time inside each forward (``step[...]`` ranges) by where it went: per event name its
    own time (its duration less the events nested in it on the same thread), the largest ``top``;
    with ``inclusive``, the whole duration of the Python frames whose name holds it instead.
    A project frame's line (``sglang_wgkv/...py(N): f``) then says which Python costs the host, where
    the phases of the GPU only say what it waited for."""
    steps = [
        (e["ts"], e["ts"] + e["dur"], e.get("tid"))
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and STEP_ANNOTATION.match(e.get("name", ""))
    ]
    if not steps:
        return {}
    by_tid = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in SELF_CATS and "dur" in e:
            by_tid[e.get("tid")].append(e)
    own = defaultdict(float)
    for tid, evs in by_tid.items():
        ranges = [(lo, hi) for lo, hi, t in steps if t == tid]
        if not ranges:
            continue
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, own time so far, inside a step]

        def close(entry):
            if entry[3] and inclusive is None:
                own[entry[1][:120]] += max(entry[2], 0.0)
            elif entry[3] and inclusive in entry[1]:
                own[entry[1][:120]] += entry[4]

        for e in evs:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                close(stack.pop())
            if stack:
                stack[-1][2] -= e["dur"]
            inside = any(lo <= start and end <= hi for lo, hi in ranges)
            stack.append([end, e["name"], e["dur"], inside, e["dur"]])
        while stack:
            close(stack.pop())
    return dict(sorted(own.items(), key=lambda kv: -kv[1])[:top])


# CUDA runtime calls that can make the host wait for the device (a full drain lets the GPU idle for
# as long as the host then takes to get ahead again).
WAITS = re.compile(r"Synchronize|cudaMalloc$|cudaFree|cudaMemcpy$|cudaHostAlloc|cudaMallocHost")


def host_waits(events: list[dict], top: int = 12) -> list[dict]:
    """The longest CUDA runtime calls that can wait for the device, each with its duration and the
    innermost project frame that made it; a device-to-host ``cudaMemcpyAsync`` counts (it waits for
    its stream unless the destination is pinned)."""
    dtoh = {
        e.get("args", {}).get("correlation")
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]
    }
    calls = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "cuda_runtime"
        and (
            WAITS.search(e["name"])
            or (e["name"] == "cudaMemcpyAsync" and e.get("args", {}).get("correlation") in dtoh)
        )
    ]
    calls = sorted(calls, key=lambda e: -e["dur"])[:top]
    frames = _frames_near(events, calls)
    return [{"name": c["name"], "us": round(c["dur"], 1), "called_by": _caller(c, frames)} for c in calls]


def recategorize(summary: dict) -> dict:
    """Re-assign the listed top kernels of a stored summary to the current :data:`PHASES` (a trace
    summarised with an older phase list; kernels outside the top list keep their phase)."""
    phases = dict(summary.get("phase_us_per_step", {}))
    for k in summary.get("top_kernels", []):
        now = phase_of(k["name"])
        was = k.get("phase", now)
        if was != now:
            phases[was] = phases.get(was, 0.0) - k["us_per_step"]
            phases[now] = phases.get(now, 0.0) + k["us_per_step"]
        k["phase"] = now
    summary["phase_us_per_step"] = {
        p: v for p, v in sorted(phases.items(), key=lambda kv: -kv[1]) if v > 0.05
    }
    return summary


def summarize_dir(trace_dir: str, steps: int | None = None) -> dict:
    paths = sorted(Path(trace_dir).rglob("*.json*"))
    if not paths:
        return {"error": f"no trace under {trace_dir}"}
    return {
        "traces": [p.name for p in paths],
        "summary": [summarize_events(load_events(p), steps) for p in paths],
    }


# phases printed on a forward's line (by time, the GEMMs apart)
PHASES_SHOWN = 6


def layer_lines(summary: dict) -> list[str]:
    """One profiled step's ``one_layer``, ``host_waits`` and ``annotated_steps`` as text: a line per
    kernel (GPU us, idle us before it, name, launching frame), a line per wait, a line per forward."""
    o = summary.get("one_layer") or {}
    lines = [f"one layer: {o.get('kernels')} kernels, {o.get('gpu_us')} us GPU, {o.get('idle_us')} us idle"]
    for r in o.get("sequence", []):
        lines.append(
            f"{r['us']:9.1f} {r['idle_before_us']:8.1f}  {r['name'][:48]:48}  {r['launched_by'] or ''}"
        )
    lines += [
        f"wait {w['us']:10.1f}  {w['name']}  {w['called_by'] or ''}" for w in summary.get("host_waits", [])
    ]
    lines += [
        f"{st['name']}: {st['kernels']} kernels"
        + (
            f", span {st['span_us']} us, busy {st['gpu_busy_us']}, idle {st['gpu_idle_us']}, "
            f"GEMM {st['gemm_us']}, attention {st['attention_us']}"
            + "".join(
                f"; {ph} {us}"
                for ph, us in list(st.get("phase_us", {}).items())[:PHASES_SHOWN]
                if ph != "gemm"
            )
            if st["kernels"]
            else ""
        )
        for st in summary.get("annotated_steps") or []
    ]
    return lines


if __name__ == "__main__":
    if sys.argv[1] == "--layer":  # served_speed parts: their prefill and under-load profiles
        for part in sys.argv[2:]:
            for run in json.loads(Path(part).read_text())["runs"]:
                for kind in ("profile_prefill", "profile_under_load"):
                    for s in (run.get(kind) or {}).get("summary", []):
                        print(f"{part} {run.get('workload')} {kind}")
                        print("\n".join(layer_lines(s)))
        sys.exit(0)
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else None
    print(json.dumps(summarize_dir(sys.argv[1], steps), indent=1))
