#pragma once
namespace dsv4::cuda::sm90 {
inline void named_barrier_sync(int id, int threads) {
  ::kemu::named_barrier_sync(id, threads);
}
inline void named_barrier_arrive(int id, int threads) {
  ::kemu::named_barrier_arrive(id, threads);
}
inline void cluster_arrive() {
  ::kemu::cluster_arrive();
}
inline void cluster_wait() {
  ::kemu::cluster_wait();
}
inline void cluster_sync() {
  ::kemu::cluster_arrive();
  ::kemu::cluster_wait();
}
inline void griddep_wait() {}
inline void griddep_launch_dependents() {}
}  // namespace dsv4::cuda::sm90
