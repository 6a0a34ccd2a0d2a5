// Bad input to the dsv4 CLI, case by case (issue 15's list): every case ends in a one-line
// error naming the problem, a non-zero exit below 128 and nothing on stdout; and `--help` of
// every command in the command table, whose flags README.md documents.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "commands.h"
#include "model/memory_plan.h"
#include "model/model_config.h"
#include "model/quant_scheme.h"
#include "support/cli_run.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

namespace fs = std::filesystem;

std::string read_file(const std::string& p) {
  std::ifstream is(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(is), {});
}
void write_file(const std::string& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}

class CliErrors : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir;
    const CliResult r = run("make-tiny --preset flash --seed 7 --out " + *tmp_ / "m");
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() { delete tmp_; }
  static CliResult run(const std::string& args) { return run_cli(DSV4_CLI, args, *tmp_); }
  static std::string model() { return *tmp_ / "m"; }

  // A copy of the model whose files are links to the original's, but for `own` (copied).
  static std::string variant(const std::string& name, const std::set<std::string>& own = {}) {
    const std::string dir = *tmp_ / name;
    fs::create_directory(dir);
    for (const auto& e : fs::directory_iterator(model())) {
      const std::string f = e.path().filename().string();
      if (own.count(f) || f == "config.json")
        fs::copy_file(e.path(), dir + "/" + f);
      else
        fs::create_symlink(e.path(), dir + "/" + f);
    }
    return dir;
  }
  static std::string with_config(const std::string& name,
                                 const std::function<void(nlohmann::json&)>& edit) {
    const std::string dir = variant(name);
    nlohmann::json j = nlohmann::json::parse(read_file(dir + "/config.json"));
    edit(j);
    write_file(dir + "/config.json", j.dump());
    return dir;
  }
  // `bytes` written over tensor `tensor` from element `index` on (its shard copied).
  static std::string with_weight(const std::string& name, const std::string& tensor, int64_t index,
                                 const std::string& bytes, size_t size) {
    const nlohmann::json idx =
        nlohmann::json::parse(read_file(model() + "/model.safetensors.index.json"));
    const std::string shard = idx["weight_map"][tensor];
    const std::string dir = variant(name, {shard});
    std::string s = read_file(dir + "/" + shard);
    uint64_t hlen;
    std::memcpy(&hlen, s.data(), 8);
    const nlohmann::json h = nlohmann::json::parse(s.substr(8, hlen));
    const uint64_t at = 8 + hlen + h[tensor]["data_offsets"][0].get<uint64_t>() + index * size;
    s.replace(at, bytes.size(), bytes);
    write_file(dir + "/" + shard, s);
    return dir;
  }

  // The contract: one line on stderr naming the problem, exit in [1, 127], nothing on stdout.
  static void expect_error(const std::string& args, const std::string& expect) {
    const CliResult r = run(args);
    const std::string shown = args.substr(0, 200);
    EXPECT_GT(r.code, 0) << shown << " (negative = killed by a signal)";
    EXPECT_LT(r.code, 128) << shown;
    EXPECT_NE(r.err.find(expect), std::string::npos)
        << shown << "\n  want: " << expect << "\n  stderr: " << r.err.substr(0, 400);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << shown << "\n  " << r.err;
    EXPECT_EQ(r.err.rfind("dsv4", 0), 0u) << r.err.substr(0, 400);
    EXPECT_LT(r.err.size(), 400u) << shown << ": errors quote excerpts, not whole inputs";
    EXPECT_TRUE(r.out.empty()) << shown;
  }
  static TempDir* tmp_;
};
TempDir* CliErrors::tmp_ = nullptr;

template <typename T>
std::string bits(T v, int count = 1) {
  std::string s;
  for (int i = 0; i < count; ++i) s.append(reinterpret_cast<const char*>(&v), sizeof v);
  return s;
}

TEST_F(CliErrors, NonFiniteWeightsAreRefusedAtLoad) {
  const uint16_t nan = 0x7fc0, inf = 0x7f80;
  const std::string gen = " --prompt-ids 0,1 --max-new-tokens 4";
  const std::vector<std::tuple<std::string, std::string, int64_t, std::string, size_t>> cases = {
      {"w-embed", "embed.weight", 100, bits(nan), 2},
      {"w-row", "embed.weight", 5 * 256, bits(nan, 256), 2},
      {"w-head", "head.weight", 77, bits(inf), 2},
      {"w-norm", "layers.3.attn_norm.weight", 1, bits(nan), 2},
      {"w-hcbase", "hc_head_base", 0, bits(NAN), 4},
  };
  for (const auto& [name, tensor, index, bytes, size] : cases) {
    const std::string dir = with_weight(name, tensor, index, bytes, size);
    expect_error("generate --model " + dir + gen, "non-finite weight: tensor '" + tensor + "'");
  }
}

