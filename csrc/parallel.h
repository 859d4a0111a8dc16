// ParallelFor over XLA's intra-op thread pool (ffi::ThreadPool), with a std::thread fallback.
//
// The calling thread always takes part and can finish every item alone, so the call cannot deadlock when the pool is
// busy or when the handler itself runs on a pool thread. Items are claimed from an atomic counter; tasks that start
// after all items are claimed return at once (they hold the job by shared_ptr, so a late task never touches freed
// memory).

#ifndef GCMOE_JAX_CSRC_PARALLEL_H_
#define GCMOE_JAX_CSRC_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace gcmoe {

class PoolParallelFor {
 public:
  // `pool` may be null (then std::threads are used); `max_threads` bounds the threads used, the caller included.
  PoolParallelFor(::xla::ffi::ThreadPool* pool, int64_t max_threads) : pool_(pool), max_threads_(max_threads) {}

  void operator()(int64_t n, const std::function<void(int64_t)>& fn) const {
    if (n <= 0) return;
    auto job = std::make_shared<Job>(n, &fn);
    const int64_t helpers = std::min<int64_t>(max_threads_, n) - 1;
    std::vector<std::thread> threads;
    for (int64_t i = 0; i < helpers; ++i) {
      if (pool_ != nullptr) {
        pool_->Schedule([job] { job->Drain(); });
      } else {
        threads.emplace_back([job] { job->Drain(); });
      }
    }
    job->Drain();
    job->Wait();
    for (std::thread& t : threads) t.join();
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  struct Job {
    Job(int64_t n_, const std::function<void(int64_t)>* fn_) : n(n_), fn(fn_) {}

    void Drain() {
      for (;;) {
        const int64_t i = next.fetch_add(1);
        if (i >= n) return;
        if (!failed.load()) {
          try {
            (*fn)(i);
          } catch (...) {
            std::lock_guard<std::mutex> lock(mu);
            if (!error) error = std::current_exception();
            failed.store(true);
          }
        }
        if (done.fetch_add(1) + 1 == n) {
          std::lock_guard<std::mutex> lock(mu);
          cv.notify_all();
        }
      }
    }

    void Wait() {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [this] { return done.load() == n; });
    }

    const int64_t n;
    const std::function<void(int64_t)>* fn;  // valid while done < n (the caller is waiting)
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::condition_variable cv;
    std::exception_ptr error;
  };

  ::xla::ffi::ThreadPool* pool_;
  int64_t max_threads_;
};

}  // namespace gcmoe

#endif  // GCMOE_JAX_CSRC_PARALLEL_H_
