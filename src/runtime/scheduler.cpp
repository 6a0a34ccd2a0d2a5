#include "runtime/scheduler.h"

#include <algorithm>

#include "core/error.h"
#include "runtime/prefix_cache.h"

namespace dsv4 {

Scheduler::Scheduler(Runner& runner, const SchedulerOptions& options, PrefixCache* prefix)
    : runner_(runner), opt_(options), prefix_(prefix && prefix->enabled() ? prefix : nullptr) {
  DSV4_CHECK(opt_.max_running > 0 && opt_.max_step_tokens > 0 && opt_.max_step_seqs > 0 &&
                 opt_.max_logit_rows > 0,
             "scheduler limits must be positive");
}

int64_t Scheduler::target(const Request& r, const Choice& c) {
  if (r.choices.size() > 1 && !r.forked) return c.index == 0 ? r.prompt_len() - 1 : 0;
  return r.prompt_len() + int64_t(c.output.size());
}

int64_t Scheduler::computed(const Choice& c) const {
  return c.seq >= 0 ? runner_.length(c.seq) : 0;
}

int64_t Scheduler::pages_for(PageKind k, int64_t tokens) const {
  const int64_t ps = runner_.page_size();
  return (runner_.cache_spec().entries(k, tokens) + ps - 1) / ps;
}

int Scheduler::waiting() const {
  int n = 0;
  const Request* last = nullptr;
  for (const Entry& e : waiting_)
    if (e.request != last) ++n, last = e.request;
  return n;
}

Request* Scheduler::blocked() const {
  return running_.empty() && !waiting_.empty() ? waiting_.front().request : nullptr;
}

void Scheduler::add(Request* r) {
  for (Choice& c : r->choices) {
    // Choices past the first of an n > 1 request wait for the fork, unless there is nothing to
    // share (a one-token prompt: every choice prefills its own).
    const Entry e{r, c.index};
    waiting_.insert(std::upper_bound(waiting_.begin(), waiting_.end(), e), e);
  }
}

void Scheduler::drop_running(const Entry& e) {
  running_.erase(std::remove_if(running_.begin(), running_.end(),
                                [&](const Entry& x) {
                                  return x.request == e.request && x.choice == e.choice;
                                }),
                 running_.end());
}

void Scheduler::remove(Request* r) {
  for (Choice& c : r->choices) {
    if (c.seq >= 0) runner_.close_sequence(c.seq);
    c.seq = -1;
  }
  auto of_r = [&](const Entry& e) { return e.request == r; };
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), of_r), waiting_.end());
  running_.erase(std::remove_if(running_.begin(), running_.end(), of_r), running_.end());
}

void Scheduler::finish(Request* r, Choice* c) {
  if (c->seq >= 0) runner_.close_sequence(c->seq);
  c->seq = -1;
  drop_running({r, c->index});
  auto same = [&](const Entry& e) { return e.request == r && e.choice == c->index; };
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), same), waiting_.end());
}

void Scheduler::after_step(Request* r) {
  if (r->forked || r->choices.size() < 2) return;
  Choice& first = r->choices[0];
  if (first.seq < 0 || computed(first) != r->prompt_len() - 1) return;
  for (size_t j = 1; j < r->choices.size(); ++j) {
    Choice& c = r->choices[j];
    if (c.seq < 0) continue;  // preempted while waiting: it prefills its own
    // The placeholder held the slot and window pages the fork takes.
    runner_.close_sequence(c.seq);
    c.seq = runner_.fork_sequence(first.seq);
  }
  r->forked = true;
}

void Scheduler::preempt(const Entry& e) {
  Choice& c = e.c();
  runner_.close_sequence(c.seq);
  c.seq = -1;
  drop_running(e);
  waiting_.insert(std::upper_bound(waiting_.begin(), waiting_.end(), e), e);
  ++preemptions_;
}

std::vector<int32_t> Scheduler::tokens_of(const Request& r, const Choice& c, int64_t n) {
  std::vector<int32_t> t(r.prompt.begin(), r.prompt.begin() + std::min<int64_t>(n, r.prompt_len()));
  for (int64_t i = r.prompt_len(); i < n; ++i) t.push_back(c.output[size_t(i - r.prompt_len())]);
  return t;
}

bool Scheduler::try_admit(const Entry& e, int64_t /*budget*/) {
  Request& r = *e.request;
  Choice& c = e.c();
  if (int(running_.size()) >= opt_.max_running || !runner_.can_open()) return false;
  const int64_t t = target(r, c);
  // The longest cached prefix of all but the last token (which must run to give logits).
  int64_t hit = 0;
  int snap = -1;
  std::vector<int32_t> toks;
  if (prefix_ && t > 1) {
    toks = tokens_of(r, c, t);
    std::tie(hit, snap) = prefix_->lookup(toks, t - 1);
  }
  // Pages: the whole prefill and the first decode (from the hit on, plus a copy of the shared
  // page it writes into), after what the running choices' prefills and first decodes still
  // take. Snapshots are evicted to make room.
  for (;;) {
    const CacheUsage u = runner_.usage();
    bool fits = true;
    for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
      int64_t reserved = 0;
      for (const Entry& x : running_) {
        const int64_t left = target(*x.request, x.c()) + 1 - computed(x.c());
        if (left > 0)
          reserved += runner_.pages_to_append(
              x.c().seq, std::min(left, runner_.max_context() - computed(x.c())), k);
      }
      const int64_t free = u.pages_total[int(k)] - u.pages_used[int(k)];
      const int64_t end = std::min(t + 1, runner_.max_context());
      // A hit shares the snapshot's pages; the partly filled last one is copied on write.
      const int64_t shared = snap >= 0 ? pages_for(k, hit) : 0;
      const bool partial =
          snap >= 0 && runner_.cache_spec().entries(k, hit) % runner_.page_size() != 0;
      const int64_t need = pages_for(k, end) - shared + (partial ? 1 : 0);
      fits &= need + reserved <= free;
    }
    if (fits) break;
    // The snapshot being hit stays: its pages are the ones this choice reuses.
    if (!prefix_ || prefix_->size() <= (snap >= 0 ? 1 : 0) || !prefix_->evict_one()) return false;
    if (snap >= 0) {
      std::tie(hit, snap) = prefix_->lookup(toks, t - 1);  // it may have been the one evicted
    }
  }
  c.seq = snap >= 0 ? runner_.fork_sequence(snap) : runner_.open_sequence();
  if (c.index == 0 && !r.admitted) {
    r.admitted = true;
    r.cached_tokens = hit;
    if (prefix_) {
      prefix_queries_ += r.prompt_len();
      prefix_hits_ += std::min(hit, r.prompt_len());
    }
  }
  waiting_.erase(std::find_if(waiting_.begin(), waiting_.end(), [&](const Entry& x) {
    return x.request == e.request && x.choice == e.choice;
  }));
  running_.insert(std::upper_bound(running_.begin(), running_.end(), e), e);
  return true;
}

