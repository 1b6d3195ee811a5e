"""Chat templates: the model's own Jinja template (tokenizer.chat_template) rendered the
way HF transformers renders it, so a prompt built here tokenizes to the same ids the
model saw in training.

Templates come from downloaded files, so they run in Jinja's immutable sandbox. The
environment mirrors transformers' (trim_blocks, lstrip_blocks, loop controls, a tojson
that keeps non-ASCII and does not HTML-escape, raise_exception, strftime_now).

A GGUF without a template gets CHATML_TEMPLATE: ChatML is what Qwen models (the only
family we run) are trained on, so it is the least surprising fallback.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from minfer.errors import MinferError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(MinferError, ValueError):
    """The messages are malformed, or the chat template rejected them or is broken."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2.ext
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse (line {e.lineno}): {e.message}") from None


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{k}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{k}] needs a non-empty string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatTemplateError(f"messages[{k}]['content'] must be a string, got {type(content).__name__}")
        out.append(dict(m))
    return out


def render_chat(messages: list[dict], add_generation_prompt: bool = True, template: str | None = None,
                **kwargs: Any) -> str:
    """Render `messages` with `template` (None: CHATML_TEMPLATE).

    Extra keyword arguments (tools=..., enable_thinking=..., bos_token=..., eos_token=...)
    are passed to the template, as transformers' apply_chat_template does. This module
    knows no tokenizer: `Tokenizer.render_chat` passes the model's template and its
    bos/eos spellings.
    """
    from jinja2.exceptions import TemplateError

    msgs = _check_messages(messages)
    compiled = _compile(template if template is not None else CHATML_TEMPLATE)
    ctx: dict[str, Any] = {"tools": None, "documents": None}
    ctx.update(kwargs)
    try:
        return compiled.render(messages=msgs, add_generation_prompt=bool(add_generation_prompt), **ctx)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template refused these messages: {e}") from None
    except (TypeError, KeyError, AttributeError, IndexError) as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
