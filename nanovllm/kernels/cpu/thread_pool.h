// parallel_for: the kernels' own fork-join over torch's intra-op thread count
// (torch.set_num_threads), made to behave on a machine whose cores other processes also want.
//
// at::parallel_for (OpenMP under torch) splits a range statically, one piece a thread, and its
// idle threads spin for milliseconds before they sleep. A decode token crosses hundreds of such
// joins; with another busy process on the cores, every join waits for whichever thread was
// descheduled, while the other burns its time slice spinning. Here the range is cut into pieces,
// each thread owns a run of consecutive pieces and takes them in order (one stream through
// memory), and a thread out of pieces takes the back half of another's rest (so the threads end
// within a piece of one another, and a thread that runs takes over the work of one that does
// not); a thread waits by spinning for a bounded few tens of microseconds, then sleeps on a futex
// until woken. Each element still computes the same arithmetic whichever thread takes its piece,
// so results do not depend on the split.
//
// A call from inside a piece, or from a second thread while the pool is busy, runs serially.

#pragma once

#include <cstdint>

namespace nanovllm_cpu {

// body(context, begin, end) over [begin, end) cut into pieces of at least `grain` elements.
void run_parallel(int64_t begin, int64_t end, int64_t grain, void (*body)(void*, int64_t, int64_t), void* context);

// f(begin, end) over pieces of [begin, end), as at::parallel_for takes it.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  run_parallel(begin, end, grain,
               [](void* context, int64_t b, int64_t e) { (*static_cast<const F*>(context))(b, e); },
               const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace nanovllm_cpu
