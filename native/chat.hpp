// Chat prompts through llama.cpp's own Jinja engine and chat formats (common/chat): the model's template,
// or Jinja source given by the caller. No pybind11 here.
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

}  // namespace lloyal
