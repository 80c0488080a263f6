#pragma once

#include "common.hpp"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lloyal {

class Model {
  public:
    // progress(fraction) runs on the loading thread; false cancels the load, and an exception from it
    // cancels the load and propagates.
    using progress_fn = std::function<bool(float)>;
    // repack: weights may go to llama.cpp's extra buffer types (repacked for the CPU's gemm kernels, AMX);
    // false keeps every weight as the file has it, which a batch-invariant context needs.
    Model(const std::string & path, int n_gpu_layers, bool use_mmap, bool vocab_only, bool repack,
          progress_fn progress);
    ~Model();
    Model(const Model &) = delete;
    Model & operator=(const Model &) = delete;

    llama_model * get() const { return model_; }
    const llama_vocab * vocab() const { return vocab_; }
    int32_t n_vocab() const { return n_vocab_; }
    bool vocab_only() const { return vocab_only_; }
    bool repack() const { return repack_; }
    int n_gpu_layers() const { return n_gpu_layers_; }
    const std::string & path() const { return path_; }
    // Every token llama_vocab_is_eog() is true for; ignore_eos bans them all, not only llama_vocab_eos().
    const std::vector<llama_token> & eog_tokens() const { return eog_tokens_; }
    // Tokens whose text_piece without render_special differs from their raw piece (control tokens,
    // markers): a client that renders sampled pieces itself needs them to show what generate shows.
    const std::vector<llama_token> & hidden_tokens() const { return hidden_tokens_; }

    // Throws invalid_token_error unless 0 <= token < n_vocab.
    void check_token(int64_t token) const;

    // Thread-safe (llama.cpp's tokenizer is), so callable with the GIL released.
    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string detokenize(const std::vector<llama_token> & tokens, bool remove_special, bool unparse_special) const;
    std::string token_to_piece(llama_token token, bool special) const;
    // A generated token as text: without render_special, control tokens and markers (user-defined
    // tokens such as <start_of_image>, see model.cpp) are empty.
    std::string text_piece(llama_token token, bool render_special) const;

    std::string desc() const;
    // The GGUF metadata as (key, value) strings; array values are left out.
    std::vector<std::pair<std::string, std::string>> meta() const;

  private:
    std::string path_;
    llama_model * model_ = nullptr;
    const llama_vocab * vocab_ = nullptr;
    int32_t n_vocab_ = 0;
    bool vocab_only_ = false;
    bool repack_ = true;
    int n_gpu_layers_ = 0;
    std::vector<llama_token> eog_tokens_;
    std::vector<llama_token> hidden_tokens_;
    std::vector<llama_token> markers_;  // sorted
};

}  // namespace lloyal