void Scheduler::snapshot(const ScheduledChunk& ch) {
  if (!prefix_ || !ch.snapshot || ch.choice->seq < 0) return;
  const int64_t end = ch.start + ch.n;
  const Request& r = *ch.request;
  if (runner_.length(ch.choice->seq) != end) return;
  const std::vector<int32_t> toks = tokens_of(r, *ch.choice, end);
  if (!prefix_->contains(toks)) prefix_->insert(toks, ch.choice->seq);
}

std::vector<ScheduledChunk> Scheduler::schedule() {
  std::vector<ScheduledChunk> out;
  int64_t budget = opt_.max_step_tokens;
  int seqs = opt_.max_step_seqs;
  int64_t rows = opt_.max_logit_rows;
  int64_t used[kNumPageKinds] = {0, 0, 0};  // pages this step's chunks take

  auto free_pages = [&](PageKind k) {
    const CacheUsage u = runner_.usage();
    return int64_t(u.pages_total[int(k)] - u.pages_used[int(k)]) - used[int(k)];
  };
  auto unschedule = [&](const Choice* c) {
    for (auto it = out.begin(); it != out.end(); ++it) {
      if (it->choice != c) continue;
      budget += it->n;
      ++seqs;
      rows += it->rows;
      for (int k = 0; k < kNumPageKinds; ++k) used[k] -= it->pages[k];
      out.erase(it);
      return;
    }
  };
  // Plans the next chunk of a running choice, unless the step has no room left for it or it
  // had to preempt itself.
  auto plan = [&](const Entry& e) {
    Request& r = *e.request;
    Choice& c = e.c();
    const int64_t done = computed(c), need = target(r, c) - done;
    if (need <= 0 || budget <= 0 || seqs <= 0) return;
    int64_t n = std::min(need, budget);
    const bool wants_rows = r.wants_rows(c);
    if (r.want_prompt_logits && r.chunk > 0) n = std::min<int64_t>(n, r.chunk);
    // Prefix cache: the chunk ends at the first snapshot point after `done` it would cross:
    // every multiple of the stride (4 blocks), and the last block boundary before the target
    // (a resend then finds all but less than a block).
    bool snap = false;
    if (prefix_ && !r.want_prompt_logits) {
      const int64_t B = prefix_->block(), S = 4 * B, tgt = target(r, c);
      const int64_t tail = (tgt - 1) / B * B;
      int64_t cut = (done / S + 1) * S;
      if (tail > done) cut = std::min(cut, tail);
      if (cut < done + n) n = cut - done;
      snap = done + n == cut;
    }
    const bool pre_fork = r.choices.size() > 1 && !r.forked;
    const bool sample =
        done + n == target(r, c) && !pre_fork && int64_t(c.output.size()) < r.opts.max_new_tokens;
    const int64_t row_cost = wants_rows ? n : (sample ? 1 : 0);
    if (row_cost > rows) return;
    // Pages: preempt the latest-arrived running choice until this chunk fits.
    for (;;) {
      bool fits = true;
      for (PageKind k : {PageKind::kC4, PageKind::kC128})
        fits &= runner_.pages_to_append(c.seq, n, k) <= free_pages(k);
      if (fits) break;
      if (prefix_ && prefix_->evict_one()) continue;
      const Entry victim = running_.back();
      if (victim.request == e.request && victim.choice == e.choice) {
        preempt(e);
        return;
      }
      unschedule(&victim.c());
      preempt(victim);
    }
    ScheduledChunk s{&r, &c, done, int(n), sample, snap, row_cost, {0, 0, 0}};
    for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
      s.pages[int(k)] = runner_.pages_to_append(c.seq, n, k);
      used[int(k)] += s.pages[int(k)];
    }
    out.push_back(s);
    budget -= n;
    --seqs;
    rows -= row_cost;
  };

  // 1. Decodes, 2. running prefills (FCFS). Entries are copied: preemption edits running_.
  for (bool decode : {true, false}) {
    const std::vector<Entry> run = running_;
    for (const Entry& e : run) {
      if (e.c().seq < 0) continue;  // preempted meanwhile
      const int64_t need = target(*e.request, e.c()) - computed(e.c());
      if ((need == 1) == decode) plan(e);
    }
  }
  // 3. Admissions, FCFS.
  while (!waiting_.empty() && budget > 0 && seqs > 0) {
    const Entry e = waiting_.front();
    if (!try_admit(e, budget)) break;
    plan(e);
  }
  return out;
}

}  // namespace dsv4
