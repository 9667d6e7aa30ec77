"""Build the small BPE tokenizer shipped for the simulated worker (nothing can be downloaded at run time).

``python -m workers.sim.build_tokenizer`` rewrites ``router/data/``: a byte-level BPE trained on
generated text, and a ``tokenizer_config.json`` with a Jinja chat template, as a Hugging Face model has.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DATA = Path(__file__).resolve().parents[2] / "router" / "data"
SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus(n_lines: int = 20000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    words += ["the", "a", "of", "to", "and", "in", "is", "you", "that", "it", "for"]
    words += ["system", "user", "assistant", "document", "question", "answer"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]


def build(vocab_size: int = 4000) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return tok


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    build().save(str(DATA / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
              "model_max_length": 32768, "tokenizer_class": "PreTrainedTokenizerFast"}
    (DATA / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
