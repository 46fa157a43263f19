"""Serving throughput probe for a running server: a sanity generation, batch-1 decode speed, and
``--concurrency`` requests of ``--prompt-tokens`` random tokens + ``--output-tokens`` generated
(greedy, EOS ignored) sent at once. Prints and writes a JSON summary.

    python3 launch/bench_serving.py --url http://127.0.0.1:30000 --out result.json
"""

import argparse
import json
import random
import time

import requests


def generate(url, body, timeout=900):
    r = requests.post(url + "/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    greedy = {"temperature": 0, "ignore_eos": True}
    result = {}
    sanity = generate(
        a.url,
        {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
    )
    result["sanity_text"] = sanity["text"]
    t = time.perf_counter()
    one = generate(
        a.url, {"text": "Once upon a time", "sampling_params": {"max_new_tokens": a.output_tokens, **greedy}}
    )
    result["batch1_decode_tok_s"] = one["meta_info"]["completion_tokens"] / (time.perf_counter() - t)
    rng = random.Random(0)
    ids = [[rng.randrange(100, 49000) for _ in range(a.prompt_tokens)] for _ in range(a.concurrency)]
    t = time.perf_counter()
    outs = generate(
        a.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": a.output_tokens, **greedy}}
    )
    wall = time.perf_counter() - t
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    result.update(
        concurrency=a.concurrency,
        prompt_tokens=a.prompt_tokens,
        output_tokens=a.output_tokens,
        wall_s=wall,
        output_tok_s=out_tokens / wall,
        total_tok_s=(out_tokens + a.concurrency * a.prompt_tokens) / wall,
    )
    info = requests.get(a.url + "/server_info", timeout=60).json()
    result["wgkv"] = {
        k: v
        for k, v in info["internal_states"][0].get("wgkv", {}).items()
        if not k.endswith("per_layer_head")
    }
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
