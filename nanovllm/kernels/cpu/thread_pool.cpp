// The pool behind parallel_for (thread_pool.h): threads - 1 workers beside the calling thread,
// a job published by bumping a generation counter, pieces taken from each thread's own run and
// then from the backs of the others', and waits that spin briefly and then sleep on a futex.

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
// Pieces a thread: small enough that the threads finish within a piece of one another and that a
// running thread takes over most of a stalled one's share.
constexpr int64_t kPiecesPerThread = 16;

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
  explicit Pool(int threads) : threads_(threads), shares_(threads) {
    for (int i = 1; i < threads; i++) workers_.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    stop_ = true;
    publish();
    for (std::thread& t : workers_) t.join();
  }
  int threads() const { return threads_; }

  void run(int64_t begin, int64_t end, int64_t pieces, void (*body)(void*, int64_t, int64_t), void* context) {
    begin_ = begin;
    size_ = end - begin;
    pieces_ = pieces;
    body_ = body;
    context_ = context;
    error_ = nullptr;
    for (int t = 0; t < threads_; t++) shares_[t].set(pieces * t / threads_, pieces * (t + 1) / threads_);
    unfinished_.store(uint32_t(workers_.size()), std::memory_order_relaxed);
    publish();
    take_pieces(0);
    // The job lives on the caller's stack: every worker must be done with it before we return.
    for (uint32_t left; (left = unfinished_.load(std::memory_order_acquire)) != 0;)
      wait_while_equal(unfinished_, left, caller_sleeping_);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // A thread's run of the job's pieces, [front, back) in one word. Its owner takes them one by
  // one from the front; a thread out of pieces takes the back half as its own run, so that each
  // thread reads forward through consecutive pieces (one stream through memory) and a thread
  // that another process holds up keeps at most the piece it is in.
  struct alignas(64) Share {
    std::atomic<uint64_t> span{0};
    static uint64_t pack(int64_t front, int64_t back) { return uint64_t(front) << 32 | uint64_t(back); }
    void set(int64_t front, int64_t back) { span.store(pack(front, back), std::memory_order_relaxed); }
    // The front piece, or -1 where none is left.
    int64_t take_front() {
      uint64_t now = span.load(std::memory_order_relaxed);
      while (int64_t(now >> 32) < int64_t(now & 0xffffffffu))
        if (span.compare_exchange_weak(now, now + (uint64_t(1) << 32), std::memory_order_relaxed))
          return int64_t(now >> 32);
      return -1;
    }
    // The back half of what is left (a lone piece whole) into [front, back); false where none is left.
    bool take_back_half(int64_t& front, int64_t& back) {
      uint64_t now = span.load(std::memory_order_relaxed);
      while (true) {
        const int64_t f = int64_t(now >> 32), b = int64_t(now & 0xffffffffu), mid = f + (b - f) / 2;
        if (f >= b) return false;
        if (span.compare_exchange_weak(now, pack(f, mid), std::memory_order_relaxed)) {
          front = mid;
          back = b;
          return true;
        }
      }
    }
  };

  void publish() {
    generation_.fetch_add(1);
    if (workers_sleeping_.load() > 0) futex_wake_all(generation_);
  }

  // Thread `self`'s own pieces, then runs taken from the others' backs, until none is left.
  void take_pieces(int self) {
    Share& own = shares_[self];
    while (true) {
      for (int64_t p; (p = own.take_front()) >= 0;) {
        try {
          body_(context_, begin_ + size_ * p / pieces_, begin_ + size_ * (p + 1) / pieces_);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex_);
          if (!error_) error_ = std::current_exception();
        }
      }
      int64_t front = 0, back = 0;
      int k = 1;
      while (k < threads_ && !shares_[(self + k) % threads_].take_back_half(front, back)) k++;
      if (k == threads_) return;
      own.set(front, back);
    }
  }

  void work(int self);

  const int threads_;
  std::vector<Share> shares_;  // by thread: the caller's, then each worker's
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> generation_{0}, unfinished_{0};
  std::atomic<int> workers_sleeping_{0}, caller_sleeping_{0};
  bool stop_ = false;
  // The job: read by the workers only between its publication and their decrement of unfinished_.
  int64_t begin_ = 0, size_ = 0, pieces_ = 0;
  void (*body_)(void*, int64_t, int64_t) = nullptr;
  void* context_ = nullptr;
  std::exception_ptr error_;
  std::mutex error_mutex_;
};

thread_local bool inside_pool = false;

void Pool::work(int self) {
  inside_pool = true;  // a parallel_for inside a piece runs serially
  uint32_t seen = 0;  // the generation before the first job, whenever this thread starts
  while (true) {
    wait_while_equal(generation_, seen, workers_sleeping_);
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    take_pieces(self);
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
  const int64_t pieces = std::min((end - begin + grain - 1) / std::max<int64_t>(grain, 1), threads * kPiecesPerThread);
  std::unique_lock<std::mutex> lock(pool_mutex, std::defer_lock);
  if (threads == 1 || pieces <= 1 || inside_pool || !lock.try_lock()) {
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
  pool->run(begin, end, pieces, body, context);
}

}  // namespace nanovllm_cpu
