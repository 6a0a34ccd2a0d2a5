// The host's cores for CPU work whose items are independent (the reference ops at real shapes,
// weight quantisation, sampling a large batch).
#pragma once

#include <cstdint>
#include <functional>

namespace dsv4 {

// Threads parallel_for may use: std::thread::hardware_concurrency() (at least 1), or
// DSV4_CPU_THREADS when set to a positive number.
int cpu_threads();

// body(i) for every i in [0, n). Items are claimed one at a time by up to cpu_threads() threads
// (the caller among them) when `cost`, the whole call's work in rough multiply-adds, pays for
// them (about 2^20 per thread); on the calling thread otherwise, and always when called from
// inside another parallel_for (nested calls do not multiply threads). Each item must write only
// its own outputs, so the result is the same as one thread's. The first exception thrown by an
// item is rethrown here after every thread has stopped; items not yet claimed are skipped.
void parallel_for(int64_t n, int64_t cost, const std::function<void(int64_t)>& body);

}  // namespace dsv4
