// JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it, which is what
// the DeepSeek-V4 encoder puts into prompts (tool schemas, response formats, non-string tool
// arguments): ", " and ": " separators, key order kept, non-ASCII written raw, control
// characters as \u00XX, floats as Python's repr (1.0, 1e+16, 1e-05).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace dsv4::tok {

using ordered_json = nlohmann::ordered_json;

std::string python_json_dumps(const ordered_json& value);

// Python's repr(float): the shortest digits that read back to `v`, in fixed notation when the
// decimal exponent is in [-4, 16), else d.ddde±XX; "nan", "inf" spelled NaN / Infinity as json.
std::string python_float_repr(double v);

// str(value) as Python's str.format would insert a JSON scalar (None, True, 3, 1.5, text);
// throws dsv4::Error naming `what` for arrays and objects.
std::string python_str(const ordered_json& value, const std::string& what);

// Python truthiness of a JSON value (null, false, 0, "", [] and {} are false).
bool python_truthy(const ordered_json& value);

}  // namespace dsv4::tok
