// A small persistent thread pool for the kernels, fork-safe.
//
// parallel_for(ntasks, fn, ctx) runs fn(ctx, i) for every i in [0, ntasks) on
// the calling thread plus the pool's workers; tasks are claimed through an
// atomic counter, so a worker that wakes late simply finds nothing left and
// never delays the caller (small products run on the caller alone).
//
// Workers spin briefly after a job (pause, then sched_yield: $QMV_SPIN_US, $QMV_YIELD_US),
// then sleep on a condition variable. The pool is created lazily on first use with
// num_threads() - 1 workers. After fork() the child has none of the parent's
// threads: a pthread_atfork child handler drops the pool state (leaking it on
// purpose: its mutex may have been held at fork time) and the next call builds
// a fresh pool in the child.
#pragma once

namespace qmv {

using TaskFn = void (*)(void* ctx, int task);

// Threads used per call (caller included); default: CPUs in the affinity mask,
// or $QMV_NUM_THREADS. Changing it rebuilds the pool on the next call.
int num_threads();
void set_num_threads(int n);

void parallel_for(int ntasks, TaskFn fn, void* ctx);

// Since the process started: pool runs (parallel_for calls that woke the pool), those a
// worker joined, the caller's time waiting for joined workers to finish their task, how
// often it slept for them (a worker preempted in its task: the cost of sharing the cores),
// and the jobs the caller then ran alone (pool.cpp: QMV_ADAPT).
struct PoolStats {
  long runs = 0, joined = 0, wait_ns = 0, slept = 0, alone = 0;
};
PoolStats pool_stats();

}  // namespace qmv
