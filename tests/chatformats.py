"""A chat format for the tests: Hermes-style (ChatML turns, <tool_call>{json}</tool_call> calls, <think>
blocks), written here as Jinja source. llama.cpp's format analysis finds its tool-call and reasoning
markers by rendering it."""

from __future__ import annotations

HERMES = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "To call one, write <tool_call>\n{\"name\": <name>, \"arguments\": <arguments>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n{% endif %}"
    "{{ m.content }}"
    "{% for tc in m.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}]
