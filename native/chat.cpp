#include "chat.hpp"
#include "errors.hpp"

#include "chat.h"

#include <exception>

namespace lloyal {

namespace {

void require_template(const Model & model, const std::string & template_source) {
    if (template_source.empty() && llama_model_chat_template(model.get(), nullptr) == nullptr) {
        // common_chat would quietly fall back to ChatML; a model without a template gets a clear error.
        throw template_error("the model has no chat template: pass template= (a format name such as \"gemma\", "
                             "\"chatml\" or \"llama3\", or Jinja source)");
    }
}

common_chat_tool_choice tool_choice_of(const std::string & name) {
    if (name == "auto") {
        return COMMON_CHAT_TOOL_CHOICE_AUTO;
    }
    if (name == "required") {
        return COMMON_CHAT_TOOL_CHOICE_REQUIRED;
    }
    if (name == "none") {
        return COMMON_CHAT_TOOL_CHOICE_NONE;
    }
    throw std::invalid_argument("tool_choice must be \"auto\", \"required\" or \"none\", got \"" + name + "\"");
}

// Every failure of common/chat (Jinja parse or render errors, JSON errors, a template the format analysis
// cannot handle, output the parser refuses) is a runtime or logic error of some kind: one typed error.
template <class F> auto as_template_error(const char * what, F && f) -> decltype(f()) {
    try {
        return f();
    } catch (const lloyal_error &) {
        throw;
    } catch (const std::exception & e) {
        throw template_error(std::string(what) + e.what());
    }
}

struct applied {
    common_chat_templates_ptr tmpls;
    common_chat_params params;
};

applied apply_conversation(const Model & model, const chat_conversation & conv) {
    require_template(model, conv.template_source);
    const common_chat_tool_choice choice = tool_choice_of(conv.tool_choice);
    return as_template_error("chat template: ", [&] {
        applied out;
        out.tmpls = common_chat_templates_init(model.get(), conv.template_source);
        common_chat_templates_inputs in;
        in.use_jinja = true;
        in.add_generation_prompt = conv.add_generation_prompt;
        in.messages = common_chat_msgs_parse_oaicompat(common_json::parse(conv.messages_json));
        if (!conv.tools_json.empty()) {
            in.tools = common_chat_tools_parse_oaicompat(common_json::parse(conv.tools_json));
        }
        in.tool_choice = choice;
        // Reasoning apart from the content (<think>...</think> where the format has it); the prompt's text
        // does not depend on it, only the parser does.
        in.reasoning_format = COMMON_REASONING_FORMAT_AUTO;
        out.params = common_chat_templates_apply(out.tmpls.get(), in);
        return out;
    });
}

}  // namespace

std::string apply_chat(const Model & model, const chat_request & req) {
    require_template(model, req.template_source);
    return as_template_error("chat template: ", [&] {
        const common_chat_templates_ptr tmpls = common_chat_templates_init(model.get(), req.template_source);
        common_chat_templates_inputs in;
        in.use_jinja = true;
        in.add_generation_prompt = req.add_generation_prompt;
        for (const auto & [role, content] : req.messages) {
            common_chat_msg m;
            m.role = role;
            m.content = content;
            in.messages.push_back(std::move(m));
        }
        if (!req.tools_json.empty()) {
            in.tools = common_chat_tools_parse_oaicompat(common_json::parse(req.tools_json));
        }
        return common_chat_templates_apply(tmpls.get(), in).prompt;
    });
}

chat_prompt format_chat(const Model & model, const chat_conversation & conv) {
    const applied a = apply_conversation(model, conv);
    const common_chat_params & p = a.params;
    chat_prompt out;
    out.prompt = p.prompt;
    out.format = common_chat_format_name(p.format);
    out.grammar = p.grammar;
    out.grammar_lazy = p.grammar_lazy;
    for (const auto & t : p.grammar_triggers) {
        switch (t.type) {
            case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:
                out.trigger_words.push_back(t.value);
                break;
            case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:
                out.trigger_patterns.push_back(t.value);
                break;
            case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL:
                // Matches the whole generated text: anchored at both ends.
                out.trigger_patterns.push_back((t.value.empty() || t.value.front() != '^' ? "^" : "") + t.value +
                                               (t.value.empty() || t.value.back() != '$' ? "$" : ""));
                break;
            case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:
                out.trigger_tokens.push_back(t.token);
                break;
        }
    }
    out.preserved_tokens = p.preserved_tokens;
    out.additional_stops = p.additional_stops;
    out.generation_prompt = p.generation_prompt;
    return out;
}

chat_message parse_chat(const Model & model, const chat_conversation & conv, const std::string & text,
                        bool partial) {
    const applied a = apply_conversation(model, conv);
    return as_template_error("chat output: ", [&] {
        common_chat_parser_params pp(a.params);
        pp.reasoning_format = COMMON_REASONING_FORMAT_AUTO;
        if (!a.params.parser.empty()) {
            pp.parser.load(a.params.parser);
        }
        const common_chat_msg msg = common_chat_parse(text, partial, pp);
        chat_message out;
        out.content = msg.content;
        out.reasoning = msg.reasoning_content;
        for (const auto & tc : msg.tool_calls) {
            out.tool_calls.push_back({tc.name, tc.arguments, tc.id});
        }
        return out;
    });
}

}  // namespace lloyal
