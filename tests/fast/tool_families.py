"""Tool-call text as each family writes it, for the parser suites (test_tools*.py): `write(fmt, calls, content)`
gives the model's text for some calls, after some content, in format `fmt` ("mistral:list" and "deepseek_v3:v3.1"
are the second spellings of those families). `broken(fmt)` is a call whose arguments do not parse."""

from __future__ import annotations

import json

# the formats a parser reads, with the second spellings of two families
FAMILIES = ["hermes", "llama3_json", "pythonic", "mistral", "mistral:list", "deepseek_v3", "deepseek_v3:v3.1",
            "granite", "phi4_mini", "qwen3_coder", "harmony"]
# markers that must never reach content (nor their starts, the first few characters)
MARKERS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "pythonic": "<|python_start|>",
           "mistral": "[TOOL_CALLS]", "deepseek_v3": "<｜tool▁calls▁begin｜>", "granite": "<|tool_call|>",
           "phi4_mini": "<|tool_call|>", "qwen3_coder": "<tool_call>", "harmony": "<|channel|>"}
TOOLS = ["get_weather", "get_time", "noop", "write_file"]
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                           "note": {"type": "string"}}},
           "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}},
           "noop": {"type": "object", "properties": {}},
           "write_file": {"type": "object", "properties": {"path": {"type": "string"},
                                                          "content": {"type": "string"}}}}

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def parser_name(fmt: str) -> str:
    return fmt.partition(":")[0]


def _py(value) -> str:
    return repr(value) if not isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _args(args: dict | str) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def write(fmt: str, calls: list[tuple[str, dict | str]], content: str = "") -> str:
    """The model's text: `content`, then `calls` ((name, arguments dict, or their raw text)) in format `fmt`."""
    if fmt == "hermes":
        return content + "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {_args(a)}}}\n</tool_call>'
                                   for n, a in calls)
    if fmt == "llama3_json":
        body = "; ".join(f'{{"name": "{n}", "parameters": {_args(a)}}}' for n, a in calls)
        return content + "<|python_tag|>" + body if content else body
    if fmt == "pythonic":
        body = "[" + ", ".join(n + "(" + (a if isinstance(a, str) else ", ".join(f"{k}={_py(v)}" for k, v in a.items()))
                               + ")" for n, a in calls) + "]"
        return content + "<|python_start|>" + body + "<|python_end|>" if content else body
    if fmt == "mistral":
        return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{_args(a)}" for n, a in calls)
    if fmt == "mistral:list":
        return content + "[TOOL_CALLS] [" + ", ".join(f'{{"name": "{n}", "arguments": {_args(a)}}}'
                                                      for n, a in calls) + "]"
    if fmt == "deepseek_v3":
        return content + DS_CALLS + "\n".join(f"{DS_CALL}function{DS_SEP}{n}\n```json\n{_args(a)}\n```{DS_CALL_END}"
                                              for n, a in calls) + DS_CALLS_END
    if fmt == "deepseek_v3:v3.1":
        return content + DS_CALLS + "".join(f"{DS_CALL}{n}{DS_SEP}{_args(a)}{DS_CALL_END}" for n, a in calls) \
            + DS_CALLS_END
    if fmt in ("granite", "phi4_mini"):
        body = "[" + ", ".join(f'{{"name": "{n}", "arguments": {_args(a)}}}' for n, a in calls) + "]"
        return content + "<|tool_call|>" + body + ("<|/tool_call|>" if fmt == "phi4_mini" else "")
    if fmt == "qwen3_coder":
        def params(a):
            if isinstance(a, str):
                return a
            return "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                           for k, v in a.items())
        return content + "\n".join(f"<tool_call>\n<function={n}>\n{params(a)}</function>\n</tool_call>"
                                   for n, a in calls)
    if fmt == "harmony":
        return content + "".join(f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
                                 f"<|message|>{_args(a)}<|call|>" for n, a in calls)
    raise ValueError(fmt)


def broken(fmt: str) -> str:
    """A call of an offered tool whose arguments are not valid in the format: text, never a call."""
    if fmt == "pythonic":
        return write(fmt, [("get_weather", 'city="Paris",,')])
    if fmt == "qwen3_coder":
        return write(fmt, [("get_weather", "<parameter=>\nParis\n</parameter>\n")])
    return write(fmt, [("get_weather", '{"city": "Paris",}')])
