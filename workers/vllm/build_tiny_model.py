"""Build a tiny random-weight Llama that vLLM's CPU build can serve (nothing can be downloaded here).

``python -m workers.vllm.build_tiny_model OUT_DIR [--shape tiny|prefill]`` (run with the vLLM environment's
Python: it needs transformers and torch). The tokenizer is kvrouter's bundled BPE (router/data), wrapped as a
``PreTrainedTokenizerFast`` with the same chat template, so kvrouter tokenizes exactly as the engine does.
Model: a LlamaConfig with random weights (REFERENCE.md section 3), in one of two shapes (``SHAPES``):
- ``tiny`` (default): 2 layers, hidden 128, 4 heads, 2 KV heads. The engine tier's fast tests; but its prefill is
  cheap beside a step's fixed cost (a 1K-token prompt is ~1.5 ms of compute), so on it no routing policy's hits
  decide TTFT.
- ``prefill``: larger, so on one CPU core an uncached 1K-token prompt's TTFT is mostly prefill and a fully cached
  one's a small fraction of it, while decode stays fast enough for ``kvrouter bench fidelity --shape prefill`` to
  finish in minutes (docs/vllm.md, "The prefill shape", has the measured figures).
``--lora NAME`` also writes a random rank-8 LoRA adapter for it (PEFT's layout: ``adapter_config.json`` and
``adapter_model.safetensors``, on q_proj and v_proj) under ``OUT_DIR/NAME``, for ``--enable-lora --lora-modules
NAME=OUT_DIR/NAME``.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "router" / "data"  # the bundled BPE (package data)

# LlamaConfig fields per shape; everything else (vocabulary, positions, untied head) is common
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    # measured on one core (docs/vllm.md): 1K tokens uncached ~120 ms of TTFT against ~9 ms for 16 tokens,
    # decode ~3.3 ms a token; hidden 512 made the 1K prefill ~480 ms and decode twice as slow (a bench in hours)
    "prefill": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2},
}


def build(out: Path, seed: int = 0, shape: str = "tiny") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"), bos_token=cfg["bos_token"],
                                  eos_token=cfg["eos_token"], model_max_length=cfg["model_max_length"])
    tok.chat_template = cfg["chat_template"]
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: one of {', '.join(SHAPES)}")
    config = LlamaConfig(vocab_size=len(tok), **SHAPES[shape], max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


LORA_RANK = 8


def build_lora(model_dir: Path, name: str, seed: int = 1) -> Path:
    """A random LoRA adapter for the tiny model: what vLLM loads with ``--lora-modules NAME=PATH``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    out_dims = {"q_proj": hidden, "v_proj": hidden // heads * kv_heads}
    torch.manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, out_dim in out_dims.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, hidden) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, LORA_RANK) * 0.01
    out = model_dir / name
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(out_dims), "fan_in_fan_out": False,
        "base_model_name_or_path": str(model_dir), "inference_mode": True}))
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default="/tmp/kvrouter-tiny-model", help="the model directory to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="the model's size (default tiny)")
    p.add_argument("--lora", default=None, help="also write a random LoRA adapter under OUT/NAME")
    args = p.parse_args(argv)
    target = Path(args.out)
    print(build(target, shape=args.shape))
    if args.lora:
        print(build_lora(target, args.lora))


if __name__ == "__main__":
    main()
