// Per-kernel GPU times of an eager region through CUPTI's activity API (kernels, memcpys and
// memsets with their device start/end timestamps), each attributed to the decoder block that
// launched it: CudaModel::forward records one of its block events before the embedding and
// after every block and the head (block timing on), so the launch calls between the (i)th and
// (i+1)th record of THOSE events belong to block i (block 0 includes the embedding; index
// n_layers is the head). Only the marker events count: the forward makes other cudaEventRecord
// calls (the first H200 run's attribution points at cuBLAS, inside its split-K GEMMs), and
// taking every record as a block boundary cut each CSA layer into three "blocks" and pushed the
// last half of the forward outside the blocks. The marker records are told apart through CUPTI's
// callback API (the recorded event handle, see set_markers), their host times come from the
// activity API's runtime records. CUPTI's launch-API records (runtime and driver, for cuBLAS)
// give each kernel's launch time through its correlation id.
//
// Without CUPTI at build time (DSV4_HAVE_CUPTI undefined) or when CUPTI refuses at run time
// (some sandboxes, or another CUPTI client such as Nsight holding the callback subscription),
// available() is false and the benchmark leaves the per-kernel rows out, saying so.
#pragma once

#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#if defined(DSV4_HAVE_CUPTI)
#include <cupti.h>  // with the runtime API parameter structs (cudaEventRecord_v3020_params)
#endif

