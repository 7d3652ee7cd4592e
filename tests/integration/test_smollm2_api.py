"""SmolLM2 behind the full stack, where the answer matters: the openai client gets the offline
engine's greedy tokens, and they answer the question."""

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.integration.services_helpers import offline_engine, tiny_stack

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ENGINE = ("--num-threads", "1", "--num-blocks", "64", "--max-model-len", "512")


def test_chat_answer_matches_offline_engine(tmp_path):
    try:
        llm = offline_engine("smollm2", num_blocks=64)
    except ValueError as exc:  # the packaged model is missing
        pytest.skip(str(exc))
    want = llm.chat(QUESTION, SamplingParams(max_tokens=12, temperature=0))[0]
    del llm
    with tiny_stack(tmp_path, ENGINE, model="smollm2") as stack:
        client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        got = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12,
                                             temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(model="smollm2", messages=QUESTION,
                                                          max_tokens=12, temperature=0,
                                                          stream=True))
        client.close()
    assert got.choices[0].message.content == want.text == streamed
    assert "Paris" in want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
