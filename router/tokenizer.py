"""Prompt -> token ids exactly as the engine computes them (same tokenizer file, same chat template).

The router must see the token ids the engine will hash, or block keys would never match. A model
directory holds ``tokenizer.json`` (the ``tokenizers`` format every HF model ships) and optionally
``tokenizer_config.json`` with a Jinja ``chat_template``, rendered as transformers does.

Every prompt is checked before it costs anything: a text longer than ``token_budget`` tokens could
possibly cover is refused without tokenizing it (no token covers more characters than the longest one in
the vocabulary, so ``len(text) / longest`` is a lower bound on its token count), token ids must be
integers inside the vocabulary, and chat parts must be text. ``encode`` releases the GIL (the Rust
tokenizer's batch entry point), so a caller may run it on a worker thread beside an event loop.

Request bodies (``request_prompts``): a completions ``prompt`` and an embeddings ``input`` take vLLM's four
shapes (a string, a list of strings, a list of token ids, a list of token-id lists), at most ``MAX_BATCH``
prompts, each checked as above and named by its index when refused (``prompt[2]: ...``); chat renders
``messages`` through the template; a Responses request renders ``instructions`` (a system message) and
``input`` (a string, or message items whose content is a string or input_text/output_text/text parts) the
same way.
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
MAX_BATCH = 256  # prompts (or embedding inputs) in one request
KINDS = ("completions", "chat", "embeddings", "responses")  # what a request body is, by its endpoint
RESPONSE_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})  # Responses content parts that carry text


class PromptError(ValueError):
    """The request's prompt cannot be turned into tokens (a 400 for the client)."""


def context_error(prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                  embedding: bool = False) -> str | None:
    """vLLM's refusal when a prompt (and its requested output) cannot fit the model's context; None if it fits.
    ``embedding``: the input of an embedding request, which generates nothing (it may fill the context)."""
    if embedding:
        if prompt_tokens <= max_model_len:
            return None
        return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_tokens} tokens in the input for embedding generation. Please reduce the length of the "
                f"input.")
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


CHAT_TEXT_PARTS = frozenset({"text", None})  # chat: a part without a type is text


def text_of_parts(parts: list[Any], kinds: frozenset[str | None]) -> str:
    """The text of OpenAI content parts whose ``type`` is one of ``kinds`` (images and the rest are skipped: the
    router keys on text); a text part without a string ``text`` is refused."""
    texts = []
    for part in parts:
        if not isinstance(part, dict):
            raise PromptError("each content part must be an object")
        if part.get("type") not in kinds:
            continue
        text = part.get("text")
        if not isinstance(text, str):
            raise PromptError("a text content part needs a string 'text'")
        texts.append(text)
    return "".join(texts)


