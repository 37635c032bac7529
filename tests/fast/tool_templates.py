"""Minimal chat templates written in each family's shape, for the tool tests: no family's real template can be
built offline here (the tests download nothing), so these follow the real ones' tool parts: how tools are shown, how
an assistant turn writes its calls (in the format the family's parser reads), how a tool result comes back, and
what the generation prompt ends with. Faithful in what the tool round trip touches, not in the system prompts' words.
Mistral's raises on a call id that is not 9 letters or digits, as the real one does. DeepSeek's real template
concatenates `arguments` as a string, which the dict that templates are given (transformers rebuilds messages as
plain JSON types) cannot be: this one applies `tojson`, as templates written for servers that pass a dict do.

`FAMILY_TEMPLATES[fmt]` = (template, the text the generation prompt ends with, (start, end) around an assistant
turn's calls in a rendered prompt)."""

from __future__ import annotations


def _template(tools: str, turn: str, calls: str, tool: str, gen: str) -> str:
    return ("{% if tools %}" + tools + "{% endif %}"
            "{% for m in messages %}"
            "{% if m.role == 'assistant' and m.tool_calls %}" + calls +
            "{% elif m.role == 'tool' %}" + tool +
            "{% else %}" + turn + "{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}" + gen + "{% endif %}")


LLAMA_TOOLS = ("<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n{instructions}\n\n"
               "{{% for t in tools %}}{{{{ t | tojson }}}}\n\n{{% endfor %}}<|eot_id|>")
LLAMA_TURN = "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
LLAMA_TOOL = "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
LLAMA_GEN = "<|start_header_id|>assistant<|end_header_id|>\n\n"

FAMILY_TEMPLATES = {
    "llama3_json": (_template(
        LLAMA_TOOLS.format(instructions='Respond in the format {"name": function name, "parameters": dictionary of '
                                        'argument name and its value}.'),
        LLAMA_TURN,
        LLAMA_GEN + "{% for call in m.tool_calls %}{{ '{\"name\": \"' + call.function.name + '\", \"parameters\": ' }}"
        "{{ call.function.arguments | tojson }}}{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>",
        LLAMA_TOOL, LLAMA_GEN), "<|end_header_id|>\n\n", (LLAMA_GEN, "<|eot_id|>")),
    "pythonic": (_template(
        LLAMA_TOOLS.format(instructions="Respond in the format [func_name1(params_name1=params_value1, "
                                        "params_name2=params_value2...), func_name2(params)]"),
        LLAMA_TURN,
        LLAMA_GEN + "[{% for call in m.tool_calls %}{{ call.function.name }}("
        "{% for k, v in call.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, "
        "{% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]<|eot_id|>",
        LLAMA_TOOL, LLAMA_GEN), "<|end_header_id|>\n\n", (LLAMA_GEN, "<|eot_id|>")),
    "mistral": (_template(
        "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]",
        "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% else %}{{ m.content }}</s>{% endif %}",
        "{% for call in m.tool_calls %}"
        "{% if call.id is not string or call.id | length != 9 or not call.id.isalnum() %}"
        "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
        "[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}{% endfor %}</s>",
        "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]", ""), "[/INST]", ("[/INST]", "</s>")),
    "deepseek_v3": (_template(
        "## Tools\nCall them as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n"
        "ARGUMENTS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}",
        "{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% else %}<｜Assistant｜>{{ m.content }}"
        "<｜end▁of▁sentence｜>{% endif %}",
        "<｜Assistant｜><｜tool▁calls▁begin｜>{% for call in m.tool_calls %}"
        "{{ '<｜tool▁call▁begin｜>' + call.type + '<｜tool▁sep｜>' + call.function.name + '\\n```json\\n' + "
        "(call.function.arguments | tojson) + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
        "<｜Assistant｜>"), "<｜Assistant｜>", ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")),
    "granite": (_template(
        "<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>\n",
        "<|start_of_role|>{{ m.role }}<|end_of_role|>{{ m.content }}<|end_of_text|>\n",
        "<|start_of_role|>assistant<|end_of_role|>{{ '<|tool_call|>' + "
        "(m.tool_calls | map(attribute='function') | list | tojson) }}<|end_of_text|>\n",
        "<|start_of_role|>tool_response<|end_of_role|>{{ m.content }}<|end_of_text|>\n",
        "<|start_of_role|>assistant<|end_of_role|>"), "<|end_of_role|>",
        ("<|start_of_role|>assistant<|end_of_role|>", "<|end_of_text|>")),
    "phi4_mini": (_template(
        "<|system|>You are a helpful assistant.<|tool|>{{ tools | tojson }}<|/tool|><|end|>",
        "<|{{ m.role }}|>{{ m.content }}<|end|>",
        "<|assistant|><|tool_call|>{{ m.tool_calls | map(attribute='function') | list | tojson }}<|/tool_call|><|end|>",
        "<|tool_response|>{{ m.content }}<|end|>", "<|assistant|>"), "<|assistant|>", ("<|assistant|>", "<|end|>")),
    "qwen3_coder": (_template(
        "<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n<function><name>{{ t.function.name }}</name>"
        "</function>{% endfor %}\n</tools>\nTo call a function reply in the following format:\n<tool_call>\n"
        "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n",
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n",
        "<|im_start|>assistant\n{% for call in m.tool_calls %}\n<tool_call>\n<function={{ call.function.name }}>\n"
        "{% for k, v in call.function.arguments.items() %}\n<parameter={{ k }}>\n"
        "{{ v if v is string else v | tojson }}\n</parameter>{% endfor %}\n</function>\n</tool_call>"
        "{% endfor %}<|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n"), "\n", ("<|im_start|>assistant\n", "<|im_end|>")),
    "harmony": (_template(
        "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n{% for t in tools %}"
        "type {{ t.function.name }} = (_: any) => any;\n{% endfor %}} // namespace functions<|end|>",
        "<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>",
        "{% for call in m.tool_calls %}<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary "
        "json<|message|>{{ call.function.arguments | tojson }}<|call|>{% endfor %}",
        "<|start|>functions to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>",
        "<|start|>assistant"), "<|start|>assistant", ("<|end|>", "<|start|>functions")),
}
