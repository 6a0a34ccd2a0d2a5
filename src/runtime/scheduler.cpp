#include "runtime/scheduler.h"

#include <algorithm>

#include "core/error.h"
#include "runtime/prefix_cache.h"

namespace dsv4 {

// One step's room on each data-parallel rank.
struct Scheduler::Budget {
  struct Rank {
    int64_t tokens = 0;
    int seqs = 0;
    int64_t rows = 0;
    int64_t used[kNumPageKinds] = {0, 0, 0};  // pages this step's chunks take
  };
  std::vector<Rank> rank;
  bool any() const {
    for (const Rank& r : rank)
      if (r.tokens > 0 && r.seqs > 0) return true;
    return false;
  }
};

Scheduler::Scheduler(Runner& runner, const SchedulerOptions& options,
                     std::vector<PrefixCache*> prefix)
    : runner_(runner), opt_(options) {
  DSV4_CHECK(opt_.max_running > 0 && opt_.max_step_tokens > 0 && opt_.max_step_seqs > 0 &&
                 opt_.max_logit_rows > 0,
             "scheduler limits must be positive");
  bool on = false;
  for (PrefixCache* p : prefix) on |= p && p->enabled();
  if (on) {
    DSV4_CHECK(int(prefix.size()) == runner.dp_size(), "one prefix cache per data-parallel rank");
    prefix_ = std::move(prefix);
    for (PrefixCache*& p : prefix_)
      if (p && !p->enabled()) p = nullptr;
  }
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

int Scheduler::running_on(int g) const {
  int n = 0;
  for (const Entry& e : running_) n += rank_of(e) == g;
  return n;
}

int64_t Scheduler::load_on(int g) const {
  int64_t n = 0;
  for (const Entry& e : running_)
    if (rank_of(e) == g) n += target(*e.request, e.c());
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
    // The placeholder held the slot and window pages the fork takes (on the same rank).
    runner_.close_sequence(c.seq);
    c.seq = runner_.fork_sequence(first.seq);
  }
  r->forked = true;
}

void Scheduler::preempt(const Entry& e) {
  Choice& c = e.c();
  runner_.close_sequence(c.seq);
  c.seq = -1;
  c.drafts.clear();  // readmitted, it recomputes and samples before drafting again
  drop_running(e);
  waiting_.insert(std::upper_bound(waiting_.begin(), waiting_.end(), e), e);
  ++preemptions_;
}

std::vector<int32_t> Scheduler::tokens_of(const Request& r, const Choice& c, int64_t n) {
  std::vector<int32_t> t(r.prompt.begin(), r.prompt.begin() + std::min<int64_t>(n, r.prompt_len()));
  for (int64_t i = r.prompt_len(); i < n; ++i) t.push_back(c.output[size_t(i - r.prompt_len())]);
  return t;
}

bool Scheduler::admit_on(const Entry& e, int g, int64_t t, const std::vector<int32_t>& toks) {
  Request& r = *e.request;
  Choice& c = e.c();
  PrefixCache* pc = prefix(g);
  // The longest cached prefix of all but the last token (which must run to give logits).
  int64_t hit = 0;
  int snap = -1;
  if (pc && t > 1) std::tie(hit, snap) = pc->lookup(toks, t - 1);
  // Pages: the whole prefill and the first decode (from the hit on, plus a copy of the shared
  // page it writes into), after what the rank's running choices' prefills and first decodes
  // still take. Snapshots are evicted to make room.
  for (;;) {
    const CacheUsage u = runner_.usage_on(g);
    bool fits = true;
    for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
      int64_t reserved = 0;
      for (const Entry& x : running_) {
        if (rank_of(x) != g) continue;
        const int64_t left = target(*x.request, x.c()) + 1 - computed(x.c());
        if (left > 0)
          reserved += runner_.pages_to_append(
              x.c().seq, std::min(left, runner_.max_context() - computed(x.c())), k);
      }
      const int64_t free = u.pages_total[int(k)] - u.pages_used[int(k)];
      // The next token's pages only where the choice computes one more: a request for no new
      // tokens (prompt logits, echo) ends with its prompt, so a pool planned for exactly its
      // prompt holds it; before an n > 1 request forks, t is its prompt less the last token.
      const bool more = t < r.prompt_len() + r.opts.max_new_tokens;
      const int64_t end = std::min(t + (more ? 1 : 0), runner_.max_context());
      // A hit shares the snapshot's pages; the partly filled last one is copied on write.
      const int64_t shared = snap >= 0 ? pages_for(k, hit) : 0;
      const bool partial =
          snap >= 0 && runner_.cache_spec().entries(k, hit) % runner_.page_size() != 0;
      const int64_t need = pages_for(k, end) - shared + (partial ? 1 : 0);
      fits &= need + reserved <= free;
    }
    if (fits) break;
    // The snapshot being hit stays: its pages are the ones this choice reuses.
    if (!pc || pc->size() <= (snap >= 0 ? 1 : 0) || !pc->evict_one()) return false;
    if (snap >= 0) std::tie(hit, snap) = pc->lookup(toks, t - 1);  // it may have been evicted
  }
  c.seq = snap >= 0 ? runner_.fork_sequence(snap) : runner_.open_sequence_on(g);
  if (c.index == 0 && !r.admitted) {
    r.admitted = true;
    r.cached_tokens = hit;
    if (!prefix_.empty()) {
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

bool Scheduler::try_admit(const Entry& e, Budget& b) {
  Request& r = *e.request;
  Choice& c = e.c();
  const int64_t t = target(r, c);
  std::vector<int32_t> toks;
  if (!prefix_.empty() && t > 1) toks = tokens_of(r, c, t);
  // The ranks this choice may go to, best first: a placeholder of an n > 1 request stays with
  // its first choice; else the longest prefix hit, then the lightest load.
  std::vector<int> ranks;
  const Choice& first = r.choices[0];
  if (r.choices.size() > 1 && !r.forked && c.index > 0 && first.seq >= 0) {
    ranks.push_back(runner_.dp_rank(first.seq));
  } else {
    std::vector<std::pair<int64_t, int64_t>> score(size_t(runner_.dp_size()));
    for (int g = 0; g < runner_.dp_size(); ++g) {
      const int64_t hit = prefix(g) && t > 1 ? prefix(g)->peek(toks, t - 1) : 0;
      score[size_t(g)] = {-hit, load_on(g)};
      ranks.push_back(g);
    }
    std::stable_sort(ranks.begin(), ranks.end(),
                     [&](int a, int c2) { return score[size_t(a)] < score[size_t(c2)]; });
  }
  for (int g : ranks) {
    const Budget::Rank& br = b.rank[size_t(g)];
    if (br.tokens <= 0 || br.seqs <= 0) continue;
    if (running_on(g) >= opt_.max_running || !runner_.can_open_on(g)) continue;
    if (admit_on(e, g, t, toks)) return true;
  }
  return false;
}

void Scheduler::snapshot(const ScheduledChunk& ch) {
  if (prefix_.empty() || !ch.snapshot || ch.choice->seq < 0) return;
  PrefixCache* pc = prefix(runner_.dp_rank(ch.choice->seq));
  const int64_t end = ch.start + ch.n;
  if (!pc || runner_.length(ch.choice->seq) != end) return;
  const std::vector<int32_t> toks = tokens_of(*ch.request, *ch.choice, end);
  if (!pc->contains(toks)) pc->insert(toks, ch.choice->seq);
}

std::vector<ScheduledChunk> Scheduler::schedule() {
  std::vector<ScheduledChunk> out;
  Budget b;
  b.rank.resize(size_t(runner_.dp_size()));
  for (Budget::Rank& r : b.rank) {
    r.tokens = opt_.max_step_tokens;
    r.seqs = opt_.max_step_seqs;
    r.rows = opt_.max_logit_rows;
  }

  auto free_pages = [&](int g, PageKind k) {
    const CacheUsage u = runner_.usage_on(g);
    return int64_t(u.pages_total[int(k)] - u.pages_used[int(k)]) - b.rank[size_t(g)].used[int(k)];
  };
  auto unschedule = [&](const Choice* c) {
    for (auto it = out.begin(); it != out.end(); ++it) {
      if (it->choice != c) continue;
      Budget::Rank& br = b.rank[size_t(runner_.dp_rank(c->seq))];
      br.tokens += it->n;
      ++br.seqs;
      br.rows += it->rows;
      for (int k = 0; k < kNumPageKinds; ++k) br.used[k] -= it->pages[k];
      out.erase(it);
      return;
    }
  };
  // Plans the next chunk of a running choice, unless its rank's step has no room left for it
  // or it had to preempt itself.
  auto plan = [&](const Entry& e) {
    Request& r = *e.request;
    Choice& c = e.c();
    const int g = rank_of(e);
    Budget::Rank& br = b.rank[size_t(g)];
    const int64_t done = computed(c), need = target(r, c) - done;
    if (need <= 0 || br.tokens <= 0 || br.seqs <= 0) return;
    int64_t n = std::min(need, br.tokens);
    const bool wants_rows = r.wants_rows(c);
    if (r.want_prompt_logits && r.chunk > 0) n = std::min<int64_t>(n, r.chunk);
    // Prefix cache: the chunk ends at the first snapshot point after `done` it would cross:
    // every multiple of the stride (4 blocks), and the last block boundary before the target
    // (a resend then finds all but less than a block).
    bool snap = false;
    int64_t cut = -1;
    if (prefix(g) && !r.want_prompt_logits) {
      const int64_t B = prefix(g)->block(), S = 4 * B, tgt = target(r, c);
      const int64_t tail = (tgt - 1) / B * B;
      cut = (done / S + 1) * S;
      if (tail > done) cut = std::min(cut, tail);
      if (cut < done + n) n = cut - done;
      snap = done + n == cut;
    }
    if (wants_rows) n = std::min(n, br.rows);
    if (n <= 0) return;
    const bool pre_fork = r.choices.size() > 1 && !r.forked;
    const bool sample =
        done + n == target(r, c) && !pre_fork && int64_t(c.output.size()) < r.opts.max_new_tokens;
    int64_t row_cost = wants_rows ? n : (sample ? 1 : 0);
    if (row_cost > br.rows) return;
    // Speculative decoding: a decode brings its drafts after its token, as many as the step's
    // tokens and rows leave room for, never across a snapshot point (a verify rejected past
    // it would leave the sequence short of it; the snapshot is then taken when it gets there).
    int64_t drafts = 0;
    if (sample && !wants_rows && need == 1 && n == 1) {
      drafts = std::min<int64_t>({int64_t(c.drafts.size()), br.tokens - n, br.rows - row_cost});
      if (cut >= 0) drafts = std::min(drafts, cut - (done + n));
      drafts = std::max<int64_t>(drafts, 0);
      row_cost += drafts;
      snap = cut >= 0 && done + n + drafts == cut;
    }
    // Pages: drop the drafts, evict the rank's snapshots, then preempt its latest-arrived
    // running choice, until this chunk fits.
    for (;;) {
      bool fits = true;
      for (PageKind k : {PageKind::kC4, PageKind::kC128})
        fits &= runner_.pages_to_append(c.seq, n + drafts, k) <= free_pages(g, k);
      if (fits) break;
      if (drafts > 0) {
        row_cost -= drafts;
        drafts = 0;
        snap = cut >= 0 && done + n == cut;
        continue;
      }
      if (prefix(g) && prefix(g)->evict_one()) continue;
      auto victim = std::find_if(running_.rbegin(), running_.rend(),
                                 [&](const Entry& x) { return rank_of(x) == g; });
      if (victim->request == e.request && victim->choice == e.choice) {
        preempt(e);
        return;
      }
      const Entry v = *victim;
      unschedule(&v.c());
      preempt(v);
    }
    ScheduledChunk s{&r, &c, done, int(n + drafts), sample, snap, row_cost, {0, 0, 0}};
    s.drafts = int(drafts);
    for (PageKind k : {PageKind::kC4, PageKind::kC128}) {
      s.pages[int(k)] = runner_.pages_to_append(c.seq, n + drafts, k);
      br.used[int(k)] += s.pages[int(k)];
    }
    out.push_back(s);
    br.tokens -= n + drafts;
    --br.seqs;
    br.rows -= row_cost;
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
  while (!waiting_.empty() && b.any()) {
    const Entry e = waiting_.front();
    if (!try_admit(e, b)) break;
    plan(e);
  }
  return out;
}

}  // namespace dsv4
