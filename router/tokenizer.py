"""Prompt -> token ids exactly as the engine computes them (same tokenizer file, same chat template).

The router must see the token ids the engine will hash, or block keys would never match. A model
directory holds ``tokenizer.json`` (the ``tokenizers`` format every HF model ships) and optionally
``tokenizer_config.json`` with a Jinja ``chat_template``, rendered as transformers does.

Every prompt is checked before it costs anything: a text longer than ``token_budget`` tokens could
possibly cover is refused without tokenizing it (no token covers more characters than the longest one in
the vocabulary, so ``len(text) / longest`` is a lower bound on its token count), token ids must be
integers inside the vocabulary, and chat parts must be text. ``encode`` releases the GIL (the Rust
tokenizer's batch entry point), so a caller may run it on a worker thread beside an event loop.
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

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "data"  # package data: the bundled BPE
# slack on the length bound: a normalizer that composes characters (NFC/NFKC) can shorten a text
BOUND_SLACK = 2


class PromptError(ValueError):
    """The request's prompt cannot be turned into tokens (a 400 for the client)."""


def context_error(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> str | None:
    """vLLM's refusal when a prompt (and its requested output) cannot fit the model's context; None if it fits."""
    if max_tokens is None:
        if prompt_tokens < max_model_len:
            return None
        return (f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{prompt_tokens} tokens. Please reduce the length of the input.")
    if prompt_tokens + max_tokens <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion). "
            f"Please reduce the length of the prompt or completion.")


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
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self.tokenizer.get_vocab_size(), max(vocab.values(), default=-1) + 1)
        # characters one token can cover at most (byte-level vocabularies spell a byte per character)
        self.max_token_chars = max((len(t) for t in vocab), default=1) or 1

    # ---- bounds ------------------------------------------------------------------------------
    def check_length(self, chars: int, token_budget: int | None) -> None:
        """Refuse a text of ``chars`` characters that must tokenize to more than ``token_budget`` tokens."""
        if token_budget is not None and chars > token_budget * self.max_token_chars * BOUND_SLACK:
            raise PromptError(f"the prompt ({chars} characters) is longer than the {token_budget} tokens any "
                              f"served model accepts")

    def check_ids(self, ids: Any, token_budget: int | None) -> list[int]:
        """A list of token ids as given by a client: ints (not bools) inside the vocabulary, within budget."""
        if not isinstance(ids, list) or not ids:
            raise PromptError("a token-id prompt must be a non-empty list of integers")
        if token_budget is not None and len(ids) > token_budget:
            raise PromptError(f"the prompt ({len(ids)} tokens) is longer than the {token_budget} tokens any "
                              f"served model accepts")
        vocab = self.vocab_size
        for t in ids:
            if type(t) is not int:  # bool is an int subclass: True is not a token id
                raise PromptError(f"token ids must be integers, got {type(t).__name__}")
            if not 0 <= t < vocab:
                raise PromptError(f"token id {t} is out of vocabulary (size {vocab})")
        return ids

    # ---- text --------------------------------------------------------------------------------
    def encode(self, text: str, token_budget: int | None = None) -> list[int]:
        if not isinstance(text, str):
            raise PromptError("text to tokenize must be a string")
        self.check_length(len(text), token_budget)
        try:
            return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids  # releases the GIL
        except (TypeError, ValueError, UnicodeError) as e:  # a lone surrogate is not valid UTF-8 text
            raise PromptError(f"the prompt cannot be tokenized: {e}") from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, token_budget: int | None = None) -> str:
        if self._template is None:
            raise PromptError("this model has no chat template")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        norm = []
        chars = 0
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise PromptError("each message needs a string 'role'")
            content = m.get("content", "")
            if content is None:  # an assistant turn with tool calls only
                content = ""
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                texts = []
                for part in content:
                    if not isinstance(part, dict):
                        raise PromptError("each content part must be an object")
                    if part.get("type", "text") != "text":
                        continue
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise PromptError("a text content part needs a string 'text'")
                    texts.append(text)
                content = "".join(texts)
            if not isinstance(content, str):
                raise PromptError("message 'content' must be a string or a list of text parts")
            chars += len(content) + len(m["role"])
            self.check_length(chars, token_budget)
            norm.append({"role": m["role"], "content": content})
        try:
            return self._template.render(messages=norm, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise PromptError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: Any, token_budget: int | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, token_budget=token_budget), token_budget)

    def prompt_ids(self, body: dict[str, Any], chat: bool, token_budget: int | None = None) -> list[int]:
        """Token ids of an OpenAI request body (completions: str or ids; chat: messages)."""
        if chat:
            return self.encode_chat(body.get("messages"), token_budget)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):  # a batch of one
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.encode(prompt, token_budget)
        if isinstance(prompt, list) and prompt:
            return self.check_ids(prompt, token_budget)
        raise PromptError("'prompt' must be a non-empty string or list of token ids (batches of one)")


@lru_cache(maxsize=16)
def load_tokenizer(path: str = str(DEFAULT_TOKENIZER_DIR)) -> PromptTokenizer:
    return PromptTokenizer(path)
