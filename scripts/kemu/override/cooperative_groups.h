#pragma once
namespace cooperative_groups {
struct cluster_group {
  template <typename T>
  T* map_shared_rank(T* p, unsigned r) const {
    return static_cast<T*>(::kemu::map_rank_ptr(p, r));
  }
  unsigned block_rank() const { return ::kemu::cluster_rank(); }
  unsigned num_blocks() const { return ::kemu::cluster_size(); }
  void sync() const {
    ::kemu::cluster_arrive();
    ::kemu::cluster_wait();
  }
  void barrier_arrive() const { ::kemu::cluster_arrive(); }
  void barrier_wait() const { ::kemu::cluster_wait(); }
};
inline cluster_group this_cluster() {
  return {};
}
struct thread_block {
  void sync() const { __syncthreads(); }
};
inline thread_block this_thread_block() {
  return {};
}
}  // namespace cooperative_groups
