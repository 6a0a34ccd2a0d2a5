// Which choices run in the next step, and how many tokens each brings: continuous batching
// with chunked prefill mixed into decode steps under a per-step token budget, admission by
// cache capacity, and preemption by recompute when the pages run out.
//
// Each step, in this order:
//  1. every running choice that is decoding brings its one token (decodes never wait behind a
//     long prefill);
//  2. running choices still prefilling bring the next chunk of their prompt, FCFS, while the
//     budget lasts;
//  3. waiting choices are admitted FCFS (the queue never reorders: a request that does not fit
//     blocks the ones behind it) while max_running, the budget, the state slots and the pages
//     allow. A choice is admitted only when the pages its whole prefill and first decode need
//     are free after what the running prefills will still take, so admission never
//     over-commits the cache.
// With the prefix cache (block B), an admitted choice resumes from the longest cached prefix
// of its tokens (all but the last, which must run to give logits). Snapshot points are every
// multiple of 4 B and the last multiple of B before the choice's target: prefill chunks end at
// the first one they would cross, and each is snapshotted after its step (decode too, at the
// multiples of 4 B), so a resend finds all but less than B of its prompt and a shared prefix
// all but less than 4 B. Snapshots are evicted (LRU) before any running choice is preempted.
//
// A running choice whose next tokens find no pages (decode growth is not reserved ahead)
// preempts the latest-arrived running choice, repeatedly, itself last: the victim's sequence
// is closed (its pages freed) and it waits again at the front (its arrival is earlier than any
// newcomer's), to recompute prompt + output so far when readmitted. Its output is unchanged:
// the draw of output token i depends on (seed, i) alone, and on the CPU backend chunking does
// not change a bit.
#pragma once

#include <cstdint>
#include <vector>

#include "model/runner.h"
#include "runtime/request.h"

namespace dsv4 {

// Limits per data-parallel rank (each rank runs its own batch, in its own caches).
struct SchedulerOptions {
  int max_running = 1;        // choices holding sequences at once
  int max_step_tokens = 512;  // tokens per step over all inputs
  int max_step_seqs = 1 << 30;
  int max_logit_rows = 1 << 30;  // logits rows (wanted or sampled) per step
};

// One choice's work in a step: tokens [start, start + n) of prompt ++ output.
struct ScheduledChunk {
  Request* request = nullptr;
  Choice* choice = nullptr;
  int64_t start = 0;
  int n = 0;
  bool sample = false;    // the chunk ends at the last known token: sample the next one
  bool snapshot = false;  // the chunk ends at a prefix-cache snapshot point
  int64_t rows = 0;       // logits rows it takes
  int64_t pages[kNumPageKinds] = {0, 0, 0};  // pages it takes from the pool
  int drafts = 0;  // speculative decoding: the last `drafts` of the n tokens are the choice's
                   // drafts (a decode's token and the drafts to verify after it)
};

class PrefixCache;

// With data parallelism (Runner::dp_size() > 1) every rank has its own budget, cache and
// prefix cache; a newly admitted choice goes to the rank with the longest prefix hit, then
// the fewest tokens held or to hold (its running choices' targets); a rank preempts only its
// own choices; forks stay on their rank.
class Scheduler {
 public:
  // `prefix`: one per data-parallel rank, or empty (no prefix cache).
  Scheduler(Runner& runner, const SchedulerOptions& options, std::vector<PrefixCache*> prefix = {});

  // Queues a new request (all its choices wait).
  void add(Request* r);
  // Drops every choice of the request from the queues, closing their sequences.
  void remove(Request* r);
  // Closes a finished choice's sequence and drops it from the running set.
  void finish(Request* r, Choice* c);
  // After a step: forks the choices of an n > 1 request whose shared prefill completed.
  void after_step(Request* r);
  // After a step: snapshots the chunk's end into the prefix cache when it is a block
  // boundary not cached yet.
  void snapshot(const ScheduledChunk& ch);

  // The next step's work. Admits and preempts as it goes.
  std::vector<ScheduledChunk> schedule();

  int running() const { return int(running_.size()); }
  int waiting() const;
  // After a schedule() that planned nothing: the request at the head of the queue when nothing
  // runs, i.e. one the cache cannot hold even empty (the loop fails it); else null.
  Request* blocked() const;
  int64_t preemptions() const { return preemptions_; }
  int64_t prefix_queries() const { return prefix_queries_; }
  int64_t prefix_hits() const { return prefix_hits_; }

  // The tokens a choice needs in the cache before it samples next: prompt + output, or, for
  // choice 0 of an n > 1 request before its fork, the prompt but its last token.
  static int64_t target(const Request& r, const Choice& c);

 private:
  struct Entry {
    Request* request;
    int choice;
    Choice& c() const { return request->choices[size_t(choice)]; }
    bool operator<(const Entry& o) const {
      return request->arrival != o.request->arrival ? request->arrival < o.request->arrival
                                                    : choice < o.choice;
    }
  };
  int64_t computed(const Choice& c) const;
  // Pages of kind k a new sequence of `tokens` tokens holds.
  int64_t pages_for(PageKind k, int64_t tokens) const;
  struct Budget;  // one step's room per rank
  bool try_admit(const Entry& e, Budget& b);
  // Admission on rank g: fits (evicting snapshots as needed) and opens the sequence.
  bool admit_on(const Entry& e, int g, int64_t t, const std::vector<int32_t>& toks);
  void preempt(const Entry& e);
  void drop_running(const Entry& e);
  int rank_of(const Entry& e) const { return runner_.dp_rank(e.c().seq); }
  int running_on(int g) const;
  int64_t load_on(int g) const;
  PrefixCache* prefix(int g) const { return prefix_.empty() ? nullptr : prefix_[size_t(g)]; }

  // Prompt ++ output of a choice, the first n tokens.
  static std::vector<int32_t> tokens_of(const Request& r, const Choice& c, int64_t n);

  Runner& runner_;
  SchedulerOptions opt_;
  std::vector<PrefixCache*> prefix_;
  int64_t prefix_queries_ = 0, prefix_hits_ = 0;
  std::vector<Entry> waiting_;  // sorted by (arrival, choice)
  std::vector<Entry> running_;  // sorted by (arrival, choice)
  int64_t preemptions_ = 0;
};

}  // namespace dsv4
