#include "chat.hpp"
#include "errors.hpp"

#include "chat.h"

#include <exception>

namespace lloyal {

std::string apply_chat(const Model & model, const chat_request & req) {
    if (req.template_source.empty() && llama_model_chat_template(model.get(), nullptr) == nullptr) {
        // common_chat would quietly fall back to ChatML; a model without a template gets a clear error.
        throw template_error("the model has no chat template: pass template= (a format name such as \"gemma\", "
                             "\"chatml\" or \"llama3\", or Jinja source)");
    }
    try {
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
    } catch (const lloyal_error &) {
        throw;
    } catch (const std::exception & e) {
        throw template_error(std::string("chat template: ") + e.what());
    }
}

}  // namespace lloyal
