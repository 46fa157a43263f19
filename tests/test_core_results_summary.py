"""benchmarks/results/SUMMARY.md is what ``python -m benchmarks.summary`` generates from the JSON files
beside it (no hand edits, no machine paths), every result file sits in a folder named for what it
measured and names its ``kind``, which picks its renderer."""

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

REPO = Path(__file__).resolve().parents[1]


def _summary_module():
    from benchmarks import summary

    return summary


def _kernel(name, t, dur, corr):
    """A traced GPU kernel with its launch's correlation id."""
    return {"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": dur, "args": {"correlation": corr}}


def _launch(t, corr, api="cuda_runtime"):
    """The host's launch of the kernel of correlation id ``corr``, on host thread 1, through the CUDA
    runtime or (``api="cuda_driver"``: Triton's kernels, cuBLASLt's GEMMs) the driver."""
    return {
        "ph": "X",
        "cat": api,
        "name": "cudaLaunchKernel" if api == "cuda_runtime" else "cuLaunchKernel",
        "ts": t,
        "dur": 2.0,
        "tid": 1,
        "args": {"correlation": corr},
    }


def test_summary_is_generated_from_the_json():
    summary = _summary_module()
    text = summary.render()
    assert (REPO / "benchmarks" / "results" / "SUMMARY.md").read_text() == text, (
        "SUMMARY.md is out of date: run python -m benchmarks.summary"
    )
    for path in sorted((REPO / "benchmarks" / "results").rglob("*.json")):
        assert path.parent.name in {folder for folder, _ in summary.SECTIONS}, path
        assert f"`{path.parent.name}/{path.name}`" in text
        kind = json.loads(path.read_text()).get("kind")
        assert kind in summary.RENDERERS, f"{path}: kind {kind!r} has no renderer in summary.RENDERERS"


def test_machine_paths_are_replaced():
    clean = _summary_module().clean_path
    assert (
        clean("python3 x.py --out /root/out --model /work/main/launch/configs/llama")
        == "python3 x.py --out OUT --model launch/configs/llama"
    )
    assert (
        clean("/opt/torch/.venv/bin/python3 -m a --model-path /root/.cache/sglang_wgkv/SmolLM2-135M-Instruct")
        == "python -m a --model-path EMBEDDED_MODEL"
    )
    assert clean("--gates /tmp/wgkv_run/lam0.1") == "--gates <lam0.1>"


def test_trace_summary_attributes_idle_gaps_to_host_events():
    """The summary of a profiler trace names its longest GPU idle gaps, the kernels around them and
    the host calls that ran meanwhile (synthetic trace: two kernels, a 2 ms gap covered by a Python
    op inside a longer step annotation)."""
    from benchmarks import trace_summary as ts

    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 0.0, "dur": 500.0},
        {"ph": "X", "cat": "kernel", "name": "_vertical_slash_fwd", "ts": 2500.0, "dur": 100.0},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "memcpy32_post",
            "ts": 2550.0,
            "dur": 10.0,
        },  # inside the busy span
        {"ph": "X", "cat": "kernel", "name": "act_and_mul_kernel", "ts": 2700.0, "dur": 100.0},
        {"ph": "X", "cat": "user_annotation", "name": "forward_step", "ts": 0.0, "dur": 3000.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::index_put_", "ts": 450.0, "dur": 1900.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 2400.0, "dur": 50.0},
    ]
    out = ts.summarize_events(events, steps=1)
    assert out["gpu_idle_us_per_step"] == 2000.0 + 100.0
    assert out["idle_in_gaps_over_1ms_us_per_step"] == 2000.0
    first, second = out["largest_idle_gaps"]
    assert (first["idle_us"], first["after_kernel"], first["before_kernel"]) == (
        2000.0,
        "nvjet_gemm",
        "_vertical_slash_fwd",
    )
    # the Python op covers 1,850 us of the gap, the step annotation all 2,000 (listed first); aten::add 50
    assert [h["name"] for h in first["host"]] == ["forward_step", "aten::index_put_", "aten::add"]
    assert first["host"][1]["overlap_us"] == 1850.0
    # Calls that ran mostly within the gap (not the step around it): the Python op, then aten::add.
    assert [h["name"] for h in first["inside"]] == ["aten::index_put_", "aten::add"]
    assert (second["idle_us"], second["after_kernel"], second["before_kernel"]) == (
        100.0,
        "_vertical_slash_fwd",
        "act_and_mul_kernel",
    )


