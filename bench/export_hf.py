"""`python -m pdserve.bench.export_hf DIR`: the packaged SmolLM2 (or any model pdserve loads) as
a Hugging Face directory, fp32 safetensors plus a tokenizer, for peers that read only that
format (vLLM's server in bench/vllm_reference.sh). The weights are our loader's dequantized
fp32 tensors, so the peer serves exactly the values our engine does; nothing is downloaded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def export(model: str, out: Path) -> None:
    from pdserve.bench.hf_peer import hf_model_from_loaded
    from pdserve.common.models.registry import load_model

    loaded = load_model(model, weights="fp32")
    hf, tok = hf_model_from_loaded(loaded), loaded.tokenizer
    eos = list(tok.eos_token_ids)
    hf.config.bos_token_id = tok.bos_token_id
    hf.config.eos_token_id = eos[0] if len(eos) == 1 else eos
    hf.generation_config.bos_token_id = hf.config.bos_token_id
    hf.generation_config.eos_token_id = hf.config.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    tok.backend.save(str(out / "tokenizer.json"))
    names = {i: t for t, i in tok.backend.get_vocab().items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
              "model_max_length": loaded.config.max_position_embeddings,
              "bos_token": names.get(tok.bos_token_id), "eos_token": names.get(eos[0]),
              "chat_template": tok.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.export_hf")
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="smollm2")
    args = p.parse_args(argv)
    export(args.model, args.out)
    print(json.dumps({"bench": "export_hf", "model": args.model, "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
