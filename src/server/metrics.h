// /metrics: Prometheus text (exposition format 0.0.4) under vLLM's metric names, each labelled
// model_name: the engine's gauges and counters from its stats, the per-request latency
// histograms and finished-request counts the HTTP side records here.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "dsv4/engine.h"

namespace dsv4::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // name_bucket{le=...}, name_sum, name_count with `labels` (`key="value"` pairs).
  void render(std::string& out, const std::string& name, const std::string& labels) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();

  void time_to_first_token(double seconds);
  void inter_token_latency(double seconds);
  // A finished choice, by finished_reason ("stop", "length", "abort", "error").
  void finished(const std::string& reason);
  void e2e_request_latency(double seconds);

  std::string render(const EngineStats& stats, const std::string& model_name) const;

 private:
  mutable std::mutex mu_;
  Histogram ttft_, itl_, e2e_;
  std::array<uint64_t, 4> finished_{};  // stop, length, abort, error
};

// `s` as a Prometheus label value (backslash, quote and newline escaped).
std::string prometheus_label(const std::string& s);

}  // namespace dsv4::server