def test_trace_summary_lists_one_layers_kernels_and_their_launchers():
    """``one_layer`` lists the kernels between two activation launches (the middle layer of three)
    in order, the GPU idle before each, and the innermost project frame that launched each (matched
    through the launch's correlation id; torch's own frames skipped)."""
    from benchmarks import trace_summary as ts

    def frame(name, t, dur):
        return {"ph": "X", "cat": "python_function", "name": name, "ts": t, "dur": dur, "tid": 1}

    events = [
        _kernel("act_and_mul_kernel", 100.0, 10.0, 1),
        _kernel("nvjet_gemm", 110.0, 50.0, 2),
        _kernel("_prefill_gate_kernel", 180.0, 5.0, 3),  # 20 us idle before it
        _kernel("act_and_mul_kernel", 185.0, 10.0, 4),
        _kernel("nvjet_gemm", 195.0, 50.0, 5),
        _kernel("act_and_mul_kernel", 245.0, 10.0, 6),
        _launch(50.0, 2),
        _launch(60.0, 3),
        frame("sglang_wgkv/integration/backend/attn_backend.py(338): _admit_extend", 55.0, 20.0),
        frame("torch/nn/modules/module.py(1783): _call_impl", 58.0, 5.0),
    ]
    out = ts.summarize_events(events, steps=1)["one_layer"]
    assert [r["name"] for r in out["sequence"]] == [
        "nvjet_gemm",
        "_prefill_gate_kernel",
        "act_and_mul_kernel",
    ]
    assert [r["idle_before_us"] for r in out["sequence"]] == [0.0, 20.0, 0.0]
    assert [r["launched_by"] for r in out["sequence"]] == [
        None,  # its launch lies outside every project frame
        "sglang_wgkv/integration/backend/attn_backend.py(338): _admit_extend",
        None,  # no launch event recorded
    ]
    assert (out["kernels"], out["gpu_us"], out["idle_us"]) == (3, 65.0, 20.0)
    assert ts.summarize_events(events[:4], steps=1)["one_layer"] is None  # two anchors: no whole layer
    lines = ts.layer_lines(ts.summarize_events(events, steps=1))  # the --layer printout
    assert lines[0] == "one layer: 3 kernels, 65.0 us GPU, 20.0 us idle"
    assert "_prefill_gate_kernel" in lines[2] and lines[2].endswith("_admit_extend")


def test_trace_summary_lists_the_host_calls_that_wait_for_the_device():
    """``host_waits``: stream syncs, allocations and device-to-host copies (matched to their copy on
    the GPU through the correlation id), longest first, each with the project frame that made it;
    launches and host-to-device copies are not waits."""
    from benchmarks import trace_summary as ts

    def rt(name, t, dur, corr=None):
        e = {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": t, "dur": dur, "tid": 1}
        return {**e, "args": {"correlation": corr}} if corr else e

    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 0.0, "dur": 500.0},
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoH (Device -> Pageable)",
            "ts": 600.0,
            "dur": 2.0,
            "args": {"correlation": 7},
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": 700.0,
            "dur": 2.0,
            "args": {"correlation": 8},
        },
        rt("cudaStreamSynchronize", 10.0, 300.0),
        rt("cudaMemcpyAsync", 400.0, 200.0, corr=7),
        rt("cudaMemcpyAsync", 650.0, 5.0, corr=8),
        rt("cudaLaunchKernel", 700.0, 900.0),
        rt("cudaMalloc", 800.0, 50.0),
        {
            "ph": "X",
            "cat": "python_function",
            "name": "sglang_wgkv/memory/extend_step.py(174): _context_gcols",
            "ts": 390.0,
            "dur": 220.0,
            "tid": 1,
        },
    ]
    waits = ts.summarize_events(events, steps=1)["host_waits"]
    assert [(w["name"], w["us"]) for w in waits] == [
        ("cudaStreamSynchronize", 300.0),
        ("cudaMemcpyAsync", 200.0),
        ("cudaMalloc", 50.0),
    ]
    assert [w["called_by"] for w in waits] == [
        None,
        "sglang_wgkv/memory/extend_step.py(174): _context_gcols",
        None,
    ]


