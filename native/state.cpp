// sequence_driver::save_state / load_state: a sequence-mode context as one file (the stub's
// Context.save_state). The file is our header, the token history, the logits of the last position,
// then llama.cpp's whole-context state (llama_state_get_data: the architecture name and the KV memory;
// llama.cpp saves no logits, hence our own copy). Both directions map the file and let llama.cpp read
// or write the mapping directly: a long context's state is gigabytes, and it is never copied whole.
//
// What a load checks before it touches the context, so that a refused state leaves it as it was:
// magic, format version, the sizes the header promises against the file's, a checksum of the whole
// file, the model's fingerprint, the history against n_ctx. What llama.cpp still refuses after that
// (e.g. a cache of another type_k) it refuses after clearing the cache, so a context that held
// something is snapshotted first and put back then.
#include "errors.hpp"
#include "sequence.hpp"
#include "model.hpp"

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace lloyal {

namespace {

constexpr char k_magic[8] = {'L', 'L', 'O', 'Y', 'A', 'L', 'S', 'T'};
constexpr uint32_t k_version = 1;

// Laid out with every field at its natural alignment, so the struct has no padding and its bytes are
// the file's (little-endian: the machines llama.cpp's own state format assumes too).
struct file_header {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;
    uint64_t total_bytes;
    uint64_t checksum;  // of the whole file with this field read as 0
    uint64_t model_hash;
    uint64_t model_n_params;
    uint64_t model_size;
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head_kv;
    char model_desc[128];
    uint32_t n_tokens;
    uint32_t has_logits;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t fresh_upto;
    uint32_t reserved;
    uint64_t tokens_offset;
    uint64_t logits_offset;
    uint64_t llama_offset;
    uint64_t llama_bytes;
};
static_assert(sizeof(file_header) == 256, "file_header must have no padding");

// A fast non-cryptographic checksum (multiply-rotate over four 64-bit lanes, several GB/s): it catches
// truncation, garbage and bit rot before llama.cpp reads a byte, not deliberate forgery.
class checksum64 {
  public:
    void update(const uint8_t * p, size_t n) {
        total_ += n;
        if (fill_ > 0) {
            const size_t take = std::min(n, sizeof(buf_) - fill_);
            std::memcpy(buf_ + fill_, p, take);
            fill_ += take;
            p += take;
            n -= take;
            if (fill_ < sizeof(buf_)) {
                return;
            }
            block(buf_);
            fill_ = 0;
        }
        for (; n >= sizeof(buf_); p += sizeof(buf_), n -= sizeof(buf_)) {
            block(p);
        }
        std::memcpy(buf_, p, n);
        fill_ = n;
    }

    uint64_t digest() const {
        uint64_t h = rotl(lane_[0], 1) + rotl(lane_[1], 7) + rotl(lane_[2], 12) + rotl(lane_[3], 18);
        h ^= total_ * k_p2;
        for (size_t i = 0; i < fill_; ++i) {
            h = rotl(h ^ (buf_[i] * k_p1), 11) * k_p2;
        }
        h ^= h >> 33;
        h *= k_p2;
        h ^= h >> 29;
        h *= k_p1;
        h ^= h >> 32;
        return h;
    }

  private:
    static constexpr uint64_t k_p1 = 0x9E3779B185EBCA87ull;
    static constexpr uint64_t k_p2 = 0xC2B2AE3D27D4EB4Full;
    static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

    void block(const uint8_t * p) {
        for (int i = 0; i < 4; ++i) {
            uint64_t w;
            std::memcpy(&w, p + 8 * i, 8);
            lane_[i] = rotl(lane_[i] + w * k_p2, 31) * k_p1;
        }
    }

    uint64_t lane_[4] = {k_p1 + k_p2, k_p2, 0, 0 - k_p1};
    uint8_t buf_[32] = {};
    size_t fill_ = 0;
    uint64_t total_ = 0;
};

uint64_t hash_bytes(const void * p, size_t n) {
    checksum64 h;
    h.update(static_cast<const uint8_t *>(p), n);
    return h.digest();
}

// What identifies the model without reading a tensor: its description, sizes and every scalar GGUF
// metadata value (architecture, name, quantization, tokenizer settings, ...).
void fill_model_fingerprint(file_header & h, const Model & model) {
    const llama_model * m = model.get();
    std::string text = model.desc();
    for (const auto & [k, v] : model.meta()) {
        text += '\n';
        text += k;
        text += '=';
        text += v;
    }
    h.model_hash = hash_bytes(text.data(), text.size());
    h.model_n_params = llama_model_n_params(m);
    h.model_size = llama_model_size(m);
    h.n_vocab = model.n_vocab();
    h.n_embd = llama_model_n_embd(m);
    h.n_layer = llama_model_n_layer(m);
    h.n_head_kv = llama_model_n_head_kv(m);
    const std::string desc = model.desc();
    std::memset(h.model_desc, 0, sizeof(h.model_desc));
    std::memcpy(h.model_desc, desc.data(), std::min(desc.size(), sizeof(h.model_desc) - 1));
}

uint64_t file_checksum(const uint8_t * base, size_t total) {
    file_header copy;
    std::memcpy(&copy, base, sizeof(copy));
    copy.checksum = 0;
    checksum64 h;
    h.update(reinterpret_cast<const uint8_t *>(&copy), sizeof(copy));
    h.update(base + sizeof(copy), total - sizeof(copy));
    return h.digest();
}

uint64_t align64(uint64_t n) { return (n + 63) / 64 * 64; }

std::string errno_text(int err) { return std::strerror(err); }

class fd_guard {
  public:
    explicit fd_guard(int fd) : fd_(fd) {}
    ~fd_guard() {
        if (fd_ >= 0) {
            ::close(fd_);
        }
    }
    fd_guard(const fd_guard &) = delete;
    fd_guard & operator=(const fd_guard &) = delete;
    int get() const { return fd_; }

  private:
    int fd_;
};

class map_guard {
  public:
    map_guard(int fd, size_t size, bool writable) : size_(size) {
        int flags = MAP_SHARED;
#ifdef MAP_POPULATE
        flags |= MAP_POPULATE;  // one pass over the page tables instead of a fault per 4 KiB page
#endif
        ptr_ = ::mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, flags, fd, 0);
    }
    ~map_guard() {
        if (ptr_ != MAP_FAILED) {
            ::munmap(ptr_, size_);
        }
    }
    map_guard(const map_guard &) = delete;
    map_guard & operator=(const map_guard &) = delete;
    bool ok() const { return ptr_ != MAP_FAILED; }
    uint8_t * data() const { return static_cast<uint8_t *>(ptr_); }

  private:
    void * ptr_ = MAP_FAILED;
    size_t size_;
};

std::string model_name(const file_header & h) {
    return std::string(h.model_desc, strnlen(h.model_desc, sizeof(h.model_desc)));
}

}  // namespace