class PromptTokenizer:
    def __init__(self, path: str | Path = DEFAULT_TOKENIZER_DIR) -> None:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        self.tokenizer = Tokenizer.from_file(str(file))
        # the batch call without character offsets (tokenizers >= 0.20), else the one with them
        self._encode_batch = getattr(self.tokenizer, "encode_batch_fast", None) or self.tokenizer.encode_batch
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
    def encode(self, text: str, token_budget: int | None = None, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise PromptError("text to tokenize must be a string")
        self.check_length(len(text), token_budget)
        return self._encode_texts([text], add_special_tokens)[0]

    def _encode_texts(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Texts already checked for length, in one call (it releases the GIL). The call is ``encode_batch_fast``
        where the library has it: the same ids without the character offsets nothing here reads (0.65-0.8x the
        CPU of ``encode_batch`` on texts of 2K characters and more, measured once; on one short text 0.8x the CPU
        of ``encode``, all of it in the calling thread: a batch of one is not handed to the thread pool)."""
        try:
            return [e.ids for e in self._encode_batch(texts, add_special_tokens=add_special_tokens)]
        except (TypeError, ValueError, UnicodeError) as e:  # a lone surrogate is not valid UTF-8 text
            raise PromptError(f"the prompt cannot be tokenized: {e}") from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (vLLM's ``return_token_strs``)."""
        return [self.tokenizer.id_to_token(t) or "" for t in ids]

    def encode_prompts(self, members: list[Any], token_budget: int | None = None,
                       name: str = "prompt") -> list[list[int]]:
        """Token ids of each member of a batch (``prompt_batch``): texts checked for length then tokenized in one
        call, token-id lists checked; a refused member is named by its index when there are several."""
        batch = len(members) > 1

        def named(i: int, e: PromptError) -> PromptError:
            return PromptError(f"{name}[{i}]: {e}" if batch else str(e))

        out: list[list[int]] = [[] for _ in members]
        texts: list[tuple[int, str]] = []
        for i, m in enumerate(members):
            try:
                if isinstance(m, str):
                    if not m:
                        raise PromptError(f"'{name}' must not be an empty string")
                    self.check_length(len(m), token_budget)
                    texts.append((i, m))
                else:
                    out[i] = self.check_ids(m, token_budget)
            except PromptError as e:
                raise named(i, e) from None
        if texts:
            try:
                encoded = self._encode_texts([t for _, t in texts])
            except PromptError:
                for i, t in texts:  # name the member that cannot be tokenized
                    try:
                        self._encode_texts([t])
                    except PromptError as e:
                        raise named(i, e) from None
                raise
            for (i, _), ids in zip(texts, encoded, strict=True):
                out[i] = ids
        return out

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
                content = text_of_parts(content, CHAT_TEXT_PARTS)
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

    def responses_messages(self, body: dict[str, Any]) -> list[dict[str, str]]:
        """A Responses API request as chat messages: ``instructions`` first as the system message, then
        ``input`` (a string: one user message; or message items). Items of other types (tool calls and their
        outputs, reasoning) are left out of what is routed on; non-text content parts likewise."""
        messages: list[dict[str, str]] = []
        instructions = body.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise PromptError("'instructions' must be a string")
            if instructions:
                messages.append({"role": "system", "content": instructions})
        items = body.get("input")
        if isinstance(items, str) and items:
            return [*messages, {"role": "user", "content": items}]
        if not isinstance(items, list) or not items:
            raise PromptError("'input' must be a non-empty string or a non-empty list of message items")
        system = len(messages)
        for item in items:
            if not isinstance(item, dict):
                raise PromptError("each 'input' item must be an object")
            if item.get("type", "message") != "message":
                continue
            role, content = item.get("role"), item.get("content")
            if not isinstance(role, str) or not role:
                raise PromptError("each 'input' message needs a string 'role'")
            if isinstance(content, list):
                content = text_of_parts(content, RESPONSE_TEXT_PARTS)
            if not isinstance(content, str):
                raise PromptError("message 'content' must be a string or a list of text parts")
            messages.append({"role": role, "content": content})
        if len(messages) == system:
            raise PromptError("'input' holds no message items")
        return messages

    def request_prompts(self, body: dict[str, Any], kind: str, token_budget: int | None = None) -> list[list[int]]:
        """Token ids of every prompt of an OpenAI request body, by the endpoint's kind (``KINDS``): completions
        (``prompt``) and embeddings (``input``) may be batches; chat and responses are one prompt."""
        if kind == "chat":
            return [self.encode_chat(body.get("messages"), token_budget)]
        if kind == "responses":
            return [self.encode_chat(self.responses_messages(body), token_budget)]
        name = "input" if kind == "embeddings" else "prompt"
        return self.encode_prompts(prompt_batch(body.get(name), name), token_budget, name)

    def prompt_ids(self, body: dict[str, Any], chat: bool, token_budget: int | None = None) -> list[int]:
        """Token ids of a one-prompt request body (completions: str or ids, or a batch of one; chat: messages)."""
        prompts = self.request_prompts(body, "chat" if chat else "completions", token_budget)
        if len(prompts) != 1:
            raise PromptError(f"'prompt' must be one prompt here, not a batch of {len(prompts)}")
        return prompts[0]


def prompt_batch(value: Any, name: str = "prompt") -> list[Any]:
    """The members of a completions ``prompt`` or an embeddings ``input`` as the client wrote them, from vLLM's
    four shapes: a string, a list of strings, a list of token ids (one prompt), a list of token-id lists.
    Members are not checked here (``encode_prompts`` does); the count is bounded by ``MAX_BATCH``."""
    shapes = (f"'{name}' must be a non-empty string, list of strings, list of token ids or list of token-id "
              f"lists")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise PromptError(shapes)
    strings = sum(isinstance(v, str) for v in value)
    lists = sum(isinstance(v, list) for v in value)
    if not strings and not lists:
        return [value]  # one token-id prompt (its ids are checked with the others)
    if strings != len(value) and lists != len(value):
        raise PromptError(shapes + ", not a mix")
    if len(value) > MAX_BATCH:
        raise PromptError(f"'{name}' holds {len(value)} prompts; at most {MAX_BATCH} are served in one request")
    return value


@lru_cache(maxsize=16)
def load_tokenizer(path: str = str(DEFAULT_TOKENIZER_DIR)) -> PromptTokenizer:
    return PromptTokenizer(path)
