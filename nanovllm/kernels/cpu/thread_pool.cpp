// The pool behind parallel_for (thread_pool.h): threads - 1 workers beside the calling thread,
// a job published by bumping a generation counter, chunks claimed from an atomic counter, and
// waits that spin briefly and then sleep on a futex.

#include "thread_pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

namespace nanovllm_cpu {
namespace {

// How long a waiting thread spins before it sleeps. Long enough to cover the gap between two
// joins of one decode step on a quiet machine (a futex wake costs a few microseconds more);
// short enough that a thread whose partner was descheduled soon gives its core away.
constexpr auto kSpin = std::chrono::microseconds(50);
// Chunks a thread: enough that a running thread can take over a stalled one's share.
constexpr int64_t kChunksPerThread = 4;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  if (word.load() == expected) std::this_thread::yield();
#endif
}

void futex_wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
}

// Wait until word != value: spin for kSpin, then sleep (counted in `sleepers` so a waker knows to
// call the kernel). sleepers is incremented before the value is checked again, and the waker
// changes the value before it reads sleepers, so no wake is lost.
void wait_while_equal(std::atomic<uint32_t>& word, uint32_t value, std::atomic<int>& sleepers) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (int i = 0; word.load(std::memory_order_acquire) == value; i++) {
    if (i % 16 != 15) {
      relax();
      continue;
    }
    if (std::chrono::steady_clock::now() < deadline) continue;
    sleepers.fetch_add(1);
    while (word.load() == value) futex_wait(word, value);
    sleepers.fetch_sub(1);
  }
}

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int i = 1; i < threads; i++) workers_.emplace_back([this] { work(); });
  }
  ~Pool() {
    stop_ = true;
    publish();
    for (std::thread& t : workers_) t.join();
  }
  int threads() const { return threads_; }

  void run(int64_t begin, int64_t end, int64_t chunks, void (*body)(void*, int64_t, int64_t), void* context) {
    begin_ = begin;
    size_ = end - begin;
    chunks_ = chunks;
    body_ = body;
    context_ = context;
    error_ = nullptr;
    next_.store(0, std::memory_order_relaxed);
    unfinished_.store(uint32_t(workers_.size()), std::memory_order_relaxed);
    publish();
    claim_chunks();
    // The job lives on the caller's stack: every worker must be done with it before we return.
    for (uint32_t left; (left = unfinished_.load(std::memory_order_acquire)) != 0;)
      wait_while_equal(unfinished_, left, caller_sleeping_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void publish() {
    generation_.fetch_add(1);
    if (workers_sleeping_.load() > 0) futex_wake_all(generation_);
  }

  void claim_chunks() {
    for (int64_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < chunks_;) {
      try {
        body_(context_, begin_ + size_ * c / chunks_, begin_ + size_ * (c + 1) / chunks_);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void work();

  const int threads_;
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> generation_{0}, unfinished_{0};
  std::atomic<int> workers_sleeping_{0}, caller_sleeping_{0};
  std::atomic<int64_t> next_{0};
  bool stop_ = false;
  // The job: read by the workers only between its publication and their decrement of unfinished_.
  int64_t begin_ = 0, size_ = 0, chunks_ = 0;
  void (*body_)(void*, int64_t, int64_t) = nullptr;
  void* context_ = nullptr;
  std::exception_ptr error_;
  std::mutex error_mutex_;
};

thread_local bool inside_pool = false;

void Pool::work() {
  inside_pool = true;  // a parallel_for inside a chunk runs serially
  uint32_t seen = 0;  // the generation before the first job, whenever this thread starts
  while (true) {
    wait_while_equal(generation_, seen, workers_sleeping_);
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    claim_chunks();
    if (unfinished_.fetch_sub(1) == 1 && caller_sleeping_.load() > 0) futex_wake_all(unfinished_);
  }
}

std::mutex pool_mutex;  // one job at a time; a caller that finds the pool busy runs serially
// Never destroyed: its workers sleep until the process exits. A forked child has the pointer but
// not the threads, so it makes a pool of its own.
Pool* pool = nullptr;
pid_t pool_pid = 0;

struct InsidePool {
  InsidePool() { inside_pool = true; }
  ~InsidePool() { inside_pool = false; }
};

int pool_threads() { return std::max(1, at::get_num_threads()); }

}  // namespace

void run_parallel(int64_t begin, int64_t end, int64_t grain, void (*body)(void*, int64_t, int64_t), void* context) {
  const int threads = pool_threads();
  const int64_t chunks = std::min((end - begin + grain - 1) / std::max<int64_t>(grain, 1), threads * kChunksPerThread);
  std::unique_lock<std::mutex> lock(pool_mutex, std::defer_lock);
  if (threads == 1 || chunks <= 1 || inside_pool || !lock.try_lock()) {
    body(context, begin, end);
    return;
  }
  if (pool_pid != getpid()) {
    pool = nullptr;
    pool_pid = getpid();
  }
  if (pool == nullptr || pool->threads() != threads) {
    delete pool;  // torch's thread count changed: a pool of the new width
    pool = new Pool(threads);
  }
  InsidePool guard;
  pool->run(begin, end, chunks, body, context);
}

}  // namespace nanovllm_cpu
