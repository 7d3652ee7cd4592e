"""transformers' greedy answers to the e2e chat prompts: the reference every e2e test compares
against (computed once per session by the `hf_reference` fixture)."""

import torch

MAX_TOKENS = 24


def greedy_reference(hf_model, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    """Per prompt: transformers' greedy tokens and its log-softmax ([vocab]) at every step."""
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, output_scores=True,
                                    return_dict_in_generate=True, pad_token_id=2)
            toks = out.sequences[0, len(ids):].tolist()
            lps = [s[0].float().log_softmax(-1) for s in out.scores]
            refs.append((toks, lps))
    return refs
