#include "text_assembly.hpp"

#include <algorithm>

namespace lloyal {

namespace {

// Length of an incomplete but so far valid UTF-8 sequence at the end of s[from:], or 0.
// Only a *valid* prefix is held back: bytes that can never become a character are final already
// (the decoder replaces them the same whatever follows), and holding them would not help.
size_t incomplete_utf8_tail(const std::string & s, size_t from) {
    const size_t n = s.size();
    for (size_t back = 1; back <= 3 && back <= n - from; ++back) {
        const auto lead = static_cast<unsigned char>(s[n - back]);
        if ((lead & 0xC0) == 0x80) {
            continue;  // continuation byte: keep looking for the lead
        }
        size_t need = 0;
        if (lead >= 0xC2 && lead <= 0xDF) {
            need = 2;
        } else if (lead >= 0xE0 && lead <= 0xEF) {
            need = 3;
        } else if (lead >= 0xF0 && lead <= 0xF4) {
            need = 4;
        } else {
            return 0;  // ASCII or a byte that cannot start a sequence
        }
        if (back >= need) {
            return 0;  // complete
        }
        // The second byte's range depends on the lead (no overlongs, no surrogates, <= U+10FFFF).
        if (back >= 2) {
            const auto b1 = static_cast<unsigned char>(s[n - back + 1]);
            unsigned char lo = 0x80;
            unsigned char hi = 0xBF;
            if (lead == 0xE0) {
                lo = 0xA0;
            } else if (lead == 0xED) {
                hi = 0x9F;
            } else if (lead == 0xF0) {
                lo = 0x90;
            } else if (lead == 0xF4) {
                hi = 0x8F;
            }
            if (b1 < lo || b1 > hi) {
                return 0;
            }
        }
        return back;
    }
    return 0;
}

// Earliest start of any stop string in s[from:], or npos.
size_t find_stop(const std::string & s, size_t from, const std::vector<std::string> & stops) {
    size_t best = std::string::npos;
    for (const auto & stop : stops) {
        const size_t at = s.find(stop, from);
        if (at < best) {
            best = at;
        }
    }
    return best;
}

// Longest suffix of s[from:] that is a proper prefix of some stop string: text that may still turn
// out to be the start of a stop, so it cannot be streamed yet.
size_t stop_prefix_tail(const std::string & s, size_t from, const std::vector<std::string> & stops) {
    const size_t avail = s.size() - from;
    size_t hold = 0;
    for (const auto & stop : stops) {
        for (size_t k = std::min(stop.size() - 1, avail); k > hold; --k) {
            if (s.compare(s.size() - k, k, stop, 0, k) == 0) {
                hold = k;
                break;
            }
        }
    }
    return hold;
}

}  // namespace

bool text_assembly::push(std::string_view piece) {
    if (stopped_) {
        return false;
    }
    text_ += piece;
    const size_t match = find_stop(text_, final_, stops_);
    if (match != std::string::npos) {
        final_ = match;
        stopped_ = true;
        return true;
    }
    final_ = text_.size() - std::max(stop_prefix_tail(text_, final_, stops_), incomplete_utf8_tail(text_, final_));
    return false;
}

}  // namespace lloyal
