"""SmolLM2 through the disaggregated stack (router, prefill, decode, KV store): the chat
answers equal the offline engine's greedy ones, and the decode instance loaded the prompts'
KV from the store instead of computing it."""

import httpx
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.integration.disagg_helpers import disagg_stack, engine_load
from pdserve.tests.integration.services_helpers import offline_engine

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France?", "Name three colors of the rainbow."]
ENGINE = ("--num-threads", "1", "--num-blocks", "64", "--max-model-len", "512")
MAX_TOKENS = 12


def test_disagg_chat_matches_offline_engine(tmp_path):
    try:
        llm = offline_engine("smollm2", num_blocks=64)
    except ValueError as exc:  # the packaged model is missing
        pytest.skip(str(exc))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    want = [llm.chat([{"role": "user", "content": c}], params)[0] for c in CHATS]
    del llm
    with disagg_stack(tmp_path, n_decode=1, model="smollm2", engine_args=ENGINE) as stack:
        got = [httpx.post(f"{stack.http_url}/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "messages": [{"role": "user", "content": c}],
            "max_tokens": MAX_TOKENS, "temperature": 0}).json() for c in CHATS]
        pre, dec = engine_load(stack.prefill[0], "prefill"), engine_load(stack.decode[0])
    assert [g["choices"][0]["message"]["content"] for g in got] == [w.text for w in want]
    assert "Paris" in want[0].text
    # The chat template's shared opening block is computed (and saved) once; each instance
    # reuses it from its own prefix cache for the second prompt.
    full_blocks = sum(len(w.prompt_token_ids) // 16 for w in want)
    assert pre.num_finished == 2 and 0 < pre.kv.blocks_saved < full_blocks
    assert dec.kv.blocks_loaded == pre.kv.blocks_saved and dec.num_kv_load_failures == 0
