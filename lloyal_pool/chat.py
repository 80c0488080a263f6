"""Chat formats by name, for models whose GGUF carries no chat template (the default model, Gemma 3 270M's
base model, is one). Each is Jinja source for llama.cpp's chat engine, written here from the format's
published description; ``Model.apply_chat_template(template="gemma")`` uses it.

    gemma   <start_of_turn>user ... <end_of_turn> turns, the assistant's role called "model", a system
            message folded into the first user turn
    chatml  <|im_start|>role ... <|im_end|> turns
    llama3  <|start_header_id|>role<|end_header_id|> headers, <|eot_id|> after each turn

The templates write the model's BOS first, as the originals do; llama.cpp's engine takes it off the
rendered prompt when the model adds BOS itself, so the prompt starts with the first turn and a generate
adds the BOS once.
"""

from __future__ import annotations

GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = (messages[0]['content'] | trim) ~ '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

CHATML = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

#: Format name -> Jinja source.
CHAT_FORMATS: dict[str, str] = {"gemma": GEMMA, "chatml": CHATML, "llama3": LLAMA3}


def template_source(template: str | None) -> str:
    """The Jinja source for ``template``: "" (the model's own) for None, a format of CHAT_FORMATS by name,
    else the string itself, which must then be Jinja (ValueError for an unknown name)."""
    if template is None:
        return ""
    if template in CHAT_FORMATS:
        return CHAT_FORMATS[template]
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(f"unknown chat format {template!r}: one of {sorted(CHAT_FORMATS)}, or Jinja source")


__all__ = ["CHAT_FORMATS", "template_source"]