namespace dsv4::bench {

struct TracedOp {
  std::string name;       // demangled, without namespaces, parameters or template arguments
  std::string full;       // without parameters and namespaces (template arguments kept, shortened)
  std::string demangled;  // the whole demangled name (op classes look into template arguments)
  uint64_t start = 0, end = 0;  // device ns
  uint64_t launch = 0;          // host ns of the launch call (0: unknown)
  int block = -1;      // -1: before the first marker of the region; kNoLaunch: launch unknown
  bool kernel = true;  // false: memcpy / memset
  double excl_us = 0;  // end - max(start, every earlier op's end), >= 0
  // Where it ran and who launched it (several GPUs or ranks in one process): CUPTI's device and
  // stream ids, and the id of the host thread whose launch call (kernel, copy or graph launch)
  // it belongs to (0: unknown).
  uint32_t device = 0, stream = 0, thread = 0;
};

// TracedOp::block of an op whose launch call CUPTI did not report.
constexpr int kNoLaunch = -2;

// What end() found besides the ops: how many marker records delimit the blocks, how many other
// cudaEventRecord calls the region made (ignored), how many ops have no launch record.
struct TraceStats {
  int markers = 0;
  int foreign_event_records = 0;
  int ops_no_launch = 0;
};

namespace trace_detail {

inline std::string demangle(const char* mangled) {
  if (!mangled) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : mangled;
  std::free(d);
  return s;
}

// "void dsv4::cuda::moe::moe_gemm_kernel<(Fmt)1, 8>(Args)" -> full "moe_gemm_kernel<(Fmt)1, 8>",
// base "moe_gemm_kernel". "(anonymous namespace)::" is dropped first: its '(' would otherwise
// be taken for the parameter list and leave every kernel of an anonymous namespace nameless.
// A full name cut to fit keeps a hash of the whole so that two long names stay two.
inline void short_names(const std::string& d, std::string& base, std::string& full) {
  std::string s = d;
  static const std::string kAnon = "(anonymous namespace)::";
  for (size_t at; (at = s.find(kAnon)) != std::string::npos;) s.erase(at, kAnon.size());
  // Parameter list: the first '(' outside template arguments.
  int depth = 0;
  size_t cut = std::string::npos;
  for (size_t i = 0; i < s.size(); ++i) {
    const char ch = s[i];
    if (ch == '<') ++depth;
    if (ch == '>') --depth;
    if (ch == '(' && depth == 0) {
      cut = i;
      break;
    }
  }
  if (cut != std::string::npos) s = s.substr(0, cut);
  if (s.rfind("void ", 0) == 0) s = s.substr(5);
  // Namespaces before the name (outside template arguments).
  depth = 0;
  size_t start = 0;
  for (size_t i = 0; i + 1 < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (depth == 0 && s[i] == ':' && s[i + 1] == ':') start = i + 2;
  }
  full = start < s.size() ? s.substr(start) : d;  // never empty
  const size_t lt = full.find('<');
  base = lt == std::string::npos ? full : full.substr(0, lt);
  if (full.size() > 90) {
    const size_t h = std::hash<std::string>{}(d);
    char tag[16];
    std::snprintf(tag, sizeof tag, "...#%04x", unsigned(h % 0x10000u));
    full = full.substr(0, 80) + tag;
  }
}

struct EventRecordCall {
  uint32_t corr = 0;
  uint64_t start = 0;  // host ns
};

struct State {
  std::mutex mu;
  bool recording = false;
  std::vector<TracedOp> ops;
  std::vector<uint32_t> op_corr;
  std::map<uint32_t, uint64_t> launch_ns;      // correlation id -> API start
  std::map<uint32_t, uint32_t> launch_thread;  // correlation id -> the API call's thread
  std::vector<EventRecordCall> event_records;  // every cudaEventRecord call (activity API)
  std::set<cudaEvent_t> markers;               // the block events (set_markers)
  std::set<uint32_t> marker_corr;              // correlation ids of their records (callback API)
};
inline State& state() {
  static State s;
  return s;
}

#if defined(DSV4_HAVE_CUPTI)
// A copy or fill on the device: an op of the trace that is not a kernel.
inline void add_copy(State& st, const char* what, uint64_t start, uint64_t end, uint32_t corr,
                     uint32_t device, uint32_t stream) {
  TracedOp op;
  op.name = op.full = op.demangled = what;
  op.start = start;
  op.end = end;
  op.kernel = false;
  op.device = device;
  op.stream = stream;
  st.ops.push_back(op);
  st.op_corr.push_back(corr);
}

inline void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(16) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

inline void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        TracedOp op;
        op.demangled = demangle(k->name);
        short_names(op.demangled, op.name, op.full);
        op.start = k->start;
        op.end = k->end;
        op.device = k->deviceId;
        op.stream = k->streamId;
        st.ops.push_back(op);
        st.op_corr.push_back(k->correlationId);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        add_copy(st, "memcpy", m->start, m->end, m->correlationId, m->deviceId, m->streamId);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        add_copy(st, "memset", m->start, m->end, m->correlationId, m->deviceId, m->streamId);
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        st.launch_ns[a->correlationId] = a->start;
        st.launch_thread[a->correlationId] = a->threadId;
        if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME &&
            (a->cbid == CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_v3020 ||
             a->cbid == CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_ptsz_v7000 ||
             a->cbid == CUPTI_RUNTIME_TRACE_CBID_cudaEventRecordWithFlags_v11010 ||
             a->cbid == CUPTI_RUNTIME_TRACE_CBID_cudaEventRecordWithFlags_ptsz_v11010))
          st.event_records.push_back({a->correlationId, a->start});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

constexpr CUpti_CallbackId kEventRecordCbids[] = {
    CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_ptsz_v7000,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventRecordWithFlags_v11010,
    CUPTI_RUNTIME_TRACE_CBID_cudaEventRecordWithFlags_ptsz_v11010};

// Callback API, on entry to cudaEventRecord*: the correlation id of each record of a marker
// event (the activity record of the same call carries the same id and the host time).
inline void CUPTIAPI event_record_callback(void*, CUpti_CallbackDomain domain,
                                           CUpti_CallbackId cbid, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API) return;
  const auto* cb = static_cast<const CUpti_CallbackData*>(data);
  if (cb->callbackSite != CUPTI_API_ENTER || !cb->functionParams) return;
  cudaEvent_t event = nullptr;
  switch (cbid) {
    case CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_v3020:
      event = static_cast<const cudaEventRecord_v3020_params*>(cb->functionParams)->event;
      break;
    case CUPTI_RUNTIME_TRACE_CBID_cudaEventRecord_ptsz_v7000:
      event = static_cast<const cudaEventRecord_ptsz_v7000_params*>(cb->functionParams)->event;
      break;
    case CUPTI_RUNTIME_TRACE_CBID_cudaEventRecordWithFlags_v11010:
      event = static_cast<const cudaEventRecordWithFlags_v11010_params*>(cb->functionParams)->event;
      break;
    case CUPTI_RUNTIME_TRACE_CBID_cudaEventRecordWithFlags_ptsz_v11010:
      event = static_cast<const cudaEventRecordWithFlags_ptsz_v11010_params*>(cb->functionParams)
                  ->event;
      break;
    default:
      return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.recording && st.markers.count(event)) st.marker_corr.insert(cb->correlationId);
}

inline bool cupti_ok(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return true;
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  std::fprintf(stderr, "kernel trace: %s failed (%s): per-kernel rows left out\n", what,
               s ? s : "?");
  return false;
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                         CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                         CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};
#endif

}  // namespace trace_detail

