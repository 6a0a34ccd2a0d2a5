#include "tokenizer/python_json.h"

#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace dsv4::tok {
namespace {

void append_string(const std::string& s, std::string& out) {
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

void append(const ordered_json& v, std::string& out) {
  switch (v.type()) {
    case ordered_json::value_t::null:
      out += "null";
      break;
    case ordered_json::value_t::boolean:
      out += v.get<bool>() ? "true" : "false";
      break;
    case ordered_json::value_t::number_integer:
      out += std::to_string(v.get<int64_t>());
      break;
    case ordered_json::value_t::number_unsigned:
      out += std::to_string(v.get<uint64_t>());
      break;
    case ordered_json::value_t::number_float:
      out += python_float_repr(v.get<double>());
      break;
    case ordered_json::value_t::string:
      append_string(v.get_ref<const std::string&>(), out);
      break;
    case ordered_json::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& e : v) {
        if (!first) out += ", ";
        first = false;
        append(e, out);
      }
      out += ']';
      break;
    }
    case ordered_json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, e] : v.items()) {
        if (!first) out += ", ";
        first = false;
        append_string(k, out);
        out += ": ";
        append(e, out);
      }
      out += '}';
      break;
    }
    default:
      throw Error("JSON value of a type Python cannot write (binary or discarded)");
  }
}

}  // namespace

std::string python_float_repr(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  // Shortest round-trip digits and exponent: "-d.ddde+XX".
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  const std::string sci(buf, res.ptr);
  const size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  const int exp10 = std::stoi(sci.substr(e + 1));
  std::string sign;
  if (!mantissa.empty() && mantissa[0] == '-') {
    sign = "-";
    mantissa.erase(0, 1);
  }
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  const int decpt = exp10 + 1;  // value = 0.<digits> * 10^decpt
  const int n = int(digits.size());
  std::string out = sign;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0.";
      out.append(size_t(-decpt), '0');
      out += digits;
    } else if (decpt >= n) {
      out += digits + std::string(size_t(decpt - n), '0') + ".0";
    } else {
      out.append(digits, 0, size_t(decpt));
      out += '.';
      out.append(digits, size_t(decpt), std::string::npos);
    }
  } else {
    out += digits.substr(0, 1);
    if (n > 1) {
      out += '.';
      out.append(digits, 1, std::string::npos);
    }
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += ebuf;
  }
  return out;
}

std::string python_json_dumps(const ordered_json& value) {
  std::string out;
  append(value, out);
  return out;
}

std::string python_str(const ordered_json& value, const std::string& what) {
  switch (value.type()) {
    case ordered_json::value_t::string:
      return value.get<std::string>();
    case ordered_json::value_t::null:
      return "None";
    case ordered_json::value_t::boolean:
      return value.get<bool>() ? "True" : "False";
    case ordered_json::value_t::number_integer:
    case ordered_json::value_t::number_unsigned:
      return python_json_dumps(value);
    case ordered_json::value_t::number_float: {
      const double d = value.get<double>();
      if (std::isnan(d)) return "nan";
      if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
      return python_float_repr(d);
    }
    default:
      throw Error(cat(what, " must be a string, not a JSON ", value.type_name()));
  }
}

bool python_truthy(const ordered_json& value) {
  switch (value.type()) {
    case ordered_json::value_t::null:
      return false;
    case ordered_json::value_t::boolean:
      return value.get<bool>();
    case ordered_json::value_t::number_integer:
      return value.get<int64_t>() != 0;
    case ordered_json::value_t::number_unsigned:
      return value.get<uint64_t>() != 0;
    case ordered_json::value_t::number_float:
      return value.get<double>() != 0.0;
    case ordered_json::value_t::string:
      return !value.get_ref<const std::string&>().empty();
    case ordered_json::value_t::array:
    case ordered_json::value_t::object:
      return !value.empty();
    default:
      return false;
  }
}

}  // namespace dsv4::tok