def test_serving_memory_samples_the_gpu_through_nvidia_smi(tmp_path, monkeypatch):
    """benchmarks/serving_memory.py reads GPU 0's used/total memory from ``nvidia-smi`` (a stand-in
    script here), keeps per-phase GPU peaks only on a GPU host, and the summary renders a GPU column
    only then."""
    from benchmarks import serving_memory as sm

    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert sm.gpu_memory() is None  # no nvidia-smi on the PATH
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # the stand-in first
    used = tmp_path / "used"
    used.write_text("1024")
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f'#!/bin/sh\necho "$(cat {used}), 143771"\n')
    tool.chmod(0o755)
    assert sm.gpu_memory() == (1024 << 20, 143771 << 20)
    sampler = sm.TreeSampler(os.getpid(), period=0.01)

    def sampled():  # a sample of the current phase has landed (a loaded host spawns slowly)
        deadline = time.monotonic() + 20
        while sampler.gpu_phase_peak == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)

    used.write_text("5000")
    sampler.start()
    sampled()
    used.write_text("2000")  # before the boundary: a sample in flight across it may have read 5000,
    first = sampler.take_phase()  # and it counts in the phase it started in, not in the next
    sampled()
    second = sampler.take_phase()
    sampler.stop()
    assert first["peak_gpu_used_bytes"] == 5000 << 20 and second["peak_gpu_used_bytes"] == 2000 << 20
    assert sampler.gpu_peak == 5000 << 20 and first["peak_rss_bytes"] > 0
    d = {
        "label": "x",
        "command": "python -m sglang_wgkv.launch_server",
        "survived": True,
        "machine": {
            "cpus": 16,
            "mem_total_bytes": 1 << 37,
            "mem_available_at_start_bytes": 1 << 36,
            "gpu_total_bytes": 143771 << 20,
        },
        "peak_rss_bytes": 1 << 32,
        "peak_rss_fraction_of_ram": 0.03,
        "peak_gpu_used_bytes": 5000 << 20,
        "peak_gpu_fraction": 0.035,
        "phases": {"startup": {"peak_rss_bytes": 1 << 32, "peak_gpu_used_bytes": 5000 << 20}},
    }
    summary = _summary_module()
    text = "\n".join(summary.serving_memory(d))
    assert "peak GPU GiB" in text and "Peak GPU memory used 4.88 of 140.4 GiB (3.5%)" in text
    del d["peak_gpu_used_bytes"]
    assert "GPU" not in "\n".join(summary.serving_memory(d))


def test_kernel_gate_rows_render_with_errors_and_failed_shapes():
    """A ``kernel_gate`` file (written on a GPU host) renders each shape's time, its error against the
    torch gate and whether the start-up check would take it, and a shape that failed with its error."""
    summary = _summary_module()
    d = {
        "kind": "kernel_gate",
        "environment": {"gpu": "H100", "date_utc": "x", "command": "python -m benchmarks.kernel_gate"},
        "shape": {"kv_heads": 8, "head_dim": 128, "inner": 512},
        "rows": [
            {"rows": 8192, "variant": "torch", "ms": 2.5},
            {"rows": 8192, "variant": "served", "launch": {"block_t": 32}, "ms": 0.6, "max_abs_err": 2e-6,
             "within_check": True},
            {"rows": 8192, "variant": "bf16x3", "launch": {"precision": "bf16x3"}, "error": "OutOfResources: x"},
        ],
    }  # fmt: skip
    text = "\n".join(summary.renderer(d)(d))
    assert "| 8192 | served | block_t=32 | 0.600 | 2.0e-06 | yes |" in text
    assert "OutOfResources" in text and "| 8192 | torch |  | 2.500 |" in text


def test_trace_summary_splits_forwards_and_names_the_prefill_ones():
    """``forwards`` cuts a trace of ``steps`` forwards at each forward's last activation kernel (the
    layer count from the anchors over the steps) and lists the forwards whose GEMMs are over 3x the
    median's as prefill passes (synthetic: 4 forwards of 2 layers, the third with 10x the GEMM time);
    a trace whose anchors do not divide into the steps gives only the counts."""
    from benchmarks import trace_summary as ts

    events, t = [], 0.0
    for gemm in [100.0, 100.0, 1000.0, 100.0]:
        for _layer in range(2):
            events.append({"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": t, "dur": gemm})
            t += gemm
            events.append({"ph": "X", "cat": "kernel", "name": "act_and_mul_kernel", "ts": t, "dur": 10.0})
            t += 40.0  # 30 us idle after each layer
    out = ts.summarize_events(events, steps=4)["forwards"]
    # forwards 1-3 (forward 0 has no segment): 2 x (100 + 40) us, 2 x (1000 + 40), 2 x (100 + 40)
    assert out == {
        "layers": 2,
        "span_ms": [0.28, 2.08, 0.28],
        "idle_ms": [0.06, 0.06, 0.06],  # the two 30-us waits of each segment
        "prefill_ms": [2.08],
        "prefill_idle_ms": [0.06],
        "decode_median_ms": 0.28,
    }
    assert ts.summarize_events(events, steps=3)["forwards"] == {"anchors": 8, "steps": 3}


