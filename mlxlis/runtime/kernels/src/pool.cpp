#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define QMV_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define QMV_PAUSE() asm volatile("yield")
#else
#define QMV_PAUSE() ((void)0)
#endif

namespace qmv {

namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// How long a worker waits for the next job before it sleeps: spinning (pause) for spin_us,
// then giving its time slice away (sched_yield) for yield_us; $QMV_SPIN_US / $QMV_YIELD_US.
// Timed, not counted: a pause is ~10 cycles on some x86 cores and ~140 on others.
struct Waits {
  int64_t spin_ns, yield_ns;
};

int64_t us_or(const char* v, int64_t fallback) { return v && *v ? atoll(v) : fallback; }

const Waits& waits() {
  static const Waits w{us_or(getenv("QMV_SPIN_US"), 100) * 1000,
                       us_or(getenv("QMV_YIELD_US"), 2000) * 1000};
  return w;
}

std::atomic<long> s_runs{0}, s_joined{0}, s_wait_ns{0}, s_slept{0};

constexpr uint64_t kClosed = 1ull << 31;   // job state: no more joins
constexpr uint64_t kCountMask = kClosed - 1;  // job state: workers inside

class Pool {
 public:
  explicit Pool(int nworkers) {
    for (int i = 0; i < nworkers; ++i) threads_.emplace_back([this] { worker(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return int(threads_.size()); }

  // Runs the job; returns how long the caller then waited for joined workers (ns).
  int64_t run(int ntasks, TaskFn fn, void* ctx) {
    fn_ = fn;
    ctx_ = ctx;
    ntasks_ = ntasks;
    next_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (job_.load(std::memory_order_relaxed) >> 32) + 1;
    job_.store(gen << 32, std::memory_order_release);  // open, nobody inside
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (sleeping_ > 0) wake_.notify_all();
    }
    work();
    // close the job; wait for the workers that joined to finish their task
    uint64_t s = job_.fetch_or(kClosed, std::memory_order_acq_rel) | kClosed;
    s_runs.fetch_add(1, std::memory_order_relaxed);
    if ((s & kCountMask) == 0) return 0;  // nobody joined, or all are done
    s_joined.fetch_add(1, std::memory_order_relaxed);
    const int64_t t0 = now_ns();
    for (int spin = 0; (s & kCountMask) != 0 && spin < 1 << 16; ++spin) {
      QMV_PAUSE();
      s = job_.load(std::memory_order_acquire);
    }
    if ((s & kCountMask) != 0) {
      s_slept.fetch_add(1, std::memory_order_relaxed);
      std::unique_lock<std::mutex> lk(mu_);
      done_.wait(lk, [&] { return (job_.load(std::memory_order_acquire) & kCountMask) == 0; });
    }
    const int64_t waited = now_ns() - t0;
    s_wait_ns.fetch_add(waited, std::memory_order_relaxed);
    return waited;
  }

 private:
  void work() {
    for (int t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < ntasks_;) fn_(ctx_, t);
  }

  void worker() {
    uint64_t seen = 0;  // generation last looked at
    for (;;) {
      // wait for a new generation: spin, then yield, then sleep (waits())
      uint64_t s = job_.load(std::memory_order_acquire);
      const Waits& w = waits();
      const int64_t t0 = now_ns();
      bool yielding = false;
      for (int spin = 1; (s >> 32) == seen; ++spin) {
        if (yielding || (spin & 63) == 0) {  // the clock every 64 pauses, or every yield
          const int64_t t = now_ns() - t0;
          if (t >= w.spin_ns + w.yield_ns) break;
          yielding = t >= w.spin_ns;
        }
        if (yielding) {
          sched_yield();
        } else {
          QMV_PAUSE();
        }
        s = job_.load(std::memory_order_acquire);
      }
      if ((s >> 32) == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        ++sleeping_;
        wake_.wait(lk, [&] { return stop_ || (job_.load() >> 32) != seen; });
        --sleeping_;
        if (stop_) return;
        s = job_.load(std::memory_order_acquire);
      }
      seen = s >> 32;
      // join unless the caller already closed this job
      bool joined = false;
      while (!(s & kClosed) && (s >> 32) == seen) {
        if (job_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
          joined = true;
          break;
        }
      }
      if (!joined) continue;
      work();
      const uint64_t after = job_.fetch_sub(1, std::memory_order_acq_rel) - 1;
      if ((after & kCountMask) == 0 && (after & kClosed)) {
        std::lock_guard<std::mutex> lk(mu_);
        done_.notify_all();
      }
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  int sleeping_ = 0;
  bool stop_ = false;
  // generation << 32 | closed bit | workers inside
  std::atomic<uint64_t> job_{0};
  std::atomic<int> next_{0};
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int ntasks_ = 0;
};

// Cores shared with other work (another process, this one's Python thread building the next
// step): a worker preempted inside its task holds the caller until it runs again, a time
// slice, far longer than the product. Where the caller spent over a quarter of a window of
// runs waiting so ($QMV_ADAPT: the fraction, 0 never), it runs the next kAlone jobs on its
// own, then tries the workers again.
constexpr int kWindow = 64, kAlone = 1024;

double adapt_fraction() {
  static const double f = [] {
    const char* v = getenv("QMV_ADAPT");
    return v && *v ? atof(v) : 0.25;
  }();
  return f;
}

std::atomic<long> s_alone{0};

// Everything a fork must reset lives here; the child handler replaces it.
struct State {
  std::mutex mu;  // one caller at a time uses the pool
  Pool* pool = nullptr;
  int64_t busy_ns = 0, wait_ns = 0;  // this window's jobs: their time, the caller's waits
  int runs = 0, alone = 0;           // jobs in this window; jobs left to run alone
};

State* g_state = nullptr;
std::mutex g_state_mu;  // only guards the creation of g_state
std::atomic<int> g_threads{0};

void atfork_child() {
  // Called in the child, single-threaded. The old pool's threads do not exist
  // here and its mutexes may be locked: leak it, start over on next use.
  g_state = nullptr;
  new (&g_state_mu) std::mutex();
}

int default_threads() {
  if (const char* env = getenv("QMV_NUM_THREADS")) {
    int n = atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n ? int(n) : 1;
}

State* state() {
  std::lock_guard<std::mutex> lk(g_state_mu);
  if (!g_state) {
    static bool registered = [] {
      pthread_atfork(nullptr, nullptr, atfork_child);
      return true;
    }();
    (void)registered;
    g_state = new State();
  }
  return g_state;
}

}  // namespace

int num_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  if (n <= 0) {
    n = default_threads();
    g_threads.store(n, std::memory_order_relaxed);
  }
  return n;
}

PoolStats pool_stats() {
  return {s_runs.load(), s_joined.load(), s_wait_ns.load(), s_slept.load(), s_alone.load()};
}

void set_num_threads(int n) { g_threads.store(n > 0 ? n : default_threads()); }

void parallel_for(int ntasks, TaskFn fn, void* ctx) {
  const int want = num_threads() - 1;  // workers besides the caller
  if (ntasks <= 1 || want <= 0) {
    for (int t = 0; t < ntasks; ++t) fn(ctx, t);
    return;
  }
  State* st = state();
  std::unique_lock<std::mutex> lk(st->mu, std::try_to_lock);
  if (!lk.owns_lock()) {  // another thread (another MLX stream) has the pool
    for (int t = 0; t < ntasks; ++t) fn(ctx, t);
    return;
  }
  if (st->alone > 0) {
    --st->alone;
    s_alone.fetch_add(1, std::memory_order_relaxed);
    for (int t = 0; t < ntasks; ++t) fn(ctx, t);
    return;
  }
  if (!st->pool || st->pool->size() != want) {
    delete st->pool;
    st->pool = new Pool(want);
  }
  const int64_t t0 = now_ns();
  st->wait_ns += st->pool->run(ntasks, fn, ctx);
  st->busy_ns += now_ns() - t0;
  if (++st->runs == kWindow) {
    const double f = adapt_fraction();
    if (f > 0 && double(st->wait_ns) > f * double(st->busy_ns)) st->alone = kAlone;
    st->runs = 0, st->busy_ns = st->wait_ns = 0;
  }
}

}  // namespace qmv
