// The branch driver's decoding calls (branch.hpp): commit, step, prefill (with commits beside its prompts),
// clear_and_reseed. Each is all or nothing: everything that can refuse the call runs before llama_decode,
// everything it changes is applied after it succeeded, and a failed decode's cells are removed.
#include "branch.hpp"
#include "errors.hpp"

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace lloyal {

void branch_driver::commit_tokens(const std::vector<branch *> & bs, const std::vector<llama_token> & toks,
                                  uint64_t request_id) {
    decode_batch(bs, toks, {}, request_id, nullptr);
}

void branch_driver::apply_commit(branch & b, llama_token t, sampler_ptr grammar) {
    // Model surprisal under the snapshot the token was chosen from, before it is overwritten.
    const float s = b.snap_lse - b.snapshot[t];
    if (std::isfinite(s)) {
        b.nll_sum += std::max(0.0f, s);
        ++b.nll_count;
    }
    if (b.sample_pending && b.last_token == t && std::isfinite(b.last_surprisal)) {
        b.samp_sum += b.last_surprisal;
        ++b.samp_count;
    }
    if (grammar) {
        b.sampler->set_grammar(std::move(grammar));
    }
    b.sampler->accept(t);
    b.accepted.push_back(t);
    b.position += 1;
    b.lineage.back().p1 = b.position;
}

void branch_driver::commit_args(const std::vector<std::pair<uint32_t, llama_token>> & pairs,
                                std::unordered_set<branch *> & seen, const char * call, std::vector<branch *> & bs,
                                std::vector<llama_token> & toks) {
    for (const auto & [h, t] : pairs) {
        branch & b = distinct(h, seen, call);
        core_.model().check_token(t);
        toks.push_back(t);
        bs.push_back(&b);
    }
    for (const branch * b : bs) {
        if (!b->has_logits) {
            throw branch_error("branch " + std::to_string(b->handle) +
                               " has no logits yet: prefill or commit something first");
        }
    }
}

void branch_driver::commit(const std::vector<std::pair<uint32_t, llama_token>> & pairs, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    core_.reset_decode_timer();
    std::vector<branch *> bs;
    std::vector<llama_token> toks;
    std::unordered_set<branch *> seen;
    commit_args(pairs, seen, "commit", bs, toks);
    commit_tokens(bs, toks, request_id);
}

std::vector<produced_token> branch_driver::step(const std::vector<uint32_t> & handles, uint64_t request_id) {
    context_core::busy_guard busy(core_);
    core_.reset_decode_timer();
    const std::vector<branch *> bs = with_logits(handles, "batch");
    // Sampling advances the PRNGs, mirostat's mu and the last sample: what would refuse the commit is
    // checked before, so that a step that commits nothing has consumed nothing either.
    if (bs.size() > core_.n_batch) {
        throw std::invalid_argument("a step holds at most n_batch (" + std::to_string(core_.n_batch) +
                                    ") branches, got " + std::to_string(bs.size()));
    }
    {
        context_core::request_scope req(core_, request_id);
        if (core_.interrupt_requested()) {
            throw interrupted_error("interrupted before the decode: nothing was produced or committed");
        }
    }
    // All or nothing, as commit is: what sampling changed is put back when the commit half fails (a full
    // cache, an interrupt), so that the next produce() draws what this step would have drawn.
    sampling_checkpoint saved(bs);
    std::vector<llama_token> out;
    try {
        context_core::request_scope req(core_, request_id);
        out = produce_tokens(bs);
    } catch (...) {
        saved.restore();
        throw;
    }
    const std::vector<produced_token> result = produced(bs, out);  // the snapshots, before the commit
    std::vector<branch *> go;
    std::vector<llama_token> toks;
    for (size_t i = 0; i < bs.size(); ++i) {
        const llama_token t = out[i];
        if (t != LLAMA_TOKEN_NULL && !llama_vocab_is_eog(core_.model().vocab(), t)) {
            go.push_back(bs[i]);
            toks.push_back(t);
        }
    }
    try {
        commit_tokens(go, toks, request_id);
    } catch (...) {
        saved.restore();
        throw;
    }
    return result;
}

void branch_driver::prefill(const std::vector<std::pair<uint32_t, std::vector<llama_token>>> & items_in,
                            const std::vector<std::pair<uint32_t, llama_token>> & commits, uint64_t request_id,
                            const context_core::progress_fn & on_progress,
                            const std::optional<std::vector<lora_weight>> & loras) {
    const std::optional<std::vector<lora_weight>> config =
        loras ? std::optional<std::vector<lora_weight>>(lora_config(core_, *loras)) : std::nullopt;
    context_core::busy_guard busy(core_);
    const context_core::lora_scope scope(core_, config ? &*config : nullptr);
    core_.reset_decode_timer();
    std::vector<prompt_item> items;
    std::unordered_set<branch *> seen;
    // Commits ride in the first decode, beside the prompts: a running generation's next token costs no
    // decode of its own while a new prompt goes in (continuous batching's mixed step).
    std::vector<branch *> cbs;
    std::vector<llama_token> ctoks;
    commit_args(commits, seen, "prefill", cbs, ctoks);
    for (const auto & [h, toks] : items_in) {
        branch & b = distinct(h, seen, "prefill");
        for (llama_token t : toks) {
            core_.model().check_token(t);
        }
        if (!toks.empty()) {
            items.push_back({&b, &toks});
        }
    }
    decode_batch(cbs, ctoks, items, request_id, on_progress);
}

void branch_driver::decode_batch(const std::vector<branch *> & cbs, const std::vector<llama_token> & ctoks,
                                 const std::vector<prompt_item> & items, uint64_t request_id,
                                 const context_core::progress_fn & on_progress) {
    const size_t n_commits = cbs.size();
    if (items.empty() && n_commits == 0) {
        return;
    }
    if (n_commits > core_.n_batch) {
        throw std::invalid_argument("one decode commits at most n_batch (" + std::to_string(core_.n_batch) +
                                    ") branches, got " + std::to_string(n_commits));
    }
    {
        std::vector<std::pair<const branch *, size_t>> adds;
        for (const branch * b : cbs) {
            adds.emplace_back(b, 1);
        }
        for (const prompt_item & it : items) {
            adds.emplace_back(it.b, it.toks->size());
        }
        check_room(adds);
    }
    context_core::request_scope req(core_, request_id);
    std::vector<sampler_ptr> grammars(n_commits);
    const stop_fn stop = [this] { return core_.interrupt_requested(); };
    for (size_t i = 0; i < n_commits; ++i) {
        grammars[i] = cbs[i]->sampler->grammar_after(ctoks[i], stop);
    }

    // First-fit packing of whole items into n_batch chunks, the first one opened by the commits; an item
    // longer than n_batch gets chunks of its own, appended in order (its pieces must reach the cache in
    // position order).
    struct piece {
        size_t item;
        size_t off;
        size_t n;
    };
    std::vector<std::vector<piece>> chunks;
    std::vector<size_t> fill;
    if (n_commits > 0) {
        chunks.emplace_back();
        fill.push_back(n_commits);
    }
    for (size_t k = 0; k < items.size(); ++k) {
        const size_t len = items[k].toks->size();
        if (len > core_.n_batch) {
            for (size_t off = 0; off < len; off += core_.n_batch) {
                const size_t m = std::min<size_t>(core_.n_batch, len - off);
                chunks.push_back({piece{k, off, m}});
                fill.push_back(m);
            }
            continue;
        }
        size_t c = 0;
        while (c < chunks.size() && fill[c] + len > core_.n_batch) {
            ++c;
        }
        if (c == chunks.size()) {
            chunks.emplace_back();
            fill.push_back(0);
        }
        chunks[c].push_back(piece{k, 0, len});
        fill[c] += len;
    }

    const size_t n_vocab = static_cast<size_t>(core_.model().n_vocab());
    size_t done = 0;
    size_t total = 0;
    for (size_t f : fill) {
        total += f;
    }
    std::vector<std::vector<float>> stash(items.size());  // rows of items done before the last chunk
    std::vector<int32_t> final_idx(items.size(), -1);      // batch index of rows in the last chunk
    std::vector<std::vector<float>> commit_stash(chunks.size() > 1 ? n_commits : 0);
    context_core::progress_scope progress(core_, on_progress);
    llama_memory_t mem = core_.memory();
    auto rollback = [&] {
        for (const branch * b : cbs) {
            llama_memory_seq_rm(mem, b->seq, b->position, -1);
        }
        for (const prompt_item & it : items) {
            llama_memory_seq_rm(mem, it.b->seq, it.b->position, -1);
        }
    };
    for (size_t c = 0; c < chunks.size(); ++c) {
        if (core_.interrupt_requested()) {
            rollback();
            throw interrupted_error("interrupted: nothing was changed");
        }
        int32_t j = 0;
        if (c == 0) {
            for (size_t i = 0; i < n_commits; ++i, ++j) {
                core_.put(static_cast<size_t>(j), ctoks[i], cbs[i]->position, cbs[i]->seq, true);
            }
        }
        for (const piece & p : chunks[c]) {
            const prompt_item & it = items[p.item];
            for (size_t i = 0; i < p.n; ++i, ++j) {
                const size_t at = p.off + i;
                core_.put(static_cast<size_t>(j), (*it.toks)[at], it.b->position + static_cast<llama_pos>(at),
                          it.b->seq, at + 1 == it.toks->size());
            }
        }
        const uint64_t mark = log_mark();
        const int32_t ret = core_.decode(j);
        if (ret != 0) {
            rollback();
            core_.throw_decode_failure(ret, static_cast<size_t>(j), mark);
        }
        for (size_t i = 0; c == 0 && i < commit_stash.size(); ++i) {
            const float * row = llama_get_logits_ith(core_.get(), static_cast<int32_t>(i));
            if (row == nullptr) {
                rollback();
                throw lloyal_error("llama.cpp returned no logits for a committed token: nothing was changed");
            }
            commit_stash[i].assign(row, row + n_vocab);
        }
        j = c == 0 ? static_cast<int32_t>(n_commits) : 0;  // the items' rows follow the commits'
        for (const piece & p : chunks[c]) {
            const prompt_item & it = items[p.item];
            const size_t last = p.off + p.n;
            j += static_cast<int32_t>(p.n);
            if (last != it.toks->size()) {
                continue;
            }
            if (c + 1 == chunks.size()) {
                final_idx[p.item] = j - 1;
                continue;
            }
            const float * row = llama_get_logits_ith(core_.get(), j - 1);
            if (row == nullptr) {
                rollback();
                throw lloyal_error("llama.cpp returned no logits for a prefilled item: nothing was changed");
            }
            stash[p.item].assign(row, row + n_vocab);
        }
        if (core_.wants_progress()) {
            done += fill[c];
            try {
                core_.report_progress(done, total);
            } catch (...) {
                rollback();
                throw;
            }
        }
    }
    std::vector<const float *> rows(items.size());
    for (size_t k = 0; k < items.size(); ++k) {
        rows[k] = final_idx[k] >= 0 ? llama_get_logits_ith(core_.get(), final_idx[k]) : stash[k].data();
        if (rows[k] == nullptr) {
            rollback();
            throw lloyal_error("llama.cpp returned no logits for a prefilled item: nothing was changed");
        }
    }
    std::vector<const float *> commit_rows(n_commits);
    for (size_t i = 0; i < n_commits; ++i) {
        commit_rows[i] = commit_stash.empty() ? llama_get_logits_ith(core_.get(), static_cast<int32_t>(i))
                                              : commit_stash[i].data();
        if (commit_rows[i] == nullptr) {
            rollback();
            throw lloyal_error("llama.cpp returned no logits for a committed token: nothing was changed");
        }
    }
    std::vector<std::pair<branch *, const float *>> snapshots;
    snapshots.reserve(items.size() + n_commits);
    for (size_t k = 0; k < items.size(); ++k) {
        branch & b = *items[k].b;
        b.position += static_cast<llama_pos>(items[k].toks->size());
        b.lineage.back().p1 = b.position;
        snapshots.emplace_back(&b, rows[k]);
    }
    for (size_t i = 0; i < n_commits; ++i) {
        apply_commit(*cbs[i], ctoks[i], std::move(grammars[i]));  // reads the old snapshot: before the writes
        snapshots.emplace_back(cbs[i], commit_rows[i]);
    }
    write_snapshots(snapshots);
}

void branch_driver::clear_and_reseed(std::vector<llama_token> toks, const std::vector<llama_token> & tail,
                                     uint64_t request_id) {
    context_core::busy_guard busy(core_);
    core_.reset_decode_timer();
    branch_store & st = store_;
    for (llama_token t : toks) {
        core_.model().check_token(t);
    }
    for (llama_token t : tail) {
        core_.model().check_token(t);
    }
    toks.insert(toks.end(), tail.begin(), tail.end());
    if (toks.empty()) {
        throw std::invalid_argument("clear_and_reseed needs sinks or tail tokens: both are empty");
    }
    if (st.n_branches() != 1 || st.n_detached() != 0) {
        throw branch_error("clear_and_reseed needs exactly one live branch and no detached sequences (there are " +
                           std::to_string(st.n_branches()) + " branches, " + std::to_string(st.n_detached()) +
                           " detached)");
    }
    branch & b = st.get(st.handles().front());
    if (toks.size() > core_.n_ctx) {
        throw context_overflow_error(std::to_string(toks.size()) + " tokens do not fit: n_ctx " +
                                     std::to_string(core_.n_ctx) + "; nothing was changed");
    }
    llama_memory_t mem = core_.memory();
    llama_context * ctx = core_.get();
    context_core::request_scope req(core_, request_id);
    if (core_.interrupt_requested()) {
        throw interrupted_error("interrupted before the clear: nothing was changed");
    }
    // A copy of the branch's cells, put back if the reseed fails: all or nothing.
    std::vector<uint8_t> backup;
    if (llama_memory_seq_pos_max(mem, b.seq) >= 0) {
        backup.resize(llama_state_seq_get_size(ctx, b.seq));
        backup.resize(llama_state_seq_get_data(ctx, backup.data(), backup.size(), b.seq));
        if (backup.empty()) {
            throw context_error("could not copy the branch's state before clearing: nothing was changed");
        }
    }
    auto restore = [&] {
        llama_memory_clear(mem, true);
        if (!backup.empty() && llama_state_seq_set_data(ctx, backup.data(), backup.size(), b.seq) == 0) {
            // Cannot happen short of memory corruption: the same cells fitted a moment ago.
            b.position = 0;
            b.fork_head = 0;
            b.has_logits = false;
            b.lineage = {{st.new_origin(), 0, 0}};
            throw context_error("clear_and_reseed failed and the branch's cells could not be restored: it is empty now");
        }
    };
    llama_memory_clear(mem, true);
    const int32_t n = static_cast<int32_t>(toks.size());
    int32_t last_idx = -1;
    for (int32_t i = 0; i < n;) {
        if (core_.interrupt_requested()) {
            restore();
            throw interrupted_error("interrupted: the branch was restored, nothing was changed");
        }
        const int32_t m = std::min<int32_t>(static_cast<int32_t>(core_.n_batch), n - i);
        for (int32_t j = 0; j < m; ++j) {
            core_.put(static_cast<size_t>(j), toks[static_cast<size_t>(i + j)], i + j, b.seq, i + j == n - 1);
        }
        const uint64_t mark = log_mark();
        const int32_t ret = core_.decode(m);
        if (ret != 0) {
            restore();
            core_.throw_decode_failure(ret, static_cast<size_t>(m), mark);
        }
        last_idx = m - 1;
        i += m;
    }
    const float * row = llama_get_logits_ith(core_.get(), last_idx);
    if (row == nullptr) {
        restore();
        throw lloyal_error("llama.cpp returned no logits after the reseed: the branch was restored");
    }
    b.position = n;
    b.fork_head = 0;
    b.lineage = {{st.new_origin(), 0, n}};
    write_snapshot(b, row);
}

}  // namespace lloyal
