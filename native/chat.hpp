// Chat prompts through llama.cpp's own Jinja engine and chat formats (common/chat): the model's template,
// or Jinja source given by the caller; the parser of the format a template yields, for model output.
// No pybind11 here.
#pragma once

#include "model.hpp"

#include <string>
#include <utility>
#include <vector>

namespace lloyal {

struct chat_request {
    std::vector<std::pair<std::string, std::string>> messages;  // (role, content)
    std::string template_source;  // Jinja; empty: the model's own
    bool add_generation_prompt = true;
    std::string tools_json;  // an OpenAI-style "tools" array as JSON; empty: none
};

// The prompt text. template_error for a model without a template when none is given, a template that
// does not parse or fails to render, or tools JSON that is not a tools array.
std::string apply_chat(const Model & model, const chat_request & req);

// A conversation as OpenAI-style messages (JSON: role, content, and tool_calls, tool_call_id,
// reasoning_content where they apply), for format_chat and parse_chat.
struct chat_conversation {
    std::string messages_json;  // a JSON array of messages
    std::string template_source;  // Jinja; empty: the model's own
    bool add_generation_prompt = true;
    std::string tools_json;  // an OpenAI-style "tools" array as JSON; empty: none
    std::string tool_choice = "auto";  // "auto", "required" or "none"
};

// What generating the next assistant turn needs: the prompt, and for tools the grammar common/chat made
// for the format's tool calls (lazy: free text until a trigger), with its triggers in the forms a
// grammar_spec takes (words, patterns anchored already, tokens).
struct chat_prompt {
    std::string prompt;
    std::string format;  // common_chat_format_name
    std::string grammar;  // GBNF; empty: none
    bool grammar_lazy = false;
    std::vector<std::string> trigger_words;
    std::vector<std::string> trigger_patterns;
    std::vector<llama_token> trigger_tokens;
    std::vector<std::string> preserved_tokens;
    std::vector<std::string> additional_stops;
    std::string generation_prompt;  // what the template appends to start the assistant's turn
};

chat_prompt format_chat(const Model & model, const chat_conversation & conv);

struct chat_tool_call {
    std::string name;
    std::string arguments;  // JSON text
    std::string id;
};

struct chat_message {
    std::string content;
    std::string reasoning;
    std::vector<chat_tool_call> tool_calls;
};

// `text`, an assistant turn the model generated after `conv` (formatted with a generation prompt), through
// the parser of the format the template yields: content, reasoning and tool calls apart. A partial
// parse takes text that stops midway (a stream). template_error for text the format cannot parse.
chat_message parse_chat(const Model & model, const chat_conversation & conv, const std::string & text,
                        bool partial);

}  // namespace lloyal