TEST_F(CliErrors, ConfigValuesOutsideTheirBounds) {
  const std::string gen = " --prompt-ids 0,1 --max-new-tokens 4";
  const std::vector<std::tuple<std::string, std::function<void(nlohmann::json&)>, std::string>>
      cases = {
          {"c-sinkhorn", [](auto& j) { j["hc_sinkhorn_iters"] = 2147483647; },
           "field 'hc_sinkhorn_iters' = 2147483647 is out of range [1, 1000]"},
          {"c-window", [](auto& j) { j["sliding_window"] = 2147483647; },
           "field 'sliding_window' = 2147483647 is out of range"},
          {"c-eps", [](auto& j) { j["rms_norm_eps"] = -1; },
           "field 'rms_norm_eps' = -1 is out of range (0, 1]"},
          {"c-factor", [](auto& j) { j["rope_scaling"]["factor"] = 0; },
           "field 'rope_scaling.factor' = 0 is out of range"},
          {"c-ratio", [](auto& j) { j["compress_ratios"][1] = 4294967300ull; },
           "compress_ratios[1] = 4294967300 is not supported (0, 4 or 128)"},
          // Within its bound, but its window rings alone take terabytes.
          {"c-huge-window", [](auto& j) { j["sliding_window"] = 1 << 30; },
           "not enough host memory: the model needs"},
      };
  for (const auto& [name, edit, expect] : cases)
    expect_error("generate --model " + with_config(name, edit) + gen, expect);
  // The issue's 2e7 window (~80 GB): refused with the figures wherever it does not fit.
  const std::string dir = with_config("c-2e7", [](auto& j) { j["sliding_window"] = 20000000; });
  const ModelConfig c = load_model_config(dir + "/config.json");
  MemoryPlanOptions o;
  o.max_tokens = 6;
  const MemoryPlan p = plan_memory(c, QuantScheme::load(dir, c), o);
  if (p.pools[0].required() > host_available_bytes())
    expect_error("generate --model " + dir + gen, "(weights ");
  else
    std::fprintf(stderr, "note: this machine has room for the 2e7 window; case not run\n");
}

TEST_F(CliErrors, OutputFilesAreNeverSpecialFiles) {
  const std::string d = *tmp_ / "out";
  fs::create_directory(d);
  ASSERT_EQ(::mkfifo((d + "/fifo").c_str(), 0644), 0);
  write_file(d + "/target", "keep");
  fs::create_symlink(d + "/target", d + "/link");
  const std::vector<std::string> before = [&] {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(d)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }();
  const std::string logits = "logits --model " + model() + " --prompt-ids 0,1 --out ";
  expect_error(logits + d + "/fifo",
               "is a FIFO (named pipe); dsv4 writes output only to a "
               "regular file or a new path");
  expect_error(logits + "/dev/null", "/dev/null: is a character device");
  expect_error(logits + d + "/link", "is a symbolic link");
  expect_error(logits + d, "is a directory");
  expect_error(logits + "''", "the output path is empty");
  expect_error(logits + d + "/no/such/file", "does not exist");
  std::vector<std::string> after;
  for (const auto& e : fs::directory_iterator(d)) after.push_back(e.path().filename().string());
  std::sort(after.begin(), after.end());
  EXPECT_EQ(after, before) << "a temporary was left behind or a file replaced";
  EXPECT_FALSE(fs::exists(d + ".tmp"));
  EXPECT_TRUE(fs::is_fifo(d + "/fifo"));
  EXPECT_TRUE(fs::is_symlink(d + "/link"));
  EXPECT_EQ(read_file(d + "/target"), "keep");
  // A regular file is replaced.
  const CliResult r = run(logits + d + "/target");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(read_file(d + "/target"), "keep");
}

