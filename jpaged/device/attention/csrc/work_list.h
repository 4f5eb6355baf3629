// What the native kernels' work lists share: a call's items are claimed by the calling thread and helper
// threads (XLA's intra-op threads, or the weight products' own Crew), and the call returns once every item is
// done.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

inline void Pause() {  // a spin-wait's hint to the core
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The calling thread, once it finds no item left to claim, waits here for the items other threads still
// run: it spins for up to kSpinWait, then sleeps on `finished` (which the thread that completes the last
// item notifies under `mu`). A decode step's items take microseconds, and sleeping at once cost each
// call a futex wake-up: the default model's 30 layers of float32 [out, in] products, one row, as a chain
// of dependent calls, 24.3-25.0 -> 20.5-22.6 ms (Intel Xeon, 2 cores). A prefill's items can take
// milliseconds: the bounded spin then costs one thread kSpinWait per call.
constexpr auto kSpinWait = std::chrono::microseconds(100);

inline void AwaitItems(const std::atomic<int64_t>& done, int64_t total, std::mutex& mu,
                       std::condition_variable& finished) {
  const auto start = std::chrono::steady_clock::now();
  for (int spins = 1; done.load(std::memory_order_acquire) != total; ++spins) {
    Pause();
    if (spins % 64 == 0 && std::chrono::steady_clock::now() - start > kSpinWait) {
      std::unique_lock<std::mutex> lock(mu);
      finished.wait(lock, [&] { return done.load() == total; });
      return;
    }
  }
}

// Counts `count` more items done of `total`, and wakes the thread waiting in AwaitItems after the last.
inline void FinishItems(std::atomic<int64_t>& done, int64_t count, int64_t total, std::mutex& mu,
                        std::condition_variable& finished) {
  if (done.fetch_add(count) + count == total) {
    std::lock_guard<std::mutex> lock(mu);
    finished.notify_all();
  }
}

// Helper threads of the weight products' own, kept for the life of the process: a call offers its work
// (`Offer`) and every helper runs it (a work's Drain claims items, so each item still runs once; a helper
// that comes late finds none left). After a task a helper spins for up to kCrewIdle, yielding its core to
// any other runnable thread at each turn, then sleeps until the next offer. A decode step makes a chain of
// calls a few to a hundred microseconds long with XLA's small operations between them: XLA's intra-op
// threads, scheduled per call, were asleep or stealing elsewhere when a call began, so the calling thread
// read most of a call's weights alone. The caller never waits for a helper to start (it drains the
// items itself), so a crew that never runs (no core free, a forked child without its threads) is only
// slower. One offer is pending at a time: a second caller's offer replaces the first's, whose caller then
// runs what is left of it alone.
constexpr auto kCrewIdle = std::chrono::microseconds(200);

class Crew {
 public:
  // The process's crew of `helpers` threads (the count of the first call; never destroyed, so that no
  // helper outlives it at exit).
  static Crew& Get(int helpers) {
    static Crew* crew = new Crew(helpers);
    return *crew;
  }

  // Every helper runs `task` once, as soon as it is free (or not at all, if another offer replaces this one
  // first: the caller must not depend on it).
  void Offer(std::function<void()> task) {
    bool sleeping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = std::move(task);
      offers_.fetch_add(1, std::memory_order_release);
      sleeping = sleeping_ > 0;
    }
    if (sleeping) wake_.notify_all();
  }

 private:
  explicit Crew(int helpers) {
    for (int i = 0; i < helpers; ++i) std::thread([this] { Serve(); }).detach();
  }

  void Serve() {
    uint64_t seen = 0;
    for (;;) {
      const auto idle_since = std::chrono::steady_clock::now();
      for (int spins = 1; offers_.load(std::memory_order_acquire) == seen; ++spins) {
        if (spins % 16 != 0) {
          Pause();
          continue;
        }
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() - idle_since > kCrewIdle) {
          std::unique_lock<std::mutex> lock(mu_);
          ++sleeping_;
          wake_.wait(lock, [&] { return offers_.load() != seen; });
          --sleeping_;
          break;
        }
      }
      std::function<void()> task;
      {
        std::lock_guard<std::mutex> lock(mu_);
        task = task_;
        seen = offers_.load();
      }
      if (task) task();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> offers_{0};  // how many offers were made (a helper runs the latest once)
  std::function<void()> task_;       // the latest offer (guarded by mu_)
  int sleeping_ = 0;                 // helpers asleep on wake_ (guarded by mu_)
};
