// A small fork-join pool for llmserve's kernels: workers spin briefly between kernels, then
// sleep.
//
// Why not OpenMP: a decode step calls a few hundred short kernels back to back. With
// OMP_WAIT_POLICY=PASSIVE every parallel region pays a futex wake-up (measured: batch-1
// decode at half the speed of ACTIVE), and with ACTIVE the workers spin forever, so any
// other busy process on a small machine makes them collapse (10x slower). Here a worker
// spins for `spin_us` microseconds after its last task (long enough to catch the next
// kernel of the same step), yielding the core now and then, and then sleeps on a condition
// variable until the next kernel.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace llmserve {

// A spin-wait hint to the core (x86 `pause`, ARM `yield`); nothing elsewhere.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield");
#endif
}

class ThreadPool {
 public:
  ThreadPool(int num_threads, int64_t spin_us) : spin_us_(spin_us) {
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }

  ~ThreadPool() {
    stop_.store(true);
    generation_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // fn(begin, end) over [0, n) in at most size() contiguous chunks of at least `grain`;
  // the calling thread takes the first chunk. Returns when every chunk is done.
  template <typename F>
  void parallel_for(int64_t n, int64_t grain, const F& fn) {
    if (n <= 0) return;
    int64_t chunks = std::min<int64_t>(size(), (n + grain - 1) / std::max<int64_t>(grain, 1));
    if (chunks <= 1) {
      fn(0, n);
      return;
    }
    int64_t per = (n + chunks - 1) / chunks;
    std::function<void(int)> task = [&](int index) {
      int64_t begin = index * per, end = std::min(n, begin + per);
      if (begin < end) fn(begin, end);
    };
    task_ = &task;
    num_chunks_ = static_cast<int>(chunks);
    pending_.store(static_cast<int>(chunks) - 1);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      wake_.notify_all();
    }
    task(0);
    for (int64_t spins = 0; pending_.load(std::memory_order_acquire) > 0; ++spins) {
      cpu_relax();
      if ((spins & 1023) == 1023) sched_yield();  // a descheduled worker needs the core
    }
  }

 private:
  void work(int index) {
    // 0, not generation_.load(): a kernel may start before this thread first runs
    uint64_t seen = 0;
    while (true) {
      wait_for_work(seen);
      if (stop_.load()) return;
      seen = generation_.load(std::memory_order_acquire);
      if (index < num_chunks_) {
        (*task_)(index);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  void wait_for_work(uint64_t seen) {
    auto start = std::chrono::steady_clock::now();
    for (int64_t spins = 0;; ++spins) {
      if (generation_.load(std::memory_order_acquire) != seen) return;
      cpu_relax();
      if ((spins & 255) == 255) {
        auto waited = std::chrono::steady_clock::now() - start;
        if (waited > std::chrono::microseconds(spin_us_)) break;
        if ((spins & 4095) == 4095) sched_yield();
      }
    }
    std::unique_lock<std::mutex> lock(mutex_);
    sleepers_.fetch_add(1);
    wake_.wait(lock, [&] { return generation_.load() != seen; });
    sleepers_.fetch_sub(1);
  }

  int64_t spin_us_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::function<void(int)>* task_ = nullptr;
  int num_chunks_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace llmserve