TEST_F(CliErrors, ArgumentsAndPrompts) {
  const std::string m = " --model " + model();
  const std::string gen = "generate" + m;
  std::string raw(10 << 20, '\x01');  // a 10 MB line of raw bytes
  raw[0] = '\xff';
  write_file(*tmp_ / "raw.txt", raw);
  const std::string huge(60000, '7');  // below the 128 KiB limit of one argument
  const std::vector<std::pair<std::string, std::string>> cases = {
      {gen + " --prompt-ids 0 --temperature 1e39",
       "--temperature: '1e39' is out of range [0, 1000]"},
      {gen + " --prompt-ids 0 --temperature nan", "--temperature: 'nan' is not a number"},
      {gen + " --prompt-ids 0 --max-new-tokens 99999999999999999999",
       "--max-new-tokens: '99999999999999999999' is out of range [0, 16777216]"},
      {gen + " --prompt-ids '0 17'", "(ids are separated by commas, not spaces)"},
      {gen + " --prompt-ids 0,1,", "--prompt-ids: nothing after the last comma (trailing comma?)"},
      {gen + " --prompt-ids ,1", "--prompt-ids: id 1 is empty (leading comma?)"},
      {gen + " --prompt-ids " + huge, "is too large (at most 2147483647)"},
      {gen + " --prompt-file " + *tmp_ / "raw.txt", "raw.txt:1: '\\xff\\x01\\x01"},
      {gen + " --prompt-file " + tmp_->path(), "is a directory, not a prompt file"},
      {gen + " --prompt-ids 0 --" + huge, "unknown flag '--77777"},
      {gen + " --prompt-ids 0 stray", "unexpected argument 'stray'"},
      {gen + " --prompt-ids 0 --seed -1", "--seed: '-1' is not a non-negative integer"},
      {gen + " --prompt-ids 0 --ignore-eos=1", "flag --ignore-eos takes no value"},
      {gen + " --prompt-ids 0 --prompt-ids 1", "flag --prompt-ids given twice"},
      {gen + " --prompt-ids", "flag --prompt-ids needs a value (IDS)"},
      {gen, "no prompt: give exactly one of --prompt-ids, --prompt-file, --prompt and --messages"},
      {"logits" + m + " --prompt-ids 0 --out " + *tmp_ / "x" + " --prefill-chunk -1",
       "--prefill-chunk: '-1' is out of range [0, 1073741824]"},
      {gen + " --random-weights flash --prompt-ids 0",
       "give exactly one of --model and --random-weights"},
      {"generate --prompt-ids 0", "give exactly one of --model and --random-weights"},
      {"generate --random-weights huge --prompt-ids 0",
       "--random-weights: 'huge' is neither a preset (flash, pro) nor a config.json file"},
      {"generate --random-weights flash --format int3 --prompt-ids 0",
       "--format: 'int3' is not one of mxfp4, nvfp4"},
      {"generate --random-weights flash --layers 7 --prompt-ids 0", "layers must be in [1, 6]"},
      {gen + " --repeat-experts --prompt-ids 0",
       "--repeat-experts applies to --random-weights (a --model directory has its own)"},
      {"generate --random-weights flash --prompt hello",
       "random weights have no tokenizer: give --prompt-ids or --prompt-file"},
      {"plan --random-weights flash --config " + model() + "/config.json",
       "give exactly one of --model, --config and --random-weights"},
      {"plan --config " + model() + "/config.json --layers 2",
       "--layers applies to --random-weights"},
      {"serve --random-weights flash --port 0",
       "--random-weights: serving needs a tokenizer (give --tokenizer FILE)"},
      {gen + " --prompt-ids 0 --verify-layers 1-2", "--verify-layers applies to --verify"},
      {gen + " --prompt-ids 0 --backend cuda --verify --verify-layers 3-1",
       "--verify-layers: 3-1 ends before it starts"},
      {gen + " --prompt-ids 0 --backend cuda --verify --verify-layers 1-x",
       "--verify-layers: '1-x' is not A-B or A (block numbers from 0)"},
      {gen + " --prompt-ids 0 --backend cuda --verify --verify-layers -1",
       "--verify-layers: '-1' is not A-B or A (block numbers from 0)"},
      {"bogus-command", "unknown command 'bogus-command'"},
      {std::string(5000, 'z'), "unknown command 'zzzz"},
  };
  for (const auto& [args, expect] : cases) expect_error(args, expect);
  // "-h" as a flag's value is that value, not a request for help.
  expect_error(gen + " --prompt-ids -h", "--prompt-ids: '-h' is not a token id");
  // One id syntax: commas, optional spaces; a prompt file holds the same, on any lines.
  const CliResult a = run(gen + " --prompt-ids 0,17,42 --max-new-tokens 3");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(run(gen + " --prompt-ids ' 0, 17 ,42 ' --max-new-tokens 3").out, a.out);
  write_file(*tmp_ / "ids.txt", "0, 17\n\n42\n");
  EXPECT_EQ(run(gen + " --prompt-file " + *tmp_ / "ids.txt --max-new-tokens 3").out, a.out);
  write_file(*tmp_ / "ids2.txt", "0,17,42\n");  // `dsv4 tokenize`'s output format
  EXPECT_EQ(run(gen + " --prompt-file " + *tmp_ / "ids2.txt --max-new-tokens 3").out, a.out);
}

