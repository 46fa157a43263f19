"""What the embedded model answers through the server's APIs: native ``/generate``, the OpenAI chat and
completions routes, and an SGLang frontend program (gen + select, batched), with the shipped gates.
(The README's serve command, with the launcher's CPU dtype, answers in ``tests/test_scale_memory.py``.)
"""

import pytest

from sglang_wgkv.testing.server_pool import shared_server

pytestmark = pytest.mark.serving

# test_long_serving's server (shared): the embedded model, its shipped gates, float32; these prompts
# fit its ring, so they answer as the full cache does
server = shared_server(
    "--max-total-tokens", "2048", "--wgkv-overcommit", "3.0", "--chunked-prefill-size", "512",
    "--disable-radix-cache", "--log-level", "info",
)  # fmt: skip


def test_native_generate(server):
    out = server.generate("The capital of France is", max_new_tokens=8)
    assert "Paris" in out["text"]
    assert out["meta_info"]["completion_tokens"] == 8


def test_openai_chat_and_completions(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=16,
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens > 0
    comp = client.completions.create(
        model=model, prompt="The capital of France is", temperature=0, max_tokens=8
    )
    assert "Paris" in comp.choices[0].text


def test_frontend_program_gen_select_run_batch(server):
    import sglang as sgl

    @sgl.function
    def country_quiz(s, city):
        s += f"Question: In which country is the city of {city}?\nAnswer: The city of {city} is in"
        s += sgl.gen("country", max_tokens=6, temperature=0, stop=["\n", "."])
        s += "\nQuestion: Is that country in Europe? Answer yes or no.\nAnswer:"
        s += sgl.select("europe", choices=[" yes", " no"])

    states = country_quiz.run_batch(
        [{"city": "Paris"}, {"city": "Berlin"}, {"city": "Tokyo"}], backend=sgl.RuntimeEndpoint(server.url)
    )
    for state in states:
        assert state["country"].strip()
        assert state["europe"] in (" yes", " no")
    assert "France" in states[0]["country"]
