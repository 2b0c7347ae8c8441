// Work sharing for the CPU kernels: a job's chunks are claimed from an atomic counter by
// the calling thread and by helpers on XLA's intra-op thread pool.
//
// Why helpers linger: a decode step makes a hundred-odd kernel calls a few tens of µs
// apart, and a pool thread woken for each of them started about as late as a call
// lasts, time in which the caller streamed the weights alone. A helper that has finished its chunks therefore waits a little (`kLinger`,
// yielding the core) for the next job, which the caller hands it through a one-job slot
// instead of waking another pool thread.
//
// The caller never waits for a helper to start: it drains every chunk no helper has
// claimed, and waits only for claimed chunks. So a job handed to a helper that is just
// leaving, or never run by a busy pool, costs speed, never correctness; a helper that
// finds an old job in the slot finds no chunk left and does nothing.
#ifndef SPECJAX_CPU_KERNELS_WORKERS_H_
#define SPECJAX_CPU_KERNELS_WORKERS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

namespace specjax {

// The threads for a job that reads `bytes` of weights: below 256 KiB the caller works alone.
// Waking (or keeping) a helper costs more than such a job, and a helper lingering after
// thousands of tiny calls (a test model's steps) takes a core from other processes.
inline int64_t ThreadsFor(int64_t bytes, int64_t pool_threads) {
  constexpr int64_t kParallelBytes = int64_t{256} << 10;
  return bytes < kParallelBytes ? 1 : pool_threads;
}

// Chunks [0, chunks) of some work; `Chunk(c)` must be safe to run on any thread.
class Job {
 public:
  explicit Job(int64_t chunks) : chunks_(chunks) {}
  virtual ~Job() = default;
  int64_t chunks() const { return chunks_; }

  // Runs chunks until none is left to claim.
  void Drain() {
    for (int64_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < chunks_;) {
      Chunk(c);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  // Drains, then waits for the chunks that helpers claimed.
  void Finish() {
    Drain();
    while (done_.load(std::memory_order_acquire) < chunks_) std::this_thread::yield();
  }

 protected:
  virtual void Chunk(int64_t c) = 0;

 private:
  const int64_t chunks_;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
};

// The helpers of one kernel library: those lingering, and the slot that hands them a job.
class Helpers {
 public:
  // How long a helper waits for the next job: longer than the gaps between a step's
  // matmuls (attention between q/k/v and o is the longest), short enough that a
  // pool thread is never kept from XLA's own work for long.
  static constexpr std::chrono::microseconds kLinger{300};

  // Runs `job` on the caller and up to `threads` - 1 helpers: lingering ones first, then
  // new ones started by `schedule(task)` on the pool.
  template <typename Schedule>
  void Run(const std::shared_ptr<Job>& job, int64_t threads, Schedule schedule) {
    const int64_t helpers = std::min<int64_t>(threads, job->chunks()) - 1;
    for (int64_t t = 0; t < helpers; ++t)
      if (!Hand(job)) schedule([this, job] { Help(job); });
    job->Finish();
  }

 private:
  // Offers `job` to a lingering helper; false when none is waiting or the slot is taken.
  bool Hand(const std::shared_ptr<Job>& job) {
    if (waiting_.load(std::memory_order_acquire) == 0) return false;
    auto* boxed = new std::shared_ptr<Job>(job);
    std::shared_ptr<Job>* empty = nullptr;
    if (slot_.compare_exchange_strong(empty, boxed, std::memory_order_acq_rel)) return true;
    delete boxed;
    return false;
  }

  // A helper's life on a pool thread: `job`, then any job handed over within kLinger.
  void Help(std::shared_ptr<Job> job) {
    job->Drain();
    job.reset();  // the caller may be waiting to free its buffers
    waiting_.fetch_add(1, std::memory_order_acq_rel);
    auto deadline = std::chrono::steady_clock::now() + kLinger;
    while (std::chrono::steady_clock::now() < deadline) {
      if (std::shared_ptr<Job>* boxed = slot_.exchange(nullptr, std::memory_order_acq_rel)) {
        std::shared_ptr<Job> next = std::move(*boxed);
        delete boxed;
        waiting_.fetch_sub(1, std::memory_order_acq_rel);
        next->Drain();
        next.reset();
        waiting_.fetch_add(1, std::memory_order_acq_rel);
        deadline = std::chrono::steady_clock::now() + kLinger;
      } else {
        std::this_thread::yield();
      }
    }
    waiting_.fetch_sub(1, std::memory_order_acq_rel);
  }

  std::atomic<int> waiting_{0};                       // helpers lingering now
  std::atomic<std::shared_ptr<Job>*> slot_{nullptr};  // a job for one of them
};

// Runs `job` on the caller and up to `threads` - 1 helpers on `pool` (XLA's FFI thread
// pool, or anything with `Schedule(task)`), through this library's one set of helpers.
template <typename Pool>
void RunOnPool(Pool& pool, const std::shared_ptr<Job>& job, int64_t threads) {
  static auto* helpers = new Helpers;  // never destroyed: a helper may linger past exit
  helpers->Run(job, threads, [&pool](auto task) { pool.Schedule(std::move(task)); });
}

// A helper that starts late costs at most one chunk when there are this many per thread.
constexpr int64_t kChunksPerThread = 2;

// Output rows [0, rows) as chunks of `chunk` rows, each `rows_fn(begin, end)`.
template <typename RowsFn>
class RowsJob : public Job {
 public:
  RowsJob(int64_t rows, int64_t chunk, RowsFn rows_fn)
      : Job((rows + chunk - 1) / chunk), rows_(rows), chunk_(chunk), rows_fn_(std::move(rows_fn)) {}

 protected:
  void Chunk(int64_t c) override { rows_fn_(c * chunk_, std::min(rows_, (c + 1) * chunk_)); }

 private:
  const int64_t rows_, chunk_;
  RowsFn rows_fn_;
};

// The row-parallel loop of the matmul kernels: output rows [0, rows) of a call that streams
// `bytes` of weights, in chunks of at least `min_rows` (about kChunksPerThread a thread),
// each run as `rows_fn(begin, end)` on the caller or a helper. Returns once every chunk is
// done, so `rows_fn` may hold references to the caller's locals (a helper left holding the
// job finds no chunk to run).
template <typename Pool, typename RowsFn>
void ParallelRows(Pool& pool, int64_t rows, int64_t bytes, int64_t min_rows, RowsFn rows_fn) {
  const int64_t threads = ThreadsFor(bytes, pool.num_threads());
  const int64_t pieces = kChunksPerThread * threads;
  const int64_t chunk = std::max(min_rows, (rows + pieces - 1) / pieces);
  RunOnPool(pool, std::make_shared<RowsJob<RowsFn>>(rows, chunk, std::move(rows_fn)), threads);
}

}  // namespace specjax

#endif  // SPECJAX_CPU_KERNELS_WORKERS_H_
