// The dsv4 command line, run as users run it: outputs, file formats, and one-line errors with
// a non-zero exit (never a crash) for bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "io/safetensors.h"
#include "support/cli_run.h"
#include "support/temp_dir.h"

namespace dsv4::test {
namespace {

using Result = CliResult;

Result run(const std::string& args, const TempDir& tmp) {
  return run_cli(DSV4_CLI, args, tmp);
}

class Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir;
    const Result r =
        run("make-tiny --preset flash --format nvfp4 --seed 5 --out " + *tmp_ / "m", *tmp_);
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() { delete tmp_; }
  static std::string model() { return *tmp_ / "m"; }
  static TempDir* tmp_;
};
TempDir* Cli::tmp_ = nullptr;

TEST_F(Cli, GenerateIsDeterministicAndMatchesLogits) {
  const Result a =
      run("generate --model " + model() + " --prompt-ids 0,11,12,13 --max-new-tokens 5", *tmp_);
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_FALSE(a.out.empty());
  EXPECT_EQ(a.out.back(), '\n');
  EXPECT_EQ(std::count(a.out.begin(), a.out.end(), ','), 4) << a.out;  // 5 ids unless EOS
  EXPECT_EQ(
      run("generate --model " + model() + " --prompt-ids 0,11,12,13 --max-new-tokens 5", *tmp_).out,
      a.out);
  // The first greedy token is the argmax of the last prompt position's logits.
  const Result l =
      run("logits --model " + model() + " --prompt-ids 0,11,12,13 --out " + *tmp_ / "l.safetensors",
          *tmp_);
  ASSERT_EQ(l.code, 0) << l.err;
  SafetensorsFile f(*tmp_ / "l.safetensors");
  const TensorView& t = f.get("logits");
  ASSERT_EQ(t.dtype, DType::kF32);
  ASSERT_EQ(t.shape, (std::vector<int64_t>{4, 2048}));
  const float* last = t.as<float>() + 3 * 2048;
  const long first = std::max_element(last, last + 2048) - last;
  EXPECT_EQ(std::stol(a.out), first);
  // Sampling with a seed repeats; another seed is allowed to differ.
  const std::string s =
      "generate --model " + model() +
      " --prompt-ids 0,11 --max-new-tokens 8 --ignore-eos --temperature 1.5 --seed ";
  const Result s1 = run(s + "7", *tmp_), s2 = run(s + "7", *tmp_);
  EXPECT_EQ(s1.code, 0) << s1.err;
  EXPECT_EQ(s1.out, s2.out);
  EXPECT_EQ(std::count(s1.out.begin(), s1.out.end(), ','), 7);
  // Speculative decoding gives the same tokens, greedy or sampled, with either rollback.
  for (const std::string rollback : {" --speculative-rollback rerun", ""})
    for (const char* k : {"1", "3"}) {
      EXPECT_EQ(run(s + "7 --speculative-tokens " + k + rollback, *tmp_).out, s1.out)
          << k << rollback;
      EXPECT_EQ(run("generate --model " + model() +
                        " --prompt-ids 0,11,12,13 --max-new-tokens 5 --speculative-tokens " + k +
                        rollback,
                    *tmp_)
                    .out,
                a.out)
          << k << rollback;
    }
  EXPECT_EQ(run("generate --model " + model() + " --prompt-ids 0 --max-new-tokens 0", *tmp_).out,
            "\n");
}

TEST_F(Cli, LogitsChunkingAndPromptFileGiveIdenticalBytes) {
  std::ofstream(*tmp_ / "prompt.txt") << "0\n5\n 6\n7\n\n8\n9\n10\n";
  const std::string base = "logits --model " + model() + " --prompt-ids 0,5,6,7,8,9,10 --out ";
  ASSERT_EQ(run(base + *tmp_ / "a.safetensors", *tmp_).code, 0);
  ASSERT_EQ(run(base + *tmp_ / "b.safetensors --prefill-chunk 1", *tmp_).code, 0);
  ASSERT_EQ(run(base + *tmp_ / "c.safetensors --prefill-chunk 3", *tmp_).code, 0);
  ASSERT_EQ(run("logits --model " + model() + " --prompt-file " + *tmp_ / "prompt.txt --out " +
                    *tmp_ / "d.safetensors",
                *tmp_)
                .code,
            0);
  auto bytes = [&](const std::string& n) {
    std::ifstream is(*tmp_ / n, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(is), {});
  };
  EXPECT_EQ(bytes("a.safetensors"), bytes("b.safetensors"));
  EXPECT_EQ(bytes("a.safetensors"), bytes("c.safetensors"));
  EXPECT_EQ(bytes("a.safetensors"), bytes("d.safetensors"));
}

// --random-weights: the fixture's make-tiny checkpoint generated in memory (same preset,
// format and seed): the same logits and tokens, bit for bit, on one rank and on several.
TEST_F(Cli, RandomWeightsRunAsTheMakeTinyCheckpoint) {
  const std::string prompt = " --prompt-ids 0,5,6,7,8,9 ";
  const std::string random = " --random-weights flash --format nvfp4 --weights-seed 5";
  auto bytes = [&](const std::string& n) {
    std::ifstream is(*tmp_ / n, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(is), {});
  };
  for (const std::string par : {"", " --dp 2 --ep 2"}) {
    const Result a =
        run("logits --model " + model() + prompt + par + " --out " + *tmp_ / "rw-a.st", *tmp_);
    ASSERT_EQ(a.code, 0) << a.err;
    const Result b = run("logits" + random + prompt + par + " --out " + *tmp_ / "rw-b.st", *tmp_);
    ASSERT_EQ(b.code, 0) << b.err;
    EXPECT_EQ(bytes("rw-a.st"), bytes("rw-b.st")) << par;
    EXPECT_FALSE(bytes("rw-a.st").empty());
  }
  const Result g = run("generate --model " + model() + prompt + "--max-new-tokens 4", *tmp_);
  ASSERT_EQ(g.code, 0) << g.err;
  EXPECT_EQ(run("generate" + random + prompt + "--max-new-tokens 4", *tmp_).out, g.out);
  // Another seed, other weights.
  ASSERT_EQ(run("logits --random-weights flash --format nvfp4 --weights-seed 6" + prompt +
                    "--out " + *tmp_ / "rw-c.st",
                *tmp_)
                .code,
            0);
  EXPECT_NE(bytes("rw-a.st"), bytes("rw-c.st"));
  // plan: the host bytes the generated weights take, one expert per layer with repeats.
  const Result p = run("plan" + random + " --repeat-experts", *tmp_);
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_NE(p.out.find("random weights (flash, nvfp4, seed 5, repeated experts)"),
            std::string::npos)
      << p.out;
  EXPECT_NE(p.out.find("random host"), std::string::npos) << p.out;
}

TEST_F(Cli, BadInputIsAOneLineErrorAndNonZeroExit) {
  const std::string m = " --model " + model();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"generate" + m + " --prompt-ids 0,1 --bogus 3", "unknown flag '--bogus'"},
      {"generate" + m + " --prompt-ids 0,2048", "token id 2048 out of range [0, 2048)"},
      {"generate" + m + " --prompt-ids ''", "--prompt-ids is empty"},
      {"generate" + m + " --prompt-ids 0,,1", "id 2 is empty (two commas in a row?)"},
      {"generate" + m + " --prompt-ids 0,-1", "token id '-1' is negative"},
      {"generate --model /nonexistent/dir --prompt-ids 0", "does not exist"},
      {"generate" + m,
       "no prompt: give exactly one of --prompt-ids, --prompt-file, --prompt and --messages"},
      {"generate" + m + " --prompt-ids 0 --temperature -1", "--temperature"},
      {"generate" + m + " --prompt-ids 0 --max-new-tokens x", "not an integer"},
      {"generate" + m + " --prompt-ids 0 --backend tpu",
       "--backend: 'tpu' is not one of cpu, cuda"},
      {"generate" + m + " --prompt-ids 0 --backend cuda", "CUDA"},
      {"generate" + m + " --prompt-ids 0 --speculative-tokens 4", "--speculative-tokens"},
      {"generate" + m + " --prompt-ids 0 --speculative-tokens 2 --dp 2",
       "does not implement speculative decoding"},
      {"generate" + m + " --prompt-ids 0 --speculative-rollback restore",
       "--speculative-rollback applies with --speculative-tokens above 0"},
      {"generate" + m + " --prompt-ids 0 --speculative-tokens 1 --speculative-rollback redo",
       "--speculative-rollback: 'redo' is not one of rerun, restore"},
      {"logits" + m + " --prompt-ids 0", "missing required flag --out"},
      {"logits" + m + " --prompt-ids 0 --prompt-file x --out y",
       "several prompts: give exactly one of"},
      {"logits" + m + " --prompt-file /nonexistent --out y", "cannot open"},
      {"logits" + m + " --prompt-ids 0 --prefill-chunk -2 --out y", "--prefill-chunk"},
      {"make-tiny --preset huge --out x", "--preset: 'huge' is not one of flash, pro"},
      {"make-tiny --preset flash --format int3 --out x",
       "--format: 'int3' is not one of mxfp4, nvfp4"},
      {"frobnicate", "unknown command"},
  };
  for (const auto& [args, expect] : cases) {
    const Result r = run(args, *tmp_);
    EXPECT_GT(r.code, 0) << args << " (negative = killed by a signal)";
    EXPECT_NE(r.err.find(expect), std::string::npos) << args << "\n  stderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << "\n  stderr: " << r.err;
    EXPECT_TRUE(r.out.empty()) << args;
  }
}

// The parallel engine from the command line: the logits file of every layout is byte for byte
// the one-rank file (CPU backend, ranks as threads).
TEST_F(Cli, ParallelLogitsEqualOneRank) {
  auto bytes = [&](const std::string& n) {
    std::ifstream is(*tmp_ / n, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(is), {});
  };
  const std::string base =
      "logits --model " + model() + " --prompt-ids 0,5,6,7,8,9,10,11,12 --prefill-chunk 4 --out ";
  ASSERT_EQ(run(base + *tmp_ / "one.safetensors", *tmp_).code, 0);
  for (const char* layout : {"--dp 2 --ep 2", "--ep 4", "--tp 2", "--dp 2 --ep 2 --tp 2"}) {
    const Result r = run(base + *tmp_ / "par.safetensors " + layout, *tmp_);
    ASSERT_EQ(r.code, 0) << layout << ": " << r.err;
    EXPECT_EQ(bytes("par.safetensors"), bytes("one.safetensors")) << layout;
  }
  const Result bad = run(base + *tmp_ / "x.safetensors --ep 3", *tmp_);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("--ep 3 does not divide"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace dsv4::test