const float * sequence_driver::last_logits() const {
    if (!kept_logits_.empty() && kept_at_ == core_.n_decodes()) {
        return kept_logits_.data();
    }
    return llama_get_logits_ith(core_.get(), -1);
}

void sequence_driver::keep_logits(const float * row) {
    if (row != kept_logits_.data()) {
        kept_logits_.assign(row, row + core_.model().n_vocab());
    }
    kept_at_ = core_.n_decodes();
}

size_t sequence_driver::save_state(const std::string & path) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("save_state");
    if (history_.empty()) {
        throw context_error("save_state: the context holds nothing to save");
    }
    llama_context * ctx = core_.get();
    const Model & model = core_.model();
    const size_t n_vocab = static_cast<size_t>(model.n_vocab());
    const float * logits = has_logits_ ? last_logits() : nullptr;

    file_header h{};
    std::memcpy(h.magic, k_magic, sizeof(k_magic));
    h.version = k_version;
    h.header_bytes = sizeof(file_header);
    fill_model_fingerprint(h, model);
    h.n_tokens = static_cast<uint32_t>(history_.size());
    h.has_logits = logits != nullptr ? 1 : 0;
    h.n_batch = core_.n_batch;
    h.n_ubatch = core_.n_ubatch;
    h.fresh_upto = static_cast<uint32_t>(fresh_upto_);
    h.tokens_offset = sizeof(file_header);
    h.logits_offset = align64(h.tokens_offset + history_.size() * sizeof(llama_token));
    h.llama_offset = align64(h.logits_offset + (logits != nullptr ? n_vocab * sizeof(float) : 0));

    const uint64_t mark = log_mark();
    h.llama_bytes = llama_state_get_size(ctx);
    if (h.llama_bytes == 0) {
        throw state_error("llama.cpp could not size the context's state" + log_reason_since(mark));
    }
    h.total_bytes = h.llama_offset + h.llama_bytes;

    fd_guard fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
        throw state_error("cannot create the state file '" + path + "': " + errno_text(errno));
    }
    if (::ftruncate(fd.get(), static_cast<off_t>(h.total_bytes)) != 0) {
        throw state_error("cannot size the state file '" + path + "': " + errno_text(errno));
    }
    // Writing through a mapping into space the filesystem cannot give is a SIGBUS: reserve it first.
    const int falloc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(h.total_bytes));
    if (falloc != 0 && falloc != EINVAL && falloc != EOPNOTSUPP) {
        throw state_error("no room for a " + std::to_string(h.total_bytes) + "-byte state at '" + path +
                          "': " + errno_text(falloc));
    }
    {
        map_guard map(fd.get(), h.total_bytes, true);
        if (!map.ok()) {
            throw state_error("cannot map the state file '" + path + "': " + errno_text(errno));
        }
        uint8_t * base = map.data();
        std::memcpy(base + h.tokens_offset, history_.data(), history_.size() * sizeof(llama_token));
        if (logits != nullptr) {
            std::memcpy(base + h.logits_offset, logits, n_vocab * sizeof(float));
        }
        const size_t n = llama_state_get_data(ctx, base + h.llama_offset, h.llama_bytes);
        if (n != h.llama_bytes) {
            throw state_error("llama.cpp could not copy the context's state" + log_reason_since(mark));
        }
        std::memcpy(base, &h, sizeof(h));
        h.checksum = file_checksum(base, h.total_bytes);
        std::memcpy(base + offsetof(file_header, checksum), &h.checksum, sizeof(h.checksum));
    }
    return h.total_bytes;
}

