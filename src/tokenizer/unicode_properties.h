// Rewrites a tokenizer.json regex so that PCRE2 classifies characters as the Oniguruma inside HF
// tokenizers does (Unicode 16.0). Classification itself stays PCRE2's; two gaps are closed:
// * \s / \S become \p{White_Space} / \P{White_Space}: PCRE2's \s also matches U+180E, which
//   Unicode (and Oniguruma) no longer count as white space;
// * when the system PCRE2 is older (Debian 12's 10.42 has Unicode 14.0), every \p{X} for a
//   letter, mark, number, punctuation, symbol or separator category also matches the characters
//   Unicode 15.0-16.0 assigned to X (unicode16_new_ranges.inc, generated from the UCD).
#pragma once

#include <string>
#include <string_view>

namespace dsv4::tok {

// `pattern` rewritten as described; \p{X} / \pX and \P{X} outside brackets are widened. Escapes
// the table cannot widen (\P{X} inside [...], script and binary properties, \d, \w) are kept.
std::string align_with_oniguruma(std::string_view pattern);

}  // namespace dsv4::tok
