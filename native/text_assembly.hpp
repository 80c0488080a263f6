// Text as a generation makes it, one token's text at a time: stop strings matched across tokens on the
// bytes, and the end of the text that could still become a stop string, or is an incomplete UTF-8
// sequence, held back until it is known. What generate streams (generation.hpp), and what a batched
// request's branch hands out (branch_driver::produce_text): written once, for both.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace lloyal {

class text_assembly {
  public:
    explicit text_assembly(std::vector<std::string> stops) : stops_(std::move(stops)) {}

    // Appends one token's text. True when a stop string completed with it: the text ends where that
    // stop string starts, and nothing after it counts.
    bool push(std::string_view piece);
    // text()[:final_end()] is final: no later token changes it.
    size_t final_end() const { return final_; }
    // Where the text ends once the generation does: at a stop string, or all of it (what was held back
    // becomes final then: a stop prefix that never completed, a truncated UTF-8 sequence).
    size_t end() const { return stopped_ ? final_ : text_.size(); }
    bool stopped() const { return stopped_; }
    const std::string & text() const { return text_; }

  private:
    std::vector<std::string> stops_;
    std::string text_;
    size_t final_ = 0;
    bool stopped_ = false;
};

}  // namespace lloyal