size_t sequence_driver::load_state(const std::string & path) {
    context_core::busy_guard busy(core_);
    require_sequence_mode("load_state");
    const Model & model = core_.model();
    const size_t n_vocab = static_cast<size_t>(model.n_vocab());

    fd_guard fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
        const int err = errno;
        throw state_error((err == ENOENT ? "no state file at '" : "cannot open the state file '") + path + "'" +
                          (err == ENOENT ? std::string() : ": " + errno_text(err)));
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
        throw state_error("cannot stat the state file '" + path + "': " + errno_text(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        throw state_error("'" + path + "' is not a regular file");
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size < sizeof(file_header)) {
        throw state_error("'" + path + "' is not a lloyal_pool state (" + std::to_string(size) +
                          " bytes, shorter than the header)");
    }
    map_guard map(fd.get(), size, false);
    if (!map.ok()) {
        throw state_error("cannot map the state file '" + path + "': " + errno_text(errno));
    }
    const uint8_t * base = map.data();
    file_header h;
    std::memcpy(&h, base, sizeof(h));
    if (std::memcmp(h.magic, k_magic, sizeof(k_magic)) != 0) {
        throw state_error("'" + path + "' is not a lloyal_pool state (bad magic)");
    }
    if (h.version != k_version || h.header_bytes != sizeof(file_header)) {
        throw state_error("the state '" + path + "' has format version " + std::to_string(h.version) +
                          "; this build reads version " + std::to_string(k_version));
    }
    if (h.total_bytes != size) {
        throw state_error("the state '" + path + "' is truncated or has trailing bytes: its header says " +
                          std::to_string(h.total_bytes) + " bytes, the file has " + std::to_string(size));
    }
    const uint64_t logits_bytes = h.has_logits != 0 ? n_vocab * sizeof(float) : 0;
    const bool layout_ok = h.has_logits <= 1 && h.tokens_offset == sizeof(file_header) &&
                           h.logits_offset >= h.tokens_offset + uint64_t{h.n_tokens} * sizeof(llama_token) &&
                           h.llama_offset >= h.logits_offset && h.llama_offset <= size &&
                           h.llama_bytes == size - h.llama_offset && h.n_tokens > 0;
    if (!layout_ok) {
        throw state_error("the state '" + path + "' has an inconsistent header");
    }
    if (file_checksum(base, size) != h.checksum) {
        throw state_error("the state '" + path + "' is corrupted (checksum mismatch)");
    }
    file_header mine{};
    fill_model_fingerprint(mine, model);
    if (h.model_hash != mine.model_hash || h.model_n_params != mine.model_n_params || h.model_size != mine.model_size ||
        h.n_vocab != mine.n_vocab || h.n_embd != mine.n_embd || h.n_layer != mine.n_layer ||
        h.n_head_kv != mine.n_head_kv) {
        throw state_error("the state '" + path + "' was saved from another model ('" + model_name(h) + "', n_vocab " +
                          std::to_string(h.n_vocab) + ", n_layer " + std::to_string(h.n_layer) + ") than this context's ('" +
                          model_name(mine) + "', n_vocab " + std::to_string(mine.n_vocab) + ", n_layer " +
                          std::to_string(mine.n_layer) + ")");
    }
    // The logits row of a model with this n_vocab: checked only now that the vocabularies agree.
    if (h.has_logits != 0 && h.logits_offset + logits_bytes > h.llama_offset) {
        throw state_error("the state '" + path + "' has an inconsistent header");
    }
    if (h.n_tokens > core_.n_ctx_seq) {
        throw context_overflow_error("the state holds " + std::to_string(h.n_tokens) + " tokens, more than this " +
                                     "context's n_ctx " + std::to_string(core_.n_ctx_seq));
    }
    std::vector<llama_token> toks(h.n_tokens);
    std::memcpy(toks.data(), base + h.tokens_offset, toks.size() * sizeof(llama_token));
    for (llama_token t : toks) {
        if (t < 0 || static_cast<size_t>(t) >= n_vocab) {
            throw state_error("the state '" + path + "' holds token id " + std::to_string(t) + ", outside the vocabulary");
        }
    }

    llama_context * ctx = core_.get();
    llama_memory_t mem = core_.memory();
    // llama.cpp clears the cache before it reads, and may still refuse (a cache of another type, V
    // layout or size): keep what is there, to put it back.
    std::vector<uint8_t> backup;
    const uint64_t mark = log_mark();
    if (llama_memory_seq_pos_max(mem, 0) >= 0) {
        backup.resize(llama_state_get_size(ctx));
        if (backup.empty() || llama_state_get_data(ctx, backup.data(), backup.size()) != backup.size()) {
            throw state_error("could not set the context's current state aside before loading" + log_reason_since(mark));
        }
    }
    auto undo = [&] {
        if (backup.empty() || llama_state_set_data(ctx, backup.data(), backup.size()) != backup.size()) {
            llama_memory_clear(mem, true);
            set_history_size(0);
            has_logits_ = false;
        }
    };
    const size_t n = llama_state_set_data(ctx, base + h.llama_offset, h.llama_bytes);
    std::string why;
    if (n != h.llama_bytes) {
        why = log_reason_since(mark);
        undo();
        throw state_error("llama.cpp refused the state '" + path + "'" +
                          (why.empty() ? std::string(" (a context with another cache type or layout?)") : why));
    }
    bool consistent = llama_memory_seq_pos_max(mem, 0) + 1 == static_cast<llama_pos>(h.n_tokens);
    for (uint32_t s = 1; s < core_.n_seq_max && consistent; ++s) {
        consistent = llama_memory_seq_pos_max(mem, static_cast<llama_seq_id>(s)) < 0;
    }
    if (!consistent) {
        undo();
        throw state_error("the state '" + path + "' does not hold exactly its history on sequence 0");
    }

    {
        std::lock_guard<std::mutex> lock(history_mu_);
        history_ = std::move(toks);
    }
    // The cache holds exactly what the saving context held; what was a fresh decode there is one here
    // only when the chunks were cut the same way.
    fresh_upto_ = h.n_batch == core_.n_batch && h.n_ubatch == core_.n_ubatch
                      ? std::min<size_t>(h.fresh_upto, history_.size())
                      : 0;
    has_logits_ = h.has_logits != 0;
    if (has_logits_) {
        keep_logits(reinterpret_cast<const float *>(base + h.logits_offset));
    }
    return history_.size();
}

}  // namespace lloyal
