#include "grammar_handles.hpp"

#include "errors.hpp"

#include <limits>

namespace lloyal {

grammar_handles::entry & grammar_handles::get(uint32_t h) {
    auto it = handles_.find(h);
    if (it == handles_.end()) {
        throw stale_handle_error("grammar handle " + std::to_string(h) + " is not live in this context (freed, or "
                                 "never made here)");
    }
    return it->second;
}

sampler_ptr & grammar_handles::sampler(uint32_t h) { return get(h).grammar; }

uint32_t grammar_handles::add(sampler_ptr g) {
    entry e;
    e.grammar = std::move(g);
    try {
        e.mask = core_.arena().alloc(static_cast<size_t>(core_.model().n_vocab()) * sizeof(float));
    } catch (const region_full_error & err) {
        throw grammar_error(std::string(err.what()) + " (every grammar handle keeps its token mask there)");
    }
    const uint32_t h = next_++;
    handles_.emplace(h, std::move(e));
    return h;
}

uint32_t grammar_handles::create(const grammar_spec & g, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    context_core::request_scope req(core_, request_id);
    const stop_fn stop = [this] { return core_.interrupt_requested(); };
    return add(make_grammar_sampler(core_.model(), g, request_id != 0 ? stop : stop_fn()));
}

uint32_t grammar_handles::clone(uint32_t h) {
    context_core::busy_guard busy(core_);
    return add(sampler_ptr(llama_sampler_clone(get(h).grammar.get())));
}

size_t grammar_handles::mask(uint32_t h, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    entry & e = get(h);
    const int32_t n = core_.model().n_vocab();
    std::vector<llama_token_data> cur(static_cast<size_t>(n));
    for (int32_t t = 0; t < n; ++t) {
        cur[static_cast<size_t>(t)] = {t, 0.0f, 0.0f};
    }
    llama_token_data_array arr{cur.data(), cur.size(), -1, false};
    context_core::request_scope req(core_, request_id);
    grammar_apply(e.grammar.get(), arr, [this] { return core_.interrupt_requested(); });
    float * out = e.mask.floats();
    for (size_t i = 0; i < arr.size; ++i) {
        out[arr.data[i].id] = arr.data[i].logit == -std::numeric_limits<float>::infinity()
                                  ? -std::numeric_limits<float>::infinity()
                                  : 0.0f;
    }
    return e.mask.offset();
}

void grammar_handles::accept(uint32_t h, llama_token token, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    entry & e = get(h);
    core_.model().check_token(token);
    context_core::request_scope req(core_, request_id);
    const stop_fn stop = [this] { return core_.interrupt_requested(); };
    // Checked with the grammar's own mask first, on a copy: accepting a token the grammar cannot take
    // aborts inside llama.cpp.
    sampler_ptr next(llama_sampler_clone(e.grammar.get()));
    llama_token_data one{token, 0.0f, 0.0f};
    llama_token_data_array one_p{&one, 1, -1, false};
    grammar_apply(next.get(), one_p, stop);
    if (one.logit == -std::numeric_limits<float>::infinity()) {
        throw grammar_error("token " + std::to_string(token) + " (" + core_.model().token_to_piece(token, true) +
                            ") is not allowed by the grammar here");
    }
    grammar_accept(next.get(), token, stop);
    e.grammar = std::move(next);
}

void grammar_handles::free(uint32_t h) {
    context_core::busy_guard busy(core_);
    get(h);
    handles_.erase(h);
}

}  // namespace lloyal
