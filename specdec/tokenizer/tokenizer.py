"""Tokenizer: a ``tokenizers`` tokenizer.json plus the chat template and special ids from the model folder."""

from __future__ import annotations

import json
import os
from datetime import datetime

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: str):
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json`` for the chat template) from directory ``path``."""
        file = os.path.join(path, "tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"cannot read tokenizer at {file}: {e}") from e
        cfg_file = os.path.join(path, "tokenizer_config.json")
        cfg = {}
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)
        # the chat template: chat_template.jinja (what recent hub checkpoints ship) over tokenizer_config.json's
        # "chat_template" - a string, or a list of {"name", "template"} whose "default" is the template
        self.chat_templates: dict[str, str] = _named_templates(cfg.get("chat_template"))
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                self.chat_templates["default"] = f.read()
        self.chat_template: str | None = self.chat_templates.get("default")
        self.bos_token: str | None = _token_str(cfg.get("bos_token"))
        self.eos_token: str | None = _token_str(cfg.get("eos_token"))
        self.add_bos_token: bool = bool(cfg.get("add_bos_token", False))
        self.add_eos_token: bool = bool(cfg.get("add_eos_token", False))
        # who adds the special tokens, as transformers' PreTrainedTokenizerFast (5.x) decides: tokenizer.json's
        # post-processor when it has one (Llama 3's adds <|begin_of_text|> that way; tokenizer_config.json's
        # add_bos_token is then not read), else tokenizer_config.json's add_bos_token / add_eos_token (transformers 5
        # then adds nothing; our GGUF conversions write no post-processor and rely on the config)
        self._config_decides = self._tok.post_processor is None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def from_dir(path: str) -> Tokenizer | None:
        """The tokenizer in ``path``, or None when the folder has no tokenizer.json."""
        return Tokenizer(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS / EOS transformers would add (see
        ``_config_decides``) - except leading special tokens the text already starts with (a rendered chat
        template's BOS), which are not added twice."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if not add_special_tokens:
            return ids
        if self._config_decides:
            bos = self._tok.token_to_id(self.bos_token) if self.add_bos_token and self.bos_token else None
            eos = self._tok.token_to_id(self.eos_token) if self.add_eos_token and self.eos_token else None
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
            return ids + [eos] if eos is not None else ids
        full = self._tok.encode(text, add_special_tokens=True).ids
        start = next((p for p in range(len(full) - len(ids) + 1) if full[p:p + len(ids)] == ids), 0)
        prefix, suffix = full[:start], full[start + len(ids):]
        if prefix and ids[:len(prefix)] == prefix:  # the text starts with what the post-processor would prepend
            return ids + suffix
        return full

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar engine builds its token table from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            chat_template_kwargs: dict | None = None) -> str:
        """Render ``messages`` with the model's Jinja chat template, as transformers does; ``tools`` (OpenAI's
        function tools) are passed to the template as ``tools``. A message's content may be None only on an
        assistant message with ``tool_calls``. ``chat_template``: the name of one of the model's named templates
        (``chat_templates``) or a template's text, instead of the default; ``chat_template_kwargs``: more variables
        for the template (e.g. ``{"enable_thinking": False}``)."""
        template = self.chat_templates.get(chat_template, chat_template) if chat_template else self.chat_template
        if not template:
            raise ValueError("this model has no chat template (chat_template.jinja, or tokenizer_config.json "
                             "'chat_template'); give one (chat_template=, --chat-template) or use generate() with a "
                             "plain prompt instead of chat()")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved} (they come from the request)")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")))
            for m in messages
        ):
            raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
        return _compile_template(template).render(
            **kwargs,
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _named_templates(value) -> dict[str, str]:
    """tokenizer_config.json's ``chat_template``: a string (the default) or a list of ``{"name", "template"}``."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


def load_chat_template(value: str) -> str:
    """``--chat-template``'s value: a file's path (its text), else the template's text itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _compile_template(source: str):
    """A sandboxed Jinja environment configured like transformers' chat-template renderer."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                               ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
