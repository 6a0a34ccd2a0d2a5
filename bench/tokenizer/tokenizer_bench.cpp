// tokenizer_bench [--tokenizer FILE] [--repeat N] [--out FILE.md] [--no-hf]
// Single-thread encode and decode throughput of the dsv4 tokenizer on the test corpus
// (tests/tokenizer/corpus.h, ~6 MB), side by side with HF tokenizers (the Rust library through
// its Python binding, scripts/tokenizer/hf_oracle.py bench) in the same run, and writes the
// table with the machine, date and git commit (default bench/results/tokenizer.md).
#include <sys/utsname.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "corpus.h"
#include "test_support.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace dsv4;
using namespace dsv4::tok;

double best_seconds(int repeat, const std::function<void()>& fn) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string cpu_model() {
  std::ifstream is("/proc/cpuinfo");
  std::string line;
  while (std::getline(is, line))
    if (line.rfind("model name", 0) == 0) return trimmed(line.substr(line.find(':') + 2));
  return "unknown CPU";
}

std::string machine() {
  utsname u{};
  uname(&u);
  return dsv4::cat(cpu_model(), ", ", std::thread::hardware_concurrency(), " hardware threads, ",
                   u.sysname, " ", u.release, " ", u.machine);
}

std::string git_commit() {
  std::string head, dirty;
  const std::string git = "git -C " + test::source_dir() + " ";
  if (test::run_command(git + "rev-parse --short=12 HEAD 2>/dev/null", &head) != 0)
    return "unknown";
  test::run_command(git + "status --porcelain --untracked-files=no 2>/dev/null", &dirty);
  return trimmed(head) + (trimmed(dirty).empty() ? "" : " + uncommitted changes");
}

// The 1-minute load average: other work on the machine slows both implementations alike.
std::string load_average() {
  std::ifstream is("/proc/loadavg");
  std::string first;
  is >> first;
  return first.empty() ? "unknown" : first;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&t));
  return buf;
}

std::string fixed(double v, int digits = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string tokenizer =
        test::tokenizer_dir().empty() ? std::string() : test::tokenizer_dir() + "/tokenizer.json";
    std::string out = test::source_dir() + "/bench/results/tokenizer.md";
    int repeat = 3;
    bool hf = true;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&] {
        DSV4_CHECK(i + 1 < argc, "flag ", a, " needs a value");
        return std::string(argv[++i]);
      };
      if (a == "--tokenizer")
        tokenizer = value();
      else if (a == "--out")
        out = value();
      else if (a == "--repeat")
        repeat = std::stoi(value());
      else if (a == "--no-hf")
        hf = false;
      else
        throw Error(cat("unknown argument '", a, "'"));
    }
    DSV4_CHECK(!tokenizer.empty(), "no tokenizer.json (give --tokenizer or DSV4_TOKENIZER_DIR)");
    DSV4_CHECK(repeat >= 1, "--repeat must be >= 1");

    const std::string load_at_start = load_average();
    const Tokenizer tok = Tokenizer::from_file(tokenizer);
    const auto docs = test::make_corpus(test::CorpusSeeds::load(test::seed_dir()),
                                        test::added_token_strings(tok));
    size_t bytes = 0, tokens = 0;
    std::vector<std::vector<int32_t>> ids;
    for (const auto& d : docs) {
      bytes += d.text.size();
      ids.push_back(tok.encode(d.text));  // also warms the piece cache, as HF's warm-up does
      tokens += ids.back().size();
    }
    const double enc = best_seconds(repeat, [&] {
      for (const auto& d : docs) tok.encode(d.text);
    });
    size_t decoded = 0;
    const double dec = best_seconds(repeat, [&] {
      decoded = 0;
      for (const auto& v : ids) decoded += tok.decode(v).size();
    });
    const double stream = best_seconds(repeat, [&] {
      for (const auto& v : ids) {
        StreamDecoder sd(tok);
        for (int32_t id : v) sd.push(id);
        sd.finish();
      }
    });
    std::printf("dsv4: encode %.3f s, decode %.3f s, stream decode %.3f s\n", enc, dec, stream);

    nlohmann::json ref;
    std::string hf_note;
    if (hf) {
      if (const std::string why = test::python_oracle_missing(); !why.empty()) {
        hf_note = why;
      } else {
        const std::string dir = test::make_temp_dir();
        test::write_corpus_file(docs, dir + "/corpus.bin");
        std::string json_out;
        const int rc = test::run_command(
            "python3 " + test::source_dir() + "/scripts/tokenizer/hf_oracle.py bench --tokenizer " +
                tokenizer + " --corpus " + dir + "/corpus.bin --repeat " + std::to_string(repeat),
            &json_out);
        std::filesystem::remove_all(dir);
        DSV4_CHECK(rc == 0, "the HF tokenizers benchmark failed");
        ref = nlohmann::json::parse(json_out);
        std::printf("HF:   encode %.3f s, decode %.3f s\n", ref["encode_seconds"].get<double>(),
                    ref["decode_seconds"].get<double>());
      }
    }

    const double mb = double(bytes) / 1e6;
    std::ostringstream md;
    md << "# Tokenizer throughput\n\n"
       << "Written by `bench/tokenizer/run.sh` (`tokenizer_bench`); one run, both implementations "
          "on the same corpus, one thread each, best of "
       << repeat << " passes.\n\n"
       << "* machine: " << machine() << " (load average " << load_at_start << " at start)\n"
       << "* date: " << utc_now() << "\n"
       << "* git commit: " << git_commit() << "\n"
       << "* corpus: tests/tokenizer/corpus.h, " << docs.size() << " documents, " << bytes
       << " bytes (English, Chinese and other scripts, code, markdown, emoji, numbers, whitespace "
          "runs, every added token, invalid UTF-8, random code points), "
       << tokens << " tokens\n"
       << "* MB = 10^6 bytes of corpus text; decode MB/s counts the decoded text\n\n"
       << "| implementation | encode s | encode MB/s | encode Mtok/s | decode s | decode MB/s |\n"
       << "|---|---:|---:|---:|---:|---:|\n"
       << "| dsv4 (C++, PCRE2 "
       << "JIT) | " << fixed(enc, 3) << " | " << fixed(mb / enc) << " | "
       << fixed(tokens / enc / 1e6) << " | " << fixed(dec, 3) << " | " << fixed(decoded / dec / 1e6)
       << " |\n";
    if (!ref.is_null()) {
      const double he = ref["encode_seconds"], hd = ref["decode_seconds"];
      md << "| " << ref["implementation"].get<std::string>() << " | " << fixed(he, 3) << " | "
         << fixed(mb / he) << " | " << fixed(tokens / he / 1e6) << " | " << fixed(hd, 3) << " | "
         << fixed(decoded / hd / 1e6) << " |\n\n"
         << "**dsv4 / HF: encode " << fixed(he / enc) << "x, decode " << fixed(hd / dec)
         << "x** (target: encode >= 1.0x).\n";
    } else {
      md << "\nHF tokenizers not measured: " << (hf ? hf_note : "--no-hf") << "\n";
    }
    md << "\nStreaming decode (dsv4 StreamDecoder, one id at a time): " << fixed(stream, 3)
       << " s, " << fixed(tokens / stream / 1e6) << " Mtok/s.\n";
    std::ofstream os(out);
    DSV4_CHECK(os.good(), out, ": cannot write");
    os << md.str();
    std::printf("wrote %s\n", out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_bench: error: %s\n", e.what());
    return 1;
  }
}
