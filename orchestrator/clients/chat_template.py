"""The served model's own tokenizer and chat template, read from its Hugging Face folder, for an
`openai` backend whose server has no `/tokenize` (`transformers serve`; DESIGN section 7): with
`api: completions` a chat request becomes the templated prompt text, and an FMS prompt's tokens
are counted here.

Why not `transformers.AutoTokenizer`: importing it loads torch (seconds, hundreds of MB) into the
orchestrator. `tokenizers` (Rust, no torch) reads `tokenizer.json`; the template is rendered the
way transformers renders it (a sandboxed jinja2 environment with `trim_blocks`, `lstrip_blocks`,
loop controls, `raise_exception`, `tojson`, `strftime_now`), with the special tokens of
`tokenizer_config.json` as variables.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The folder cannot be used, or the template refused the conversation."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class LocalTokenizer:
    """One folder's tokenizer and chat template; loaded once, off the event loop."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._loaded: tuple[Tokenizer, Any, dict[str, str]] | None = None
        self._lock = asyncio.Lock()

    def _load(self) -> tuple[Tokenizer, Any, dict[str, str]]:
        root = Path(self.folder)
        try:
            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            config: dict[str, Any] = {}
            if (root / "tokenizer_config.json").is_file():
                config = json.loads((root / "tokenizer_config.json").read_text())
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises plain Exception
            raise ChatTemplateError(f"tokenizer {self.folder}: {exc}") from None
        source = config.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            raise ChatTemplateError(f"tokenizer {self.folder}: no chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        special = {
            key: _token_text(config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        return tokenizer, env.from_string(source), special

    async def _get(self) -> tuple[Tokenizer, Any, dict[str, str]]:
        async with self._lock:
            if self._loaded is None:
                self._loaded = await asyncio.to_thread(self._load)
            return self._loaded

    async def render(self, messages: list[dict[str, Any]]) -> str:
        """The conversation as the model's template writes it, with the generation prompt."""
        _, template, special = await self._get()
        try:
            return await asyncio.to_thread(
                template.render, messages=messages, add_generation_prompt=True, **special
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None

    async def count(self, text: str) -> int:
        """Tokens of a text, without special tokens added (a template writes its own)."""
        tokenizer, _, _ = await self._get()
        encoding = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
        return len(encoding.ids)