TEST_F(CliErrors, MakeTinyRefusesANonEmptyDirectoryUnlessForced) {
  const std::string d = *tmp_ / "tiny";
  fs::copy(model(), d, fs::copy_options::recursive);  // a checkpoint make-tiny wrote
  write_file(d + "/model-00009-of-00009.safetensors", "stale");
  write_file(d + "/notes.txt", "mine");
  expect_error("make-tiny --preset pro --seed 2 --out " + d,
               "directory is not empty (give --force to replace the checkpoint in it)");
  const CliResult r = run("make-tiny --preset pro --seed 2 --out " + d + " --force");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(d + "/model-00009-of-00009.safetensors"));
  EXPECT_EQ(read_file(d + "/notes.txt"), "mine");  // not a checkpoint file: kept
  const CliResult g = run("generate --model " + d + " --prompt-ids 0,1 --max-new-tokens 2");
  EXPECT_EQ(g.code, 0) << g.err;
  write_file(*tmp_ / "plain", "x");
  expect_error("make-tiny --preset flash --out " + *tmp_ / "plain",
               "exists and is not a directory");
  // The geometry: a preset or a config, not both; --layers within the config's.
  expect_error("make-tiny --out " + *tmp_ / "none", "give exactly one of --preset and --config");
  expect_error("make-tiny --preset flash --config " + d + "/config.json --out " + *tmp_ / "both",
               "give exactly one of --preset and --config");
  expect_error("make-tiny --config " + d + "/config.json --layers 7 --out " + *tmp_ / "deep",
               "layers must be in [1, 5], got 7");
  const CliResult cut =
      run("make-tiny --config " + d + "/config.json --layers 2 --out " + *tmp_ / "cut");
  ASSERT_EQ(cut.code, 0) << cut.err;
  EXPECT_NE(cut.out.find("2 layers"), std::string::npos) << cut.out;
}

TEST_F(CliErrors, NoGpuIsNotBlamedOnTheDriverVersion) {
  const CliResult r = run("generate --model " + model() + " --prompt-ids 0 --backend cuda");
  if (r.code == 0) GTEST_SKIP() << "a usable GPU is present";
  EXPECT_LT(r.code, 128);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.find("driver version"), std::string::npos) << r.err;
  EXPECT_TRUE(r.err.find("no CUDA backend") != std::string::npos ||
              r.err.find("no NVIDIA driver") != std::string::npos ||
              r.err.find("no CUDA device") != std::string::npos)
      << r.err;
}

