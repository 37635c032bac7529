"""What a chat template reads, and which of a request's `chat_template_kwargs` reach it.

`tokenizer.apply_chat_template(messages, **kwargs)` takes some names as its own arguments and hands the rest to the
template. A request's `chat_template_kwargs` must only ever be the second kind: `{"self": 1}` was a TypeError 500,
`sanitize_control_tokens` or `return_assistant_tokens_mask` switch transformers' own behaviour, and a name the
template environment defines (`raise_exception`, `namespace`) would replace a function the template calls. So:
- a name in `RESERVED_TEMPLATE_ARGS` is a 400 naming it (tests/fast/test_transformers_contracts.py checks that the list
  covers apply_chat_template's and its renderer's parameters in the pinned transformers);
- of the rest, only the variables the template itself reads are passed on (jinja2's `find_undeclared_variables`
  over the template's syntax tree, as vLLM does); any other name would have no effect on the prompt, and is left
  out rather than handed to transformers, so that no argument a later transformers takes from `**kwargs` can be
  set by a client.
"""

from __future__ import annotations

import logging
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.ext import Extension, loopcontrols

from app.errors import InvalidRequest

log = logging.getLogger("app.models.chat_template")

# apply_chat_template's and render_jinja_template's own parameters, and the functions transformers' template
# environment provides (jinja2's defaults, raise_exception, strftime_now): the server sets them, never a request
RESERVED_TEMPLATE_ARGS = frozenset({
    "self", "conversation", "conversations", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "sanitize_control_tokens", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs", "processor_kwargs",
    "raise_exception", "strftime_now", *jinja2.Environment().globals})


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (assistant-token masks): parsed as its body alone."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def template_variables(chat_template: str | dict[str, str] | None) -> frozenset[str] | None:
    """The variables a chat template (or a tokenizer's named templates, all together) reads; None if it cannot be
    parsed here, and then every name outside RESERVED_TEMPLATE_ARGS is passed on as before."""
    if not chat_template:
        return frozenset()
    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    env = jinja2.Environment(extensions=[loopcontrols, _Generation])
    names: set[str] = set()
    try:
        for source in sources:
            names |= meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateError as err:  # transformers renders it with its own environment: pass names on unchecked
        log.warning("chat template not parsed for its variables (%s); chat_template_kwargs go to it unchecked", err)
        return None
    return frozenset(names)


def passed_kwargs(kwargs: dict[str, Any], variables: frozenset[str] | None) -> dict[str, Any]:
    """The kwargs to hand to apply_chat_template: the server's own (reserved names: a request's were refused where
    it was read, app/openai/protocol.py) and those the template reads (all, if its variables are unknown)."""
    return {k: v for k, v in kwargs.items() if variables is None or k in variables or k in RESERVED_TEMPLATE_ARGS}


def render_chat(tokenizer, variables: frozenset[str] | None, messages, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
    """Render with the tokenizer's own chat template (and its way of showing `tools`), ending in the assistant's
    turn. `template_kwargs` are the template's own switches, such as Qwen3's `enable_thinking`.

    A template that cannot render these messages is the caller's problem to fix, not a server fault: no template
    at all, one that raises on the role order or a system message (`raise_exception`), values nested deeper than
    transformers' conversion of messages or the template's `tojson` can recurse (RecursionError at about 480
    levels), or a value the template cannot handle (TypeError). The request is all that went in here, so whatever
    is raised is a 400, never a 500."""
    try:
        return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **passed_kwargs(template_kwargs or {}, variables))
    except RecursionError as err:
        raise InvalidRequest("the messages or tools are nested too deeply for the chat template to render",
                             param="messages") from err
    except (jinja2.TemplateError, ValueError) as err:  # transformers raises ValueError when there is no template
        raise InvalidRequest(f"the model's chat template cannot render these messages: {_short(err)}",
                             param="messages") from err
    except Exception as err:
        raise InvalidRequest(f"the model's chat template cannot render these messages: "
                             f"{type(err).__name__}: {_short(err)}", param="messages") from err


def _short(err: Exception, limit: int = 500) -> str:
    """An exception's message for a client: a template's error may quote a whole (large) value."""
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "..."
