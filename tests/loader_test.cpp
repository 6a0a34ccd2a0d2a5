// Checkpoint loading: safetensors header validation, sharded checkpoints, config.json,
// ModelOpt quantisation configs, and the weight inventory check. Every failure names the
// file and the tensor or field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "backends/cpu/loader.h"
#include "core/error.h"
#include "core/formats.h"
#include "io/checkpoint.h"
#include "io/output_file.h"
#include "io/safetensors.h"
#include "model/tiny_checkpoint.h"
#include "model/weight_scan.h"
#include "model/weights.h"
#include "ops/cpu/dequant.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

namespace fs = std::filesystem;

// Runs `f` and returns the dsv4::Error message it throws ("" if none).
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string read_file(const std::string& p) {
  std::ifstream is(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(is), {});
}
void write_file(const std::string& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}
// A safetensors file with the given raw header and `data` bytes after it.
void write_raw(const std::string& p, const std::string& header, const std::string& data) {
  uint64_t n = header.size();
  std::string s(reinterpret_cast<const char*>(&n), 8);
  write_file(p, s + header + data);
}

TEST(Safetensors, WriteThenReadBack) {
  TempDir d;
  SafetensorsWriter w;
  std::vector<float> a = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  std::vector<int64_t> b = {7, -8};
  w.add("a", DType::kF32, {2, 3}, a);
  w.add("b", DType::kI64, {2}, b);
  w.add("empty", DType::kBF16, {0, 4}, nullptr, 0);
  w.set_metadata("format", "pt");
  w.write(d / "x.safetensors");
  SafetensorsFile f(d / "x.safetensors");
  EXPECT_EQ(f.get("a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(f.get("a").data, a.data(), 24), 0);
  EXPECT_EQ(f.get("b").as<int64_t>()[1], -8);
  EXPECT_EQ(f.get("empty").nbytes, 0u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_NE(error_of([&] { (void)f.get("zzz"); }).find("no tensor 'zzz'"), std::string::npos);
  EXPECT_NE(error_of([&] {
              w.add("a", DType::kF32, {2, 3}, a);
            }).find("duplicate"),
            std::string::npos);
  EXPECT_NE(error_of([&] { w.add("c", DType::kF32, {4}, a); }).find("does not match"),
            std::string::npos);
}

TEST(Safetensors, RejectsDamagedFiles) {
  TempDir d;
  const std::string p = d / "bad.safetensors";
  const std::string good = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct Case {
    std::string header, data, expect;
  };
  const std::vector<Case> cases = {
      {good, "1234", "tensor 't': data [0, 8) runs past the end"},  // truncated data
      {"{not json", "", "not valid JSON"},
      {"[1,2]", "", "not a JSON object"},
      {R"({"t":{"dtype":"F9","shape":[2],"data_offsets":[0,8]}})", "12345678",
       "unsupported dtype 'F9'"},
      {R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "12345678", "needs 12 bytes"},
      {R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", "12345678", "negative"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", "12345678", "reversed"},
      {R"({"t":{"dtype":"F32","shape":[2]}})", "12345678", "data_offsets"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"u":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       "12345678", "overlap"},
      // The same name twice (JSON parsers keep the last silently): a duplicate, not an overlap.
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       "12345678", "names tensor 't' twice (duplicate tensor name)"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       "12345678", "names tensor 't' twice (duplicate tensor name)"},
      // Bad input is quoted as a short excerpt, never whole.
      {"{\"" + std::string(100000, 'x') +
           "\":{\"dtype\":\"F9\",\"shape\":[],\"data_offsets\":[0,0]}}",
       "", "xxxxxxxx...' (100000 bytes)"},
      {"{\"t\":\"" + std::string(100000, 'y'), "", "last read: '\"yyyyyyyy"},
  };
  for (const auto& c : cases) {
    write_raw(p, c.header, c.data);
    const std::string e = error_of([&] { SafetensorsFile f(p); });
    EXPECT_NE(e.find(c.expect), std::string::npos) << "got: " << e.substr(0, 400);
    EXPECT_NE(e.find(p), std::string::npos) << "error must name the file: " << e.substr(0, 400);
    EXPECT_LT(e.size(), 400u) << e.substr(0, 400);
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  write_file(p, "abc");
  EXPECT_NE(error_of([&] { SafetensorsFile f(p); }).find("truncated"), std::string::npos);
  uint64_t huge = 1ull << 40;
  write_file(p, std::string(reinterpret_cast<const char*>(&huge), 8) + "{}");
  EXPECT_NE(error_of([&] { SafetensorsFile f(p); }).find("header length"), std::string::npos);
  write_raw(p, good, "12345678");
  EXPECT_EQ(error_of([&] { SafetensorsFile f(p); }), "");
  EXPECT_NE(error_of([&] { SafetensorsFile f(d / "missing.safetensors"); }).find("cannot open"),
            std::string::npos);
}

ModelConfig tiny_flash() {
  return tiny_preset("flash");
}

TEST(Config, RoundTripsAndRejectsBadFields) {
  const ModelConfig c = tiny_flash();
  const ModelConfig back = parse_model_config(model_config_to_json(c), "x");
  EXPECT_EQ(back.compress_ratios, c.compress_ratios);
  EXPECT_EQ(back.n_heads, c.n_heads);
  EXPECT_EQ(back.original_seq_len, 65536);
  EXPECT_EQ(back.route_scale, c.route_scale);
  nlohmann::json j = nlohmann::json::parse(model_config_to_json(c));
  auto with = [&](auto edit) {
    nlohmann::json k = j;
    edit(k);
    return error_of([&] { parse_model_config(k.dump(), "config.json"); });
  };
  EXPECT_NE(with([](auto& k) { k.erase("hidden_size"); }).find("missing field 'hidden_size'"),
            std::string::npos);
  EXPECT_NE(with([](auto& k) {
              k["architectures"] = {"LlamaForCausalLM"};
            }).find("unsupported architecture"),
            std::string::npos);
  EXPECT_NE(with([](auto& k) {
              k["compress_ratios"] = {0, 4};
            }).find("compress_ratios has 2 entries"),
            std::string::npos);
  EXPECT_NE(with([](auto& k) { k["compress_ratios"][1] = 8; }).find("not supported"),
            std::string::npos);
  EXPECT_NE(with([](auto& k) { k["num_attention_heads"] = 3; }).find("o_groups"),
            std::string::npos);
  EXPECT_NE(with([](auto& k) { k["hidden_size"] = "256"; }).find("must be an integer"),
            std::string::npos);
  EXPECT_NE(with([](auto& k) {
              k["quantization_config"]["weight_block_size"] = {64, 64};
            }).find("[128, 128]"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_model_config("{", "config.json"); }).find("not valid JSON"),
            std::string::npos);
}

class TinyCheckpoint : public ::testing::Test {
 protected:
  // One checkpoint written per suite; every test damages its own copy.
  static void SetUpTestSuite() {
    master_ = new TempDir;
    write_tiny_checkpoint(tiny_flash(), ExpertFormat::kMxfp4, 3, master_->path());
  }
  static void TearDownTestSuite() { delete master_; }
  void SetUp() override {
    fs::copy(master_->path(), dir_.path(),
             fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  }
  static TempDir* master_;
  TempDir dir_;

  // Rewrites the shard holding `name` through `edit(writer, tensors)` and fixes the index.
  void edit_shard(const std::string& name,
                  const std::function<void(SafetensorsWriter&, const SafetensorsFile&)>& edit) {
    nlohmann::json idx = nlohmann::json::parse(read_file(dir_ / "model.safetensors.index.json"));
    const std::string shard = idx["weight_map"][name];
    std::string tmp = dir_ / "tmp.safetensors";
    {
      SafetensorsFile f(dir_ / shard);
      SafetensorsWriter w;
      edit(w, f);
      w.write(tmp);
    }
    fs::rename(tmp, dir_ / shard);
    SafetensorsFile f(dir_ / shard);
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end();)
      if (it.value() == shard && !f.contains(it.key()))
        it = idx["weight_map"].erase(it);
      else
        ++it;
    for (const auto& [n, t] : f.tensors()) idx["weight_map"][n] = shard;
    write_file(dir_ / "model.safetensors.index.json", idx.dump());
  }
  std::string load_error() {
    return error_of([&] { load_cpu_model(dir_.path()); });
  }
};

TempDir* TinyCheckpoint::master_ = nullptr;

TEST_F(TinyCheckpoint, LoadsAndBinds) {
  EXPECT_EQ(load_error(), "");
  Checkpoint ck(dir_.path());
  EXPECT_GT(ck.num_tensors(), 500u);
}

TEST_F(TinyCheckpoint, MissingExtraAndMisshapedTensorsAreListed) {
  edit_shard("layers.2.attn.wkv.scale", [](SafetensorsWriter& w, const SafetensorsFile& f) {
    for (const auto& [n, t] : f.tensors()) {
      if (n == "layers.2.attn.wkv.scale") continue;  // missing
      if (n == "layers.2.attn.kv_norm.weight") {     // mis-shaped
        w.add(n, t.dtype, {t.shape[0] / 2}, t.data, t.nbytes / 2);
        continue;
      }
      w.add(n, t.dtype, t.shape, t.data, t.nbytes);
    }
    std::vector<float> x(4);
    w.add("layers.2.attn.surprise", DType::kF32, {4}, x);  // unexpected
  });
  const std::string e = load_error();
  EXPECT_NE(e.find("1 missing [layers.2.attn.wkv.scale F8_E8M0 [4, 2]]"), std::string::npos) << e;
  EXPECT_NE(e.find("layers.2.attn.kv_norm.weight: BF16 [256], expected BF16 [512]"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("1 unexpected [layers.2.attn.surprise]"), std::string::npos) << e;
}

TEST_F(TinyCheckpoint, WrongDtypeIsNamed) {
  edit_shard("layers.0.attn.attn_sink", [](SafetensorsWriter& w, const SafetensorsFile& f) {
    for (const auto& [n, t] : f.tensors()) {
      if (n == "layers.0.attn.attn_sink")
        w.add(n, DType::kI32, t.shape, t.data, t.nbytes);
      else
        w.add(n, t.dtype, t.shape, t.data, t.nbytes);
    }
  });
  EXPECT_NE(load_error().find("layers.0.attn.attn_sink: I32 [4], expected F32 [4]"),
            std::string::npos);
}

TEST_F(TinyCheckpoint, TruncatedShardIsNamed) {
  const std::string shard = dir_ / "model-00002-of-00004.safetensors";
  const std::string bytes = read_file(shard);
  write_file(shard, bytes.substr(0, bytes.size() - 1000));
  const std::string e = load_error();
  EXPECT_NE(e.find("model-00002-of-00004.safetensors: tensor '"), std::string::npos) << e;
  EXPECT_NE(e.find("runs past the end of the file"), std::string::npos) << e;
}

TEST_F(TinyCheckpoint, IndexProblemsAreNamed) {
  nlohmann::json idx = nlohmann::json::parse(read_file(dir_ / "model.safetensors.index.json"));
  nlohmann::json bad = idx;
  bad["weight_map"]["embed.weight"] = "model-00009-of-00009.safetensors";
  write_file(dir_ / "model.safetensors.index.json", bad.dump());
  EXPECT_NE(load_error().find("shard 'model-00009-of-00009.safetensors'"), std::string::npos);
  bad = idx;
  bad["weight_map"].erase("norm.weight");
  write_file(dir_ / "model.safetensors.index.json", bad.dump());
  EXPECT_NE(
      load_error().find("'norm.weight' is in the shard but not in model.safetensors.index.json"),
      std::string::npos);
  write_file(dir_ / "model.safetensors.index.json", "{oops");
  EXPECT_NE(load_error().find("not valid JSON"), std::string::npos);
}

TEST_F(TinyCheckpoint, BadConfigAndMissingDirectory) {
  write_file(dir_ / "config.json", "{\"architectures\": [\"DeepseekV4ForCausalLM\"]}");
  EXPECT_NE(load_error().find("missing field"), std::string::npos);
  EXPECT_NE(error_of([] { load_cpu_model("/nonexistent/model"); }).find("does not exist"),
            std::string::npos);
}

TEST(Nvfp4, ModelOptLayoutGeneralScalesAndDequant) {
  TempDir d;
  write_tiny_checkpoint(tiny_flash(), ExpertFormat::kNvfp4, 4, d.path());
  const ModelConfig c = load_model_config(d / "config.json");
  EXPECT_EQ(c.moe_quant_algo, "NVFP4");
  const QuantScheme q = QuantScheme::load(d.path(), c);
  EXPECT_TRUE(q.has_modelopt_file());
  EXPECT_EQ(q.expert_format("layers.3.ffn.experts.7.w2"), ExpertFormat::kNvfp4);
  Checkpoint ck(d.path());
  const WeightsRef w = bind_weights(ck, c, q);
  const Fp4Ref& r = w.blocks[3].ffn.experts[7].w1;
  ASSERT_EQ(r.format, ExpertFormat::kNvfp4);
  float s2, s2_w3;
  std::memcpy(&s2, r.scale_2->data, 4);
  std::memcpy(&s2_w3, w.blocks[3].ffn.experts[7].w3.scale_2->data, 4);
  EXPECT_EQ(s2, s2_w3);                                 // w1 and w3 share the global scale
  EXPECT_NE(std::log2(s2), std::floor(std::log2(s2)));  // not a power of two
  // Block scales are general E4M3 values, not only powers of two.
  int non_pow2 = 0;
  for (size_t i = 0; i < size_t(r.scale->numel()); ++i) {
    const float v = e4m3_to_float(r.scale->data[i]);
    non_pow2 += v > 0 && std::log2(v) != std::floor(std::log2(v));
  }
  EXPECT_GT(non_pow2, r.scale->numel() / 4);
  // Dequantisation: e2m1 x weight_scale x weight_scale_2, element 2k in the low nibble.
  const std::vector<float> deq = cpu::dequant_fp4(r);
  const int in = int(r.weight->shape[1] * 2);
  for (int o : {0, 5, 127})
    for (int k : {0, 1, 16, 33, 255}) {
      const uint8_t byte = r.weight->data[size_t(o) * in / 2 + k / 2];
      const float want = e2m1_to_float(k % 2 ? byte >> 4 : byte & 15) *
                         e4m3_to_float(r.scale->data[size_t(o) * (in / 16) + k / 16]) * s2;
      EXPECT_EQ(deq[size_t(o) * in + k], want);
    }
  // input_scale is loaded and kept (not used on Hopper).
  ASSERT_NE(r.input_scale, nullptr);
  float is;
  std::memcpy(&is, r.input_scale->data, 4);
  EXPECT_GT(is, 0.0f);
}

TEST(Nvfp4, ModelOptConfigMayOnlyQuantiseExperts) {
  TempDir d;
  write_tiny_checkpoint(tiny_flash(), ExpertFormat::kNvfp4, 5, d.path());
  nlohmann::json q = nlohmann::json::parse(read_file(d / "hf_quant_config.json"));
  q["quantization"]["quantized_layers"]["layers.0.attn.wq_a"] = {{"quant_algo", "NVFP4"}};
  write_file(d / "hf_quant_config.json", q.dump());
  EXPECT_NE(error_of([&] { load_cpu_model(d.path()); }).find("only routed experts"),
            std::string::npos);
  // MXFP4 tensors where the config says NVFP4: a clear mismatch, not a silent reinterpretation.
  TempDir m;
  write_tiny_checkpoint(tiny_flash(), ExpertFormat::kMxfp4, 5, m.path());
  fs::copy_file(d / "config.json", m / "config.json", fs::copy_options::overwrite_existing);
  const std::string e = error_of([&] { load_cpu_model(m.path()); });
  EXPECT_NE(e.find("weight_scale"), std::string::npos) << e;
}

// ---- output files ----------------------------------------------------------------------

std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

TEST(OutputFiles, RefuseSpecialFilesDirectoriesAndLinks) {
  TempDir d;
  SafetensorsWriter w;
  w.add("a", DType::kF32, {1}, std::vector<float>{1.f});
  write_file(d / "target", "keep me");
  ASSERT_EQ(::mkfifo((d / "fifo").c_str(), 0644), 0);
  fs::create_symlink(d / "target", d / "link");
  fs::create_directory(d / "dir");
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string sock_path = d / "sock";
  ASSERT_LT(sock_path.size(), sizeof addr.sun_path);
  std::strcpy(addr.sun_path, sock_path.c_str());
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::vector<std::string> before = listing(d.path());
  const std::vector<std::pair<std::string, std::string>> cases = {
      {d / "fifo", "is a FIFO (named pipe)"},
      {d / "link", "is a symbolic link"},
      {d / "dir", "is a directory"},
      {d / "dir/", "names a directory"},
      {d / "sock", "is a socket"},
      {"/dev/null", "is a character device"},
      {"", "the output path is empty"},
      {d / "missing/x.safetensors", "directory " + d / "missing" + " does not exist"},
  };
  for (const auto& [path, expect] : cases) {
    const std::string e = error_of([&] { w.write(path); });
    EXPECT_NE(e.find(expect), std::string::npos) << path << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  ::close(sock);
  // Nothing was replaced and no temporary is left.
  EXPECT_EQ(listing(d.path()), before);
  EXPECT_TRUE(fs::is_fifo(d / "fifo"));
  EXPECT_TRUE(fs::is_symlink(d / "link"));
  EXPECT_EQ(read_file(d / "target"), "keep me");
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

TEST(OutputFiles, ReplaceRegularFilesKeepingTheirModeAndLeaveNoTemporary) {
  TempDir d;
  write_file(d / "out", "old");
  ASSERT_EQ(::chmod((d / "out").c_str(), 0640), 0);
  write_output_file(d / "out", "new bytes");
  EXPECT_EQ(read_file(d / "out"), "new bytes");
  struct stat st {};
  ASSERT_EQ(::stat((d / "out").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  write_output_file(d / "fresh", "x");  // a new path
  EXPECT_EQ(read_file(d / "fresh"), "x");
  EXPECT_EQ(listing(d.path()), (std::vector<std::string>{"fresh", "out"}));
  {
    OutputFile f(d / "abandoned");  // destroyed without commit: nothing stays
    f.write("partial", 7);
    EXPECT_EQ(listing(d.path()).size(), 3u);  // the temporary, hidden beside the target
  }
  EXPECT_EQ(listing(d.path()), (std::vector<std::string>{"fresh", "out"}));
  {
    OutputFile f(d / "late");  // the path became a directory before the rename
    f.write("x", 1);
    fs::create_directory(d / "late");
    EXPECT_NE(error_of([&] { f.commit(); }).find("is a directory"), std::string::npos);
  }
  EXPECT_EQ(listing(d.path()), (std::vector<std::string>{"fresh", "late", "out"}));
}

// ---- config bounds -----------------------------------------------------------------------

TEST(ConfigBounds, EveryDocumentedBoundIsEnforcedByTheParser) {
  const nlohmann::json j = nlohmann::json::parse(model_config_to_json(tiny_flash()));
  for (const ConfigBound& b : config_bounds()) {
    const std::string key = b.key;
    const bool nested = key.rfind("rope_scaling.", 0) == 0;
    const std::string field = nested ? key.substr(13) : key;
    const bool integral = j.contains(field) ? j[field].is_number_integer()
                          : nested          ? j["rope_scaling"][field].is_number_integer()
                                            : true;
    // Just outside each end of the range.
    std::vector<nlohmann::json> outside;
    if (integral) {
      outside = {int64_t(b.max) + 1, int64_t(b.min) - (b.min_exclusive ? 0 : 1)};
    } else {
      outside = {b.max * 2, b.min_exclusive ? b.min : b.min - 1};
    }
    for (const nlohmann::json& v : outside) {
      nlohmann::json k = j;
      (nested ? k["rope_scaling"][field] : k[field]) = v;
      const std::string e = error_of([&] { parse_model_config(k.dump(), "config.json"); });
      EXPECT_NE(e.find("config.json: field '" + key + "' = " + v.dump() + " is out of range " +
                       bound_text(b)),
                std::string::npos)
          << key << " = " << v.dump() << ": " << e;
    }
  }
}

TEST(ConfigBounds, IssueCasesAndWrapAround) {
  const nlohmann::json j = nlohmann::json::parse(model_config_to_json(tiny_flash()));
  auto with = [&](auto edit) {
    nlohmann::json k = j;
    edit(k);
    return error_of([&] { parse_model_config(k.dump(), "config.json"); });
  };
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      {[](auto& k) { k["hc_sinkhorn_iters"] = 2147483647; },
       "field 'hc_sinkhorn_iters' = 2147483647 is out of range [1, 1000]"},
      {[](auto& k) { k["sliding_window"] = 2147483647; },
       "field 'sliding_window' = 2147483647 is out of range [1, 1073741824]"},
      {[](auto& k) { k["sliding_window"] = 2e7; }, "field 'sliding_window' must be an integer"},
      {[](auto& k) { k["rms_norm_eps"] = -1; }, "field 'rms_norm_eps' = -1 is out of range (0, 1]"},
      {[](auto& k) { k["rms_norm_eps"] = 1e-50; }, "once rounded to float (0)"},
      {[](auto& k) { k["rope_scaling"]["factor"] = 0; },
       "field 'rope_scaling.factor' = 0 is out of range (0, 1000000]"},
      {[](auto& k) { k["compress_ratios"][1] = 4294967300ull; },
       "compress_ratios[1] = 4294967300 is not supported (0, 4 or 128)"},
      {[](auto& k) { k["compress_ratios"][1] = 18446744073709551615ull; },
       "compress_ratios[1] = 18446744073709551615 is not supported"},
      {[](auto& k) { k["compress_ratios"][1] = -124; },
       "compress_ratios[1] = -124 is not supported"},
      {[](auto& k) { k["compress_ratios"][1] = 4.0; }, "compress_ratios[1] = 4.0 is not supported"},
      {[](auto& k) { k["hidden_size"] = 4294967552ll; },
       "field 'hidden_size' = 4294967552 is out of range [128, 65536]"},
      {[](auto& k) { k["vocab_size"] = 18446744073709551615ull; },
       "field 'vocab_size' = 18446744073709551615 is out of range"},
      {[](auto& k) { k["max_position_embeddings"] = -1; },
       "field 'max_position_embeddings' = -1 is out of range"},
      {[](auto& k) { k["rope_theta"] = 1e39; }, "field 'rope_theta' = 1e+39 is out of range"},
      {[](auto& k) { k["num_hash_layers"] = 7; }, "num_hash_layers (7) exceeds num_hidden_layers"},
      {[](auto& k) { k["eos_token_id"] = 2048; }, "eos_token_id 2048 is not below vocab_size"},
      {[](auto& k) {
         k.erase("rope_scaling");
         k["rope_scaling"] = {{"type", "yarn"}};
       },
       "missing field 'rope_scaling.factor'"},
  };
  for (const auto& [edit, expect] : cases) {
    const std::string e = with(edit);
    EXPECT_NE(e.find(expect), std::string::npos) << expect << "\n  got: " << e;
  }
  // A key given twice (JSON parsers keep the last silently).
  std::string text = model_config_to_json(tiny_flash());
  text.insert(text.find('{') + 1, "\"sliding_window\": 4,");
  EXPECT_NE(error_of([&] {
              parse_model_config(text, "config.json");
            }).find("field 'sliding_window' is given twice"),
            std::string::npos);
  // A long bad value is quoted as an excerpt.
  const std::string e = with([](auto& k) { k["scoring_func"] = std::string(100000, 'z'); });
  EXPECT_NE(e.find("unsupported scoring_func 'zzzz"), std::string::npos) << e.substr(0, 300);
  EXPECT_LT(e.size(), 300u);
}

TEST(ConfigBounds, ReadmeDocumentsEveryBound) {
  const std::string readme = read_file(std::string(DSV4_SOURCE_DIR) + "/README.md");
  for (const ConfigBound& b : config_bounds()) {
    const std::string row = cat("| `", b.key, "` | ", bound_text(b), " |");
    EXPECT_NE(readme.find(row), std::string::npos) << "README.md lacks the row " << row;
  }
}

// ---- non-finite weights ------------------------------------------------------------------

TEST(WeightScan, FindsEveryNonFiniteValueOnAnyThreadCount) {
  // A BF16 tensor spanning several scan pieces, unaligned, with values in two pieces; F32, F16,
  // F64 and FP8 tensors; integer (and packed FP4) tensors are not scanned.
  const int64_t n = 5'000'000;
  std::vector<uint8_t> bytes(1 + 2 * n, 0);
  auto bf16_at = [&](int64_t i, uint16_t v) { std::memcpy(bytes.data() + 1 + 2 * i, &v, 2); };
  bf16_at(4'500'000, 0xff80);  // -inf
  bf16_at(100, 0x7fc1);        // NaN
  TensorView big{"big", DType::kBF16, {n / 1000, 1000}, bytes.data() + 1, size_t(2 * n)};
  const float f32[3] = {1.f, INFINITY, 2.f};
  TensorView t32{"f32", DType::kF32, {3}, reinterpret_cast<const uint8_t*>(f32), 12};
  const uint16_t f16[2] = {0x3c00, 0x7e00};  // 1, NaN
  TensorView t16{"f16", DType::kF16, {2}, reinterpret_cast<const uint8_t*>(f16), 4};
  const double f64[2] = {NAN, 0.0};
  TensorView t64{"f64", DType::kF64, {2}, reinterpret_cast<const uint8_t*>(f64), 16};
  const uint8_t e4m3[4] = {0x7e, 0x7f, 0xfe, 0xff};  // 448, NaN, -448, NaN
  TensorView t8{"e4m3", DType::kF8E4M3, {4}, e4m3, 4};
  const uint8_t e8m0[3] = {0x7f, 0xfe, 0xff};  // 1, 2^127, NaN
  TensorView s8{"e8m0", DType::kF8E8M0, {3}, e8m0, 3};
  const uint8_t packed[2] = {0xff, 0x77};  // e2m1 pairs: every code finite
  TensorView p4{"fp4", DType::kU8, {2}, packed, 2};
  const uint16_t fine[4] = {0x3f80, 0x0000, 0x8000, 0x7f7f};  // 1, 0, -0, the largest finite
  TensorView ok{"fine", DType::kBF16, {4}, reinterpret_cast<const uint8_t*>(fine), 8};
  const uint8_t fine8[3] = {0x7e, 0x00, 0x80};
  TensorView ok8{"fine8", DType::kF8E4M3, {3}, fine8, 3};
  for (int threads : {1, 2, 7}) {
    const WeightScan s = scan_weights({&ok, &p4, &ok8, &big, &t32, &t16, &t64, &t8, &s8}, threads);
    EXPECT_EQ(s.tensors, 8);
    EXPECT_EQ(s.non_finite, 8);
    EXPECT_EQ(s.bad_tensors, 6);
    ASSERT_EQ(s.first, &big);
    EXPECT_EQ(s.first_index, 100);
    EXPECT_TRUE(std::isnan(s.first_value));
    EXPECT_EQ(describe_non_finite(s),
              "tensor 'big' (BF16 [5000, 1000]) holds NaN at flat index 100 (element [0, 100]); 8 "
              "non-finite values in 6 tensors");
  }
  EXPECT_EQ(describe_non_finite(scan_weights({&t8}, 1)),
            "tensor 'e4m3' (F8_E4M3 [4]) holds NaN at flat index 1; 2 non-finite values in 1 "
            "tensor");
  EXPECT_EQ(
      describe_non_finite(scan_weights({&s8}, 1)),
      "tensor 'e8m0' (F8_E8M0 [3]) holds NaN at flat index 2; 1 non-finite value in 1 tensor");
  const WeightScan clean = scan_weights({&ok, &ok8, &p4}, 2);
  EXPECT_EQ(clean.first, nullptr);
  EXPECT_EQ(clean.non_finite, 0);
  const WeightScan inf = scan_weights({&t32}, 1);
  EXPECT_EQ(describe_non_finite(inf),
            "tensor 'f32' (F32 [3]) holds inf at flat index 1; 1 non-finite value in 1 tensor");
}

// Writes `bytes` over tensor `name` from element `index` on (elements of `size` bytes), in its
// shard, in place; returns the bytes that were there.
std::string poke(const std::string& dir, const std::string& name, int64_t index,
                 const std::string& bytes, size_t size) {
  const nlohmann::json idx =
      nlohmann::json::parse(read_file(dir + "/model.safetensors.index.json"));
  const std::string shard = dir + "/" + idx["weight_map"][name].get<std::string>();
  std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t hlen = 0;
  f.read(reinterpret_cast<char*>(&hlen), 8);
  std::string header(hlen, '\0');
  f.read(header.data(), std::streamsize(hlen));
  const nlohmann::json h = nlohmann::json::parse(header);
  const uint64_t at = 8 + hlen + h[name]["data_offsets"][0].get<uint64_t>() + index * size;
  std::string old(bytes.size(), '\0');
  f.seekg(std::streamoff(at));
  f.read(old.data(), std::streamsize(old.size()));
  f.seekp(std::streamoff(at));
  f.write(bytes.data(), std::streamsize(bytes.size()));
  return old;
}

template <typename T>
std::string bits_of(T v, int count = 1) {
  std::string s;
  for (int i = 0; i < count; ++i) s.append(reinterpret_cast<const char*>(&v), sizeof v);
  return s;
}

TEST_F(TinyCheckpoint, NonFiniteWeightsAreNamedAtLoad) {
  const uint16_t bf_nan = 0x7fc0, bf_inf = 0x7f80, bf_minus_inf = 0xff80;
  struct Case {
    std::string tensor;
    int64_t index;
    std::string bytes;
    size_t size;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"embed.weight", 3 * 256 + 7, bits_of(bf_nan), 2,
       "tensor 'embed.weight' (BF16 [2048, 256]) holds NaN at flat index 775 (element [3, 7]); 1 "
       "non-finite value in 1 tensor"},
      {"embed.weight", 17 * 256, bits_of(bf_nan, 256), 2,  // a whole embedding row
       "tensor 'embed.weight' (BF16 [2048, 256]) holds NaN at flat index 4352 (element [17, 0]); "
       "256 non-finite values in 1 tensor"},
      {"head.weight", 2047 * 256 + 255, bits_of(bf_inf), 2,
       "tensor 'head.weight' (BF16 [2048, 256]) holds inf at flat index 524287 (element [2047, "
       "255])"},
      {"norm.weight", 0, bits_of(bf_minus_inf), 2, "tensor 'norm.weight' (BF16 [256]) holds -inf"},
      {"layers.4.ffn_norm.weight", 9, bits_of(bf_nan), 2, "tensor 'layers.4.ffn_norm.weight'"},
      {"hc_head_base", 1, bits_of(NAN), 4,
       "tensor 'hc_head_base' (F32 [4]) holds NaN at flat index 1"},
      {"layers.2.attn.attn_sink", 3, bits_of(INFINITY), 4, "tensor 'layers.2.attn.attn_sink'"},
      // FP8 weights and UE8M0 scales: caught before any backend decodes or uploads them.
      {"layers.1.attn.wq_a.weight", 5, bits_of(uint8_t(0xff)), 1,
       "tensor 'layers.1.attn.wq_a.weight' (F8_E4M3 [128, 256]) holds NaN at flat index 5"},
      {"layers.0.ffn.shared_experts.w2.scale", 0, bits_of(uint8_t(0xff)), 1,
       "tensor 'layers.0.ffn.shared_experts.w2.scale' (F8_E8M0 [2, 1]) holds NaN"},
  };
  for (const Case& c : cases) {
    const std::string old = poke(dir_.path(), c.tensor, c.index, c.bytes, c.size);
    const std::string e = load_error();
    EXPECT_NE(e.find(dir_.path() + ": non-finite weight: " + c.expect), std::string::npos)
        << c.tensor << ": " << e;
    poke(dir_.path(), c.tensor, c.index, old, c.size);
  }
  EXPECT_EQ(load_error(), "");
}

}  // namespace
}  // namespace dsv4::test
