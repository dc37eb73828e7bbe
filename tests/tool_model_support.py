"""A model whose chat template takes tools, for the tool-call tests: tiny-random's prepared
folder with a Hermes-style template (the `<tool_call>` JSON format Qwen 2.5 and SmolLM3 use),
and the token ids of an answer to script with the engine's `script` fault (a tiny random model
writes no call by chance)."""

from __future__ import annotations

import shutil
from pathlib import Path

from generation import models

# Qwen 2.5's tool template, shortened to fit tiny-random's 512-token context.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def tool_model_folder(root: Path, template: str = HERMES_TEMPLATE) -> Path:
    """tiny-random's folder copied under `root` (as `tiny-tools`) with `template`."""
    folder = root / "tiny-tools"
    shutil.copytree(models.prepare("tiny-random"), folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def scripted_ids(loaded: models.LoadedModel, text: str, eos: bool = True) -> list[int]:
    """The token ids of `text` as the model's answer (then its end, with `eos`)."""
    tokenizer = loaded.frontend_tokenizer
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level BPE: every text round-trips
    return ids + ([min(loaded.eos_token_ids)] if eos else [])
