"""Build a tiny random-weight Llama that vLLM's CPU build can serve (nothing can be downloaded here).

``python -m workers.vllm.build_tiny_model OUT_DIR`` (run with the vLLM environment's Python: it needs
transformers and torch). The tokenizer is kvrouter's bundled BPE (router/data), wrapped as a
``PreTrainedTokenizerFast`` with the same chat template, so kvrouter tokenizes exactly as the engine does.
Model: LlamaConfig, 2 layers, hidden 128, 4 heads, 2 KV heads, random weights (REFERENCE.md section 3).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "router" / "data"  # the bundled BPE (package data)


def build(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"), bos_token=cfg["bos_token"],
                                  eos_token=cfg["eos_token"], model_max_length=cfg["model_max_length"])
    tok.chat_template = cfg["chat_template"]
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvrouter-tiny-model")))