def test_trace_summary_keeps_each_annotated_forward_apart():
    """``annotated_steps``: each ``step[...]`` host range's kernels, found through the launches inside
    it (correlation ids, runtime and driver launches alike), with their own span, idle time (inside
    it, and before its first kernel since the last one ended), GEMM and
    attention time (FA3's cutlass kernel counted as attention, not GEMM); a decode step caught beside a
    prefill stays out of it (a CUDA graph's kernels all counted through its one replay launch), and
    the profiler's projection of a step onto the GPU's timeline is no step."""
    from benchmarks import trace_summary as ts

    def step(name, t, dur, cat="user_annotation"):
        return {"ph": "X", "cat": cat, "name": name, "ts": t, "dur": dur}

    events = [
        step("step[EXTEND bs=2 toks=8192]", 0.0, 10.0),
        step("step[EXTEND bs=2 toks=8192]", 100.0, 110.0, cat="gpu_user_annotation"),
        _launch(1.0, 1, api="cuda_driver"),
        _launch(2.0, 2),
        _launch(3.0, 3, api="cuda_driver"),
        step("step[DECODE bs=4]", 20.0, 5.0),
        _launch(21.0, 4),  # a decode CUDA graph's replay: one launch, two kernels
        _kernel("nvjet_gemm", 100.0, 50.0, 1),
        _kernel("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>", 150.0, 30.0, 2),
        _kernel("_vertical_slash_fwd", 190.0, 20.0, 3),  # 10 us idle before it
        _kernel("nvjet_gemm", 400.0, 5.0, 4),  # the decode step's, after a long gap
        _kernel("_split_kernel", 405.0, 2.0, 4),
    ]
    out = ts.summarize_events(events, steps=1)["annotated_steps"]
    assert out[0] == {
        "name": "step[EXTEND bs=2 toks=8192]",
        "kernels": 3,
        "span_us": 110.0,
        "gpu_busy_us": 100.0,
        "gpu_idle_us": 10.0,
        "idle_before_us": None,  # no kernel before it
        "gemm_us": 50.0,
        "attention_us": 50.0,
        "phase_us": {"gemm": 50.0, "fa3_attention": 30.0, "wgkv_prefill_attention": 20.0},
    }
    assert out[1]["name"] == "step[DECODE bs=4]" and out[1]["kernels"] == 2 and out[1]["span_us"] == 7.0
    assert out[1]["idle_before_us"] == 400.0 - 210.0  # the GPU waited from the prefill's last kernel
    assert len(out) == 2
    lines = ts.layer_lines(ts.summarize_events(events, steps=1))
    assert (
        "step[EXTEND bs=2 toks=8192]: 3 kernels, span 110.0 us, busy 100.0, idle 10.0, GEMM 50.0, attention 50.0"
        "; fa3_attention 30.0; wgkv_prefill_attention 20.0" in lines
    )


def test_trace_summary_host_self_time_splits_nested_frames_inside_forwards():
    """``host_self_us_per_step``: inside a forward's ``step[...]`` range each host event's own time is
    its duration less its nested events' (a Python frame of 100 us holding a 30 us op and a 20 us
    launch owns 50 us); events outside every step range do not count."""
    from benchmarks import trace_summary as ts

    def host(cat, name, t, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": t, "dur": dur, "tid": tid}

    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 0.0, "dur": 500.0},
        host("user_annotation", "step[EXTEND bs=1 toks=8]", 0.0, 300.0),
        host("python_function", "sglang_wgkv/x.py(1): f", 10.0, 100.0),
        host("cpu_op", "aten::index", 20.0, 30.0),
        host("cuda_runtime", "cudaLaunchKernel", 60.0, 20.0),
        host("python_function", "sglang_wgkv/y.py(2): g", 150.0, 40.0),
        host("python_function", "sglang_wgkv/z.py(3): outside", 400.0, 70.0),
        host("python_function", "other_thread.py(4): h", 10.0, 90.0, tid=2),
    ]
    out = ts.summarize_events(events, steps=1)["host_self_us_per_step"]
    assert out["sglang_wgkv/x.py(1): f"] == 50.0
    assert out["aten::index"] == 30.0 and out["cudaLaunchKernel"] == 20.0
    assert out["sglang_wgkv/y.py(2): g"] == 40.0
    assert out["step[EXTEND bs=1 toks=8]"] == 300.0 - 100.0 - 40.0
    assert "sglang_wgkv/z.py(3): outside" not in out and "other_thread.py(4): h" not in out
    frames = ts.summarize_events(events, steps=1)["project_frames_us_per_step"]
    assert frames == {"sglang_wgkv/x.py(1): f": 100.0, "sglang_wgkv/y.py(2): g": 40.0}
