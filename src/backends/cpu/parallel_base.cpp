#include "backends/cpu/parallel_base.h"

#include "backends/cpu/host_sampling.h"
#include "comm/collective_aborted.h"
#include "comm/first_failure.h"
#include "comm/rendezvous.h"
#include "core/error.h"

namespace dsv4 {
namespace {

std::string what(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "unknown error";
}

}  // namespace

ParallelRunnerBase::ParallelRunnerBase(const ModelConfig& config, const CacheConfig& cache,
                                       const Limits& limits, const ParallelConfig& parallel,
                                       const NodePlacement& node)
    : PagedRunner(config, cache, limits, parallel.dp), layout_(config, parallel), node_(node) {
  const int W = layout_.world();
  DSV4_CHECK(node.nnodes >= 1, "--nnodes must be at least 1");
  DSV4_CHECK(node.node_rank >= 0 && node.node_rank < node.nnodes, "--node-rank ", node.node_rank,
             " must be in [0, ", node.nnodes, ") (--nnodes ", node.nnodes, ")");
  DSV4_CHECK(W % node.nnodes == 0, layout_.describe(), ": ", W, " ranks do not divide over ",
             node.nnodes, " nodes (each node runs the same number of ranks)");
  DSV4_CHECK(node.nnodes == 1 || node.rendezvous,
             "internal: a multi-node runner without its "
             "rendezvous");
  local_ranks_ = W / node.nnodes;
  first_rank_ = node.node_rank * local_ranks_;
  if (node.nnodes > 1) {
    // While the ranks are built (their communicators' splits span the nodes), a node that
    // reports a failure or goes away aborts this node's ranks, so none waits for it in a
    // collective; the start check (runtime) then reports the cause. Until the run starts.
    watch_ = [this] {
      if (build_aborted_) return;
      for (int n : rendezvous()->readable(0))
        if (rendezvous()->reported(n)) {
          build_aborted_ = true;
          pool_->abort();
          return;
        }
    };
  }
}

ParallelRunnerBase::~ParallelRunnerBase() {
  stop_ranks();
}

void ParallelRunnerBase::start_ranks(std::function<void(int)> enter,
                                     std::function<void(int)> failed) {
  pool_ = std::make_unique<RankPool>(local_ranks_, std::move(enter), std::move(failed));
}

void ParallelRunnerBase::stop_ranks() {
  if (stopped_) return;
  stopped_ = true;
  if (leads_nodes() && nodes_started_) {
    try {
      // After a failure the others fail too (a node told to stop would exit as if all went well).
      if (failed_.empty())
        rendezvous()->broadcast({uint8_t(NodeOp::kStop)});
      else
        rendezvous()->fail(cat("node 0 failed: ", failed_));
    } catch (...) {  // a node already gone has nothing to stop
    }
  }
  if (pool_) pool_->stop();
}

void ParallelRunnerBase::post(std::vector<uint8_t> message) {
  try {
    rendezvous()->broadcast(message);
  } catch (const Error& e) {
    give_up(cat("multi-node run: ", e.what()));
  }
}

void ParallelRunnerBase::give_up(const std::string& why) {
  if (failed_.empty()) failed_ = why;
  throw EngineFailed(failed_);
}

void ParallelRunnerBase::check_usable() const {
  if (!failed_.empty()) throw EngineFailed(failed_);
}

void ParallelRunnerBase::local_reset_states(int g, int slot) {
  for (int l = 0; l < local_ranks_; ++l)
    if (layout_.dp_group(first_rank_ + l) == g) rank_reset_states(l, slot);
}

void ParallelRunnerBase::local_copy_sequence(int g, const SequenceCache& from,
                                             const SequenceCache& to) {
  for (int l = 0; l < local_ranks_; ++l)
    if (layout_.dp_group(first_rank_ + l) == g) rank_copy_sequence(l, from, to);
}

void ParallelRunnerBase::local_copy_pages(int g, const std::vector<PageCopy>& copies) {
  for (int l = 0; l < local_ranks_; ++l)
    if (layout_.dp_group(first_rank_ + l) == g) rank_copy_pages(l, copies);
}

void ParallelRunnerBase::reset_states(int g, int slot) {
  check_usable();
  if (leads_nodes()) {
    WireWriter w;
    w.u8(uint8_t(NodeOp::kResetStates));
    w.i64(g);
    w.i64(slot);
    post(std::move(w.bytes()));
  }
  local_reset_states(g, slot);
}

void ParallelRunnerBase::copy_sequence(int g, const SequenceCache& from, const SequenceCache& to) {
  check_usable();
  if (leads_nodes()) {
    WireWriter w;
    w.u8(uint8_t(NodeOp::kCopySequence));
    w.i64(g);
    put_sequence(w, from);
    put_sequence(w, to);
    post(std::move(w.bytes()));
  }
  local_copy_sequence(g, from, to);
}

void ParallelRunnerBase::copy_pages(int g, const std::vector<PageCopy>& copies) {
  check_usable();
  if (leads_nodes()) {
    WireWriter w;
    w.u8(uint8_t(NodeOp::kCopyPages));
    w.i64(g);
    put_copies(w, copies);
    post(std::move(w.bytes()));
  }
  local_copy_pages(g, copies);
}

StepOutput ParallelRunnerBase::forward(const StepBatch& batch) {
  std::vector<StepBatch> all(static_cast<size_t>(dp_size()));
  all[size_t(batch.dp_rank)] = batch;
  return std::move(forward_groups(all)[size_t(batch.dp_rank)]);
}

std::vector<StepOutput> ParallelRunnerBase::forward_groups(const std::vector<StepBatch>& batches) {
  DSV4_CHECK(node_.node_rank == 0, "node ", node_.node_rank,
             " of a multi-node run runs node 0's steps (follow()), none of its own");
  check_usable();
  if (leads_nodes()) {
    WireWriter w;
    w.u8(uint8_t(NodeOp::kStep));
    put_batches(w, batches);
    post(std::move(w.bytes()));
  }
  std::vector<GroupResult> results(batches.size());
  std::exception_ptr local;
  if (!leads_nodes()) {
    // A rank's failure aborted every rank's communicators: the runner cannot step again.
    try {
      local_forward(batches, results);
    } catch (const std::exception& e) {
      give_up(e.what());
    }
  } else {
    // Answers are read as they come (a node may finish first, or fail); an error answer or a
    // closed connection aborts this node's ranks.
    Rendezvous& rv = *rendezvous();
    std::vector<std::vector<uint8_t>> replies(size_t(node_.nnodes));
    std::vector<bool> got(size_t(node_.nnodes), false);
    std::string cause, consequence;  // the first failure elsewhere, and its echoes
    bool aborted_here = false;
    auto went_away = [&](int n) {
      return cat("multi-node run: ", rv.name(n), " went away during a step (its process ended?)");
    };
    // `echo`: the node's ranks failed because another's aborted (CollectiveAborted there).
    auto failed = [&](const std::string& e, bool echo) {
      std::string& slot = echo ? consequence : cause;
      if (slot.empty()) slot = e;
    };
    auto take = [&](int n, double timeout_s) {
      try {
        replies[size_t(n)] = rv.receive(n, timeout_s);
        got[size_t(n)] = true;
        const std::vector<uint8_t>& m = replies[size_t(n)];
        if (m.empty() || m[0] == 0) {
          WireReader r(m);
          r.u8();
          const bool echo = r.u8() != 0;
          failed(cat("multi-node run: node ", n, " failed: ", r.str()), echo);
          return false;
        }
        return true;
      } catch (const Error& e) {
        got[size_t(n)] = true;
        failed(rv.closed(n) ? went_away(n) : cat("multi-node run: ", e.what()), false);
        return false;
      }
    };
    watch_ = [&] {
      for (int n : rv.readable(0)) {
        if (n <= 0 || got[size_t(n)]) continue;
        bool ok = false;
        if (rv.closed(n)) {
          got[size_t(n)] = true;
          failed(went_away(n), false);
        } else {
          ok = take(n, -1);
        }
        if (!ok && !aborted_here) {
          aborted_here = true;
          pool_->abort();
        }
      }
    };
    try {
      local_forward(batches, results);
    } catch (...) {
      local = std::current_exception();
    }
    watch_ = nullptr;
    for (int n = 1; n < node_.nnodes; ++n)
      if (!got[size_t(n)]) take(n, -1);
    // Any failure leaves the nodes' ranks aborted or out of step: the run cannot go on.
    if (local && !aborted_here && !is_collective_abort(local)) give_up(what(local));
    if (!cause.empty()) give_up(cause);
    if (local) give_up(what(local));
    if (!consequence.empty()) give_up(consequence);
    for (int n = 1; n < node_.nnodes; ++n) {
      WireReader r(replies[size_t(n)]);
      r.u8();
      for (int64_t k = r.i64(); k > 0; --k) {
        const int64_t g = r.i64();
        DSV4_CHECK(g >= 0 && g < int64_t(results.size()), "multi-node: node ", n,
                   " answers for group ", g);
        results[size_t(g)].logits = r.floats();
        results[size_t(g)].nonfinite = r.ints();
      }
    }
  }
  // Node 0 samples every group's rows.
  const int V = config().vocab_size;
  std::vector<StepOutput> out(batches.size());
  for (size_t g = 0; g < batches.size(); ++g) {
    const StepBatch& b = batches[g];
    if (b.chunks.empty()) continue;
    GroupResult& r = results[g];
    DSV4_CHECK(r.logits.size() == b.rows.size() * size_t(V), "internal: group ", g, " returned ",
               r.logits.size(), " logits for ", b.rows.size(), " rows");
    out[g] = sample_on_host(b, r.logits.data(), V,
                            r.nonfinite.empty() ? std::vector<std::string>{}
                                                : nonfinite_errors(config(), b, r.nonfinite));
    r.logits.resize(size_t(b.num_logit_rows) * size_t(V));
    out[g].logits = std::move(r.logits);
  }
  return out;
}

void ParallelRunnerBase::nodes_started() {
  nodes_started_ = true;
  watch_ = nullptr;  // the build's watch
}

void ParallelRunnerBase::follow() {
  DSV4_CHECK(node_.nnodes > 1 && node_.node_rank > 0,
             "follow(): only nodes > 0 of a multi-node run follow node 0");
  watch_ = nullptr;  // the build's watch
  const int me = node_.node_rank;
  for (;;) {
    std::vector<uint8_t> m;
    try {
      m = rendezvous()->broadcast({}, 0);  // the server may idle for hours
    } catch (const Error& e) {
      throw Error(cat("multi-node run: node ", me, " lost node 0: ", e.what()));
    }
    WireReader r(m);
    switch (NodeOp(r.u8())) {
      case NodeOp::kStop:
        return;
      case NodeOp::kResetStates: {
        const int g = int(r.i64());
        local_reset_states(g, int(r.i64()));
        break;
      }
      case NodeOp::kCopySequence: {
        const int g = int(r.i64());
        const SequenceCache from = get_sequence(r);
        local_copy_sequence(g, from, get_sequence(r));
        break;
      }
      case NodeOp::kCopyPages: {
        const int g = int(r.i64());
        local_copy_pages(g, get_copies(r));
        break;
      }
      case NodeOp::kStep: {
        const std::unique_ptr<ReceivedStep> st = get_batches(r);
        std::vector<GroupResult> results(st->batches.size());
        WireWriter w;
        // Node 0 sends nothing during a step: a readable connection is a closed one.
        bool lost = false;
        watch_ = [&] {
          if (!lost && !rendezvous()->readable(0).empty() && rendezvous()->closed(0)) {
            lost = true;
            pool_->abort();
          }
        };
        try {
          local_forward(st->batches, results);
          watch_ = nullptr;
        } catch (const std::exception& e) {
          watch_ = nullptr;
          // Node 0 gone: its ranks' connections fail this node's collectives, often before the
          // watch has seen the control connection close; a collective's failure waits up to a
          // second for that (node 0 sends nothing during a step: readable means closed).
          if (!lost && dynamic_cast<const CollectiveAborted*>(&e) &&
              !rendezvous()->readable(1.0).empty() && rendezvous()->closed(0))
            lost = true;
          if (lost) throw Error(cat("multi-node run: node ", me, " lost node 0 during a step"));
          w.u8(0);
          w.u8(dynamic_cast<const CollectiveAborted*>(&e) ? 1 : 0);
          w.str(e.what());
          try {
            rendezvous()->gather(w.bytes());
          } catch (...) {
            throw Error(cat("multi-node run: node ", me, " lost node 0 during a step: ", e.what()));
          }
          throw;
        }
        w.u8(1);
        std::vector<int> mine;
        for (size_t g = 0; g < st->batches.size(); ++g)
          if (!st->batches[g].chunks.empty() && is_local(group_leader(int(g))))
            mine.push_back(int(g));
        w.i64(int64_t(mine.size()));
        for (int g : mine) {
          w.i64(g);
          w.floats(results[size_t(g)].logits);
          w.ints(results[size_t(g)].nonfinite);
        }
        rendezvous()->gather(w.bytes());
        break;
      }
      default:
        throw Error(cat("multi-node run: node ", me, " got an unknown operation from node 0"));
    }
  }
}

}  // namespace dsv4
