"""Prompt -> token ids exactly as the engine computes them (same tokenizer file, same chat template).

The router must see the token ids the engine will hash, or block keys would never match. A model
directory holds ``tokenizer.json`` (the ``tokenizers`` format every HF model ships) and optionally
``tokenizer_config.json`` with a Jinja ``chat_template``, rendered as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "workers" / "sim" / "data"


class PromptError(ValueError):
    """The request's prompt cannot be turned into tokens (a 400 for the client)."""


class PromptTokenizer:
    def __init__(self, path: str | Path = DEFAULT_TOKENIZER_DIR) -> None:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        self.tokenizer = Tokenizer.from_file(str(file))
        config_file = file.parent / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.bos_token = config.get("bos_token") or ""
        self.eos_token = config.get("eos_token") or ""
        template = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template) if template else None
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise PromptError("this model has no chat template")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        norm = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise PromptError("each message needs a string 'role'")
            content = m.get("content", "")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise PromptError("message 'content' must be a string or a list of text parts")
            norm.append({"role": m["role"], "content": content})
        try:
            return self._template.render(messages=norm, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise PromptError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        """Token ids of an OpenAI request body (completions: str or ids; chat: messages)."""
        if chat:
            return self.encode_chat(body.get("messages"))  # type: ignore[arg-type]
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:  # a batch of one
            inner = prompt[0]
            if isinstance(inner, str):
                return self.encode(inner)
            if isinstance(inner, list) and inner and all(isinstance(t, int) and t >= 0 for t in inner):
                return list(inner)
        raise PromptError("'prompt' must be a non-empty string or list of token ids (batches of one)")


@lru_cache(maxsize=16)
def load_tokenizer(path: str = str(DEFAULT_TOKENIZER_DIR)) -> PromptTokenizer:
    return PromptTokenizer(path)