class KernelTrace {
 public:
  // Registers CUPTI's buffers once; false (with a message) when CUPTI is absent or refuses.
  static bool available() {
#if defined(DSV4_HAVE_CUPTI)
    static const bool ok = [] {
      if (!trace_detail::cupti_ok(cuptiActivityRegisterCallbacks(trace_detail::buffer_requested,
                                                                 trace_detail::buffer_completed),
                                  "cuptiActivityRegisterCallbacks"))
        return false;
      // The marker events' records are told from others' by the event handle (callback API).
      static CUpti_SubscriberHandle sub = nullptr;
      if (!trace_detail::cupti_ok(
              cuptiSubscribe(&sub, trace_detail::event_record_callback, nullptr), "cuptiSubscribe"))
        return false;
      for (CUpti_CallbackId id : trace_detail::kEventRecordCbids)
        if (!trace_detail::cupti_ok(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, id),
                                    "cuptiEnableCallback"))
          return false;
      return true;
    }();
    return ok;
#else
    static bool said = false;
    if (!said)
      std::fprintf(stderr, "kernel trace: built without CUPTI: per-kernel rows left out\n");
    said = true;
    return false;
#endif
  }

  // The events whose records delimit the blocks (CudaModel::block_events()); records of any
  // other event are ignored (counted in TraceStats::foreign_event_records).
  void set_markers(const std::vector<cudaEvent_t>& events) {
    trace_detail::State& st = trace_detail::state();
    std::lock_guard<std::mutex> lock(st.mu);
    st.markers = std::set<cudaEvent_t>(events.begin(), events.end());
  }

  // Starts recording (the caller has synchronised the device). False: not recording.
  bool begin() {
    if (!available()) return false;
#if defined(DSV4_HAVE_CUPTI)
    trace_detail::State& st = trace_detail::state();
    {
      std::lock_guard<std::mutex> lock(st.mu);
      st.ops.clear();
      st.op_corr.clear();
      st.launch_ns.clear();
      st.launch_thread.clear();
      st.event_records.clear();
      st.marker_corr.clear();
      st.recording = true;
    }
    stats_ = TraceStats{};
    for (CUpti_ActivityKind k : trace_detail::kKinds)
      if (!trace_detail::cupti_ok(cuptiActivityEnable(k), "cuptiActivityEnable")) {
        for (CUpti_ActivityKind j : trace_detail::kKinds) cuptiActivityDisable(j);
        std::lock_guard<std::mutex> lock(st.mu);
        st.recording = false;
        return false;
      }
    on_ = true;
    return true;
#else
    return false;
#endif
  }

  // Stops recording (the caller has synchronised the device) and returns the region's ops in
  // device start order, each with its block and exclusive time; stats() says what was found.
  std::vector<TracedOp> end() {
    std::vector<TracedOp> ops;
#if defined(DSV4_HAVE_CUPTI)
    if (!on_) return ops;
    on_ = false;
    for (CUpti_ActivityKind k : trace_detail::kKinds) cuptiActivityDisable(k);
    cuptiActivityFlushAll(1);
    trace_detail::State& st = trace_detail::state();
    std::lock_guard<std::mutex> lock(st.mu);
    st.recording = false;
    std::vector<uint64_t> marks;
    for (const trace_detail::EventRecordCall& r : st.event_records) {
      if (st.marker_corr.count(r.corr))
        marks.push_back(r.start);
      else
        ++stats_.foreign_event_records;
    }
    std::sort(marks.begin(), marks.end());
    stats_.markers = int(marks.size());
    for (size_t i = 0; i < st.ops.size(); ++i) {
      TracedOp op = st.ops[i];
      const auto it = st.launch_ns.find(st.op_corr[i]);
      if (it != st.launch_ns.end()) {
        op.launch = it->second;
        op.thread = st.launch_thread[st.op_corr[i]];
        const int before =
            int(std::lower_bound(marks.begin(), marks.end(), op.launch) - marks.begin());
        op.block = before - 1;
      } else {
        op.block = kNoLaunch;
        ++stats_.ops_no_launch;
      }
      ops.push_back(op);
    }
    std::sort(ops.begin(), ops.end(),
              [](const TracedOp& a, const TracedOp& b) { return a.start < b.start; });
    uint64_t busy_until = 0;
    for (TracedOp& op : ops) {
      const uint64_t from = std::max(op.start, busy_until);
      op.excl_us = op.end > from ? double(op.end - from) / 1000.0 : 0.0;
      busy_until = std::max(busy_until, op.end);
    }
#endif
    return ops;
  }
  const TraceStats& stats() const {
    return stats_;
  }

 private:
  bool on_ = false;
  TraceStats stats_;
};

}  // namespace dsv4::bench
