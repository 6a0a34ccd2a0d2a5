// Checkpoint loading: safetensors header validation, sharded checkpoints, config.json,
// ModelOpt quantisation configs, and the weight inventory check. Every failure names the
// file and the tensor or field.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backends/cpu/loader.h"
#include "core/error.h"
#include "core/formats.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/tiny_checkpoint.h"
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
  };
  for (const auto& c : cases) {
    write_raw(p, c.header, c.data);
    const std::string e = error_of([&] { SafetensorsFile f(p); });
    EXPECT_NE(e.find(c.expect), std::string::npos) << "got: " << e;
    EXPECT_NE(e.find(p), std::string::npos) << "error must name the file: " << e;
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

}  // namespace
}  // namespace dsv4::test