TEST_F(CliErrors, PlanPrintsTheFiguresAndRefusesWhatCannotFit) {
  const CliResult r = run("plan --model " + model() + " --max-model-len 1000 --max-running 2");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* want : {"host memory:", "  weights", "  cache", "  activations", "fits: yes",
                           "2 sequences of up to 1000 tokens"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  const std::string dir = with_config("p-huge", [](auto& j) { j["sliding_window"] = 1 << 30; });
  const CliResult n = run("plan --model " + dir);
  EXPECT_EQ(n.code, 1);
  EXPECT_NE(n.out.find("fits: no"), std::string::npos) << n.out;
  EXPECT_NE(n.err.find("not enough host memory"), std::string::npos) << n.err;
  const CliResult cuda = run("plan --model " + model() + " --backend cuda");
  EXPECT_NE(cuda.out.find("GPU 0 memory:"), std::string::npos) << cuda.out << cuda.err;
}

// The parallel plan from a config alone: one pool per GPU, judged against --gpu-mb; a layout
// that does not match --gpus, or that the model does not divide, is a one-line error.
TEST_F(CliErrors, PlanOverSeveralGpusFromAConfig) {
  const std::string flash =
      std::string(DSV4_SOURCE_DIR) + "/tests/data/deepseek-v4-flash.config.json";
  const CliResult two =
      run("plan --config " + flash + " --gpus 2 --max-model-len 65536 --max-running 8");
  ASSERT_EQ(two.code, 0) << two.err;
  for (const char* want : {"layout        dp 2 x tp 1 attention, ep 2 experts", "GPU 0 memory:",
                           "GPU 1 memory:", "experts 128-255", "cache room", "fits: yes"})
    EXPECT_NE(two.out.find(want), std::string::npos) << want << "\n" << two.out;
  const CliResult one = run("plan --config " + flash + " --gpus 1");
  EXPECT_EQ(one.code, 1);
  EXPECT_NE(one.err.find("not enough GPU 0 memory"), std::string::npos) << one.err;
  for (const char* bad : {" --gpus 2 --dp 4 --ep 4", " --gpus 3", " --gpus 2 --backend cpu",
                          " --backend cuda --dp 2 --ep 2"}) {
    const CliResult r = run("plan --config " + flash + bad);
    EXPECT_EQ(r.code, 1) << bad;
    EXPECT_TRUE(r.out.empty() || r.out.find("fits") == std::string::npos) << bad;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << bad << ": " << r.err;
  }
  EXPECT_EQ(run("plan --config " + flash + " --model " + model()).code, 1);
}

// ---- help --------------------------------------------------------------------------------

// README's section "### `dsv4 NAME`" (to the next heading).
std::string readme_section(const std::string& readme, const std::string& name) {
  const std::string head = "### `dsv4 " + name + "`";
  const size_t b = readme.find(head);
  if (b == std::string::npos) return "";
  const size_t e = readme.find("\n#", b + head.size());
  return readme.substr(b, e == std::string::npos ? std::string::npos : e - b);
}

TEST_F(CliErrors, EveryCommandHasHelpAndReadmeDocumentsEveryFlag) {
  const std::string readme = read_file(std::string(DSV4_SOURCE_DIR) + "/README.md");
  const CliResult top = run("--help");
  EXPECT_EQ(top.code, 0);
  EXPECT_TRUE(top.err.empty()) << top.err;
  for (const cli::Command* c : cli::command_table()) {
    EXPECT_NE(top.out.find("  " + c->name + " "), std::string::npos) << c->name;
    EXPECT_NE(top.out.find(c->summary), std::string::npos) << c->name;
    const CliResult h = run(c->name + " --help");
    EXPECT_EQ(h.code, 0) << c->name;
    EXPECT_TRUE(h.err.empty()) << c->name << ": " << h.err;
    EXPECT_EQ(h.out, cli::command_help(*c));
    EXPECT_EQ(h.out.rfind("usage: dsv4 " + c->name, 0), 0u) << h.out;
    EXPECT_EQ(run(c->name + " -h").out, h.out);
    EXPECT_EQ(run(c->name + " --bogus 1 --help").out, h.out);  // help wins over other errors
    EXPECT_EQ(run("help " + c->name).out, h.out);
    const std::string section = readme_section(readme, c->name);
    EXPECT_FALSE(section.empty()) << "README.md has no section ### `dsv4 " << c->name << "`";
    for (const cli::Flag& f : c->flags) {
      // Help lists the flag with its default, choices and range.
      const std::string line = f.name + (f.is_switch() ? "" : " " + f.value);
      EXPECT_NE(h.out.find("  " + line), std::string::npos) << c->name << " " << f.name;
      EXPECT_NE(h.out.find(cli::flag_notes(f)), std::string::npos) << c->name << " " << f.name;
      // README's row for the flag names its default.
      const size_t at = section.find("| `" + line + "` |");
      EXPECT_NE(at, std::string::npos)
          << "README.md: `dsv4 " << c->name << "` lacks the row | `" << line << "` |";
      if (at != std::string::npos && !f.fallback.empty()) {
        const std::string row = section.substr(at, section.find('\n', at) - at);
        EXPECT_NE(row.find("| " + f.fallback + " |"), std::string::npos)
            << c->name << " " << f.name << ": README row without the default " << f.fallback;
      }
    }
    // And nothing the command does not accept.
    const std::regex flag_re("`(--[a-z0-9-]+)");
    for (std::sregex_iterator it(section.begin(), section.end(), flag_re), end; it != end; ++it) {
      const std::string name = (*it)[1];
      const bool known =
          name == "--help" || std::any_of(c->flags.begin(), c->flags.end(),
                                          [&](const cli::Flag& f) { return f.name == name; });
      EXPECT_TRUE(known) << "README.md documents " << name << " for `dsv4 " << c->name
                         << "`, which it does not accept";
    }
  }
}

}  // namespace
}  // namespace dsv4::test
