#include "server/metrics.h"

#include <cmath>
#include <cstdio>

namespace dsv4::server {
namespace {

constexpr const char* kReasons[4] = {"stop", "length", "abort", "error"};

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += "# HELP ";
  out += name;
  out += ' ';
  out += help;
  out += "\n# TYPE ";
  out += name;
  out += ' ';
  out += type;
  out += '\n';
}

void sample(std::string& out, const std::string& name, const std::string& labels, double v) {
  out += name + "{" + labels + "} " + number(v) + "\n";
}

}  // namespace

std::string prometheus_label(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    const std::string le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
    sample(out, name + "_bucket", "le=\"" + le + "\"," + labels, double(cumulative));
  }
  sample(out, name + "_sum", labels, sum_);
  sample(out, name + "_count", labels, double(count_));
}

// vLLM's buckets.
ServerMetrics::ServerMetrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
             1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}),
      itl_({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0}),
      e2e_({0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
            30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}) {}

void ServerMetrics::time_to_first_token(double s) {
  std::lock_guard<std::mutex> l(mu_);
  ttft_.observe(s);
}

void ServerMetrics::inter_token_latency(double s) {
  std::lock_guard<std::mutex> l(mu_);
  itl_.observe(s);
}

void ServerMetrics::finished(const std::string& reason) {
  std::lock_guard<std::mutex> l(mu_);
  for (size_t i = 0; i < 4; ++i)
    if (reason == kReasons[i]) ++finished_[i];
}

void ServerMetrics::e2e_request_latency(double s) {
  std::lock_guard<std::mutex> l(mu_);
  e2e_.observe(s);
}

std::string ServerMetrics::render(const EngineStats& s, const std::string& model_name) const {
  const std::string m = "model_name=\"" + prometheus_label(model_name) + "\"";
  std::string out;
  header(out, "vllm:num_requests_running", "gauge",
         "Number of requests in model execution batches.");
  sample(out, "vllm:num_requests_running", m, s.running);
  header(out, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.");
  sample(out, "vllm:num_requests_waiting", m, s.waiting);
  header(out, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.");
  sample(out, "vllm:kv_cache_usage_perc", m, s.cache_usage);
  header(out, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.");
  sample(out, "vllm:prompt_tokens_total", m, double(s.prompt_tokens));
  header(out, "vllm:generation_tokens_total", "counter", "Number of generation tokens processed.");
  sample(out, "vllm:generation_tokens_total", m, double(s.generation_tokens));
  header(out, "vllm:prefix_cache_queries_total", "counter",
         "Prefix cache queries, in terms of number of queried tokens.");
  sample(out, "vllm:prefix_cache_queries_total", m, double(s.prefix_queries));
  header(out, "vllm:prefix_cache_hits_total", "counter",
         "Prefix cache hits, in terms of number of cached tokens.");
  sample(out, "vllm:prefix_cache_hits_total", m, double(s.prefix_hits));
  header(out, "vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.");
  sample(out, "vllm:num_preemptions_total", m, double(s.preemptions));
  // Speculative decoding, as vLLM names its counters (only when the engine speculates).
  if (!s.spec_accepted_per_pos.empty()) {
    header(out, "vllm:spec_decode_num_drafts_total", "counter",
           "Number of spec decoding drafts (verify steps).");
    sample(out, "vllm:spec_decode_num_drafts_total", m, double(s.spec_drafts));
    header(out, "vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.");
    sample(out, "vllm:spec_decode_num_draft_tokens_total", m, double(s.spec_draft_tokens));
    header(out, "vllm:spec_decode_num_accepted_tokens_total", "counter",
           "Number of accepted tokens.");
    sample(out, "vllm:spec_decode_num_accepted_tokens_total", m, double(s.spec_accepted_tokens));
    header(out, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Accepted tokens per draft position.");
    for (size_t p = 0; p < s.spec_accepted_per_pos.size(); ++p)
      sample(out, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
             "position=\"" + std::to_string(p) + "\"," + m, double(s.spec_accepted_per_pos[p]));
  }
  std::lock_guard<std::mutex> l(mu_);
  header(out, "vllm:request_success_total", "counter", "Count of finished requests.");
  for (size_t i = 0; i < 4; ++i)
    sample(out, "vllm:request_success_total",
           std::string("finished_reason=\"") + kReasons[i] + "\"," + m, double(finished_[i]));
  header(out, "vllm:time_to_first_token_seconds", "histogram",
         "Histogram of time to first token in seconds.");
  ttft_.render(out, "vllm:time_to_first_token_seconds", m);
  header(out, "vllm:inter_token_latency_seconds", "histogram",
         "Histogram of inter-token latency in seconds.");
  itl_.render(out, "vllm:inter_token_latency_seconds", m);
  header(out, "vllm:e2e_request_latency_seconds", "histogram",
         "Histogram of end to end request latency in seconds.");
  e2e_.render(out, "vllm:e2e_request_latency_seconds", m);
  return out;
}

}  // namespace dsv4::server
