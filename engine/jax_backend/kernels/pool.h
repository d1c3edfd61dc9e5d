// A process-wide pool of worker threads for the weight-product kernels (panel_matmul.cc, int8_matmul.cc)
// and both attentions (decode_attention.cc, chunk_attention.cc).
//
// Why by hand: a decode step runs ~120 weight products of 10-300 us each, so a fork/join must cost
// a few microseconds. XLA's intra-op pool hands work off through a queue: it was measured slower
// than one thread for these products (docs/benchmarks.md, "Tried and left out"), and it cost the
// decode attention more than it saved ("The decode attention on the products' pool"); OpenMP would do it, but its runtime (libgomp) is not in the slim runtime image and cannot be linked
// statically into a shared library. So: workers that spin briefly on a generation counter after
// each job (the next product of the step follows within microseconds), then sleep on a condition
// variable (between steps, or when idle), and a caller that works as thread 0 and then waits.
//
// TokenwireSetThreads(n) sets how many threads a product uses (the caller included); the engine
// sets it from the CPUs the process may use or from configuration; TokenwireThreads() reads it back.
// TokenwireLastThreads() says how many threads took a chunk of the last product (for tests).

#pragma once

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tokenwire {

class Pool {
 public:
  static Pool& Get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destruction
    return *pool;
  }

  void SetThreads(int n) { threads_.store(n < 1 ? 1 : (n > 256 ? 256 : n)); }
  int Threads() const { return threads_.load(); }
  int LastThreads() const { return last_.load(); }

  // Runs fn(begin, end) over [0, total) cut into chunks of at least `min_chunk` (multiples of 8),
  // on up to Threads() threads; returns when every chunk is done. Chunks are taken from a shared
  // counter, so the caller does them all if a worker is not scheduled (a loaded machine): it never
  // waits for a worker that has not started, only for chunks a worker is in the middle of.
  void Run(int64_t total, int64_t min_chunk, const std::function<void(int64_t, int64_t)>& fn) {
    std::lock_guard<std::mutex> run(run_mutex_);  // one product at a time (several models, threads)
    int n = Threads();
    int64_t chunk = std::max<int64_t>(min_chunk, (total + 4 * n - 1) / (4 * n));
    chunk = (chunk + 7) / 8 * 8;
    int64_t chunks = (total + chunk - 1) / chunk;
    if (n == 1 || chunks <= 1) {
      last_.store(1);
      fn(0, total);
      return;
    }
    Ensure(n - 1);
    job_ = &fn;
    job_total_ = total;
    job_chunk_ = chunk;
    done_.store(0, std::memory_order_relaxed);
    participants_.store(1, std::memory_order_relaxed);
    uint64_t g = ++job_generation_ & 0xffffffffu;
    // The job's generation and chunk count in one word, published after its other fields: a
    // worker still draining the previous job (its counter value says so) reads either that
    // job's word, and finds no chunk left, or this one's, and a generation not its own; with two
    // separate words it could pair the old generation with this job's count and run a chunk of
    // this job as the old one's, counted twice, so that Run returned early while it still ran.
    job_state_.store((g << 32) | static_cast<uint64_t>(chunks), std::memory_order_release);
    counter_.store(g << 32, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    Drain(g);
    for (int i = 0; done_.load(std::memory_order_acquire) < chunks; ++i) {
      if (i < 4096) _mm_pause(); else std::this_thread::yield();
    }
    last_.store(participants_.load());
  }

 private:
  Pool() : threads_(1) {}

  void Ensure(int workers) {
    while (static_cast<int>(workers_.size()) < workers) {
      int index = static_cast<int>(workers_.size()) + 1;
      uint64_t seen = generation_.load(std::memory_order_acquire);  // before the job it is made for
      workers_.emplace_back([this, index, seen] { Work(index, seen); });
      workers_.back().detach();
    }
  }

  // Worker `index` (1, 2, ...) takes part only while index < Threads(): workers made for an
  // earlier, larger thread count stay parked, so a product never runs on more threads than set.
  void Work(int index, uint64_t seen) {
    for (;;) {
      if (!SpinFor(seen)) {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (index < Threads()) Drain(0);
    }
  }

  // Take chunks of the current job until none is left. A value taken from the counter names its
  // job (high 32 bits), checked against the job's word (job_state_); a job cannot finish (nor its
  // fields change) while one of its chunks is out.
  void Drain(uint64_t caller_gen) {
    bool counted = caller_gen != 0;
    for (;;) {
      uint64_t v = counter_.fetch_add(1, std::memory_order_acq_rel);
      uint64_t g = v >> 32, i = v & 0xffffffffu;
      uint64_t state = job_state_.load(std::memory_order_acquire);
      if (g != state >> 32 || i >= (state & 0xffffffffu)) return;
      if (!counted) {
        participants_.fetch_add(1, std::memory_order_relaxed);
        counted = true;
      }
      int64_t begin = static_cast<int64_t>(i) * job_chunk_;
      (*job_)(begin, std::min(job_total_, begin + job_chunk_));
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  // Spin up to ~200 us for a new generation; true if one came.
  bool SpinFor(uint64_t seen) {
    auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    for (int i = 0;; ++i) {
      if (generation_.load(std::memory_order_acquire) != seen) return true;
      _mm_pause();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return false;
    }
  }

  std::atomic<int> threads_;
  std::atomic<int> last_{0};
  std::mutex run_mutex_, mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> counter_{0};
  std::atomic<uint64_t> job_state_{0};  // generation << 32 | chunks of the current job
  std::atomic<int64_t> done_{0};
  std::atomic<int> participants_{0};
  uint64_t job_generation_ = 0;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_total_ = 0, job_chunk_ = 1;
  std::vector<std::thread> workers_;
};

}  // namespace tokenwire
