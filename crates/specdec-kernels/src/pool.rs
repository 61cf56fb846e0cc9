//! A small fork-join thread pool for the matmuls and attention of one forward pass.
//!
//! The calling thread always takes part, so a pool of `n` threads starts `n - 1` workers. A job is split
//! into chunks dealt out in contiguous regions, one per thread: each participant claims its own
//! region's chunks in order and then moves the back half of another's into its own, so a thread
//! streams one run of memory, and a worker whose core is busy with another process simply claims
//! fewer chunks: the caller never waits for a worker that has not yet started on a job (it closes
//! the job when every chunk is claimed, and a late worker then skips it).
//! Workers spin briefly after a job, since the next one usually follows within microseconds, and then
//! sleep on a condition variable. Nothing is allocated per job.
//!
//! Splitting a matmul over output columns never changes a result: each output element is computed by
//! one participant with the same arithmetic, whichever participant that is.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

/// The most threads a pool takes: far past any CPU this runs on, and low enough that a mistyped
/// count is an error rather than thousands of spinning threads or an allocation that cannot succeed.
pub const MAX_THREADS: usize = 1024;

/// Spins of a worker waiting for the next job before it sleeps (a few tens of microseconds).
const SPINS: u32 = 1 << 14;

/// A job's state word: the job number in the high 32 bits, [`CLOSED`], and the number of workers that
/// entered the job in the low bits.
const CLOSED: u64 = 1 << 31;
const ENTERED: u64 = CLOSED - 1;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Job number, closed flag and entered count (see [`CLOSED`]).
    state: AtomicU64,
    /// Workers that finished the current job.
    done: AtomicUsize,
    /// The current job; written only by the caller while no worker can read it (before the job's
    /// number is published, or after every entered worker finished).
    job: UnsafeCell<Option<Job>>,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    /// The payload of the first panic of a worker in the current job, which [`ThreadPool::run`]
    /// resumes on the caller once every worker is done.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Shared {
    fn new() -> Shared {
        Shared {
            state: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            panic: Mutex::new(None),
        }
    }
}

// SAFETY: `job` is only written by the thread running `ThreadPool::run` while no worker reads it, and
// read by workers only between entering a job (an acquire of `state`) and reporting `done`; the
// pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A fork-join pool of a fixed number of threads (the caller included).
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
    /// Serialises `run` calls from different threads (one job at a time).
    running: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl ThreadPool {
    /// A pool of `threads` threads (at least 1): the caller and `threads - 1` workers.
    ///
    /// # Errors
    /// [`std::io::ErrorKind::InvalidInput`] for more than [`MAX_THREADS`] threads; the operating
    /// system's error if a worker thread cannot be started.
    pub fn new(threads: usize) -> std::io::Result<ThreadPool> {
        if threads > MAX_THREADS {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("at most {MAX_THREADS} threads"),
            ));
        }
        let threads = threads.max(1);
        let shared = Arc::new(Shared::new());
        let mut workers = Vec::with_capacity(threads - 1);
        for index in 1..threads {
            let mine = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("specdec-kernels-{index}"))
                .spawn(move || worker(&mine, index));
            match handle {
                Ok(h) => workers.push(h),
                Err(e) => {
                    stop(&shared, &mut workers);
                    return Err(e);
                }
            }
        }
        Ok(ThreadPool {
            shared,
            workers,
            threads,
            running: Mutex::new(()),
        })
    }

    /// The process-wide pool, one thread per available core, at most [`MAX_THREADS`] (made on first
    /// use).
    pub fn global() -> Arc<ThreadPool> {
        static GLOBAL: OnceLock<Arc<ThreadPool>> = OnceLock::new();
        Arc::clone(GLOBAL.get_or_init(|| {
            let n = std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(MAX_THREADS);
            // Falling back to the caller alone keeps every kernel working if threads cannot start.
            Arc::new(ThreadPool::new(n).unwrap_or_else(|_| ThreadPool::single()))
        }))
    }

    /// A pool of the calling thread alone.
    pub fn single() -> ThreadPool {
        ThreadPool {
            shared: Arc::new(Shared::new()),
            workers: Vec::new(),
            threads: 1,
            running: Mutex::new(()),
        }
    }

    /// Threads taking part in a job, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(participant)` on the caller (participant 0) and on every worker that starts before the
    /// caller finishes its own call; returns when every started call returned. `f` must itself share
    /// out the work (see [`ThreadPool::for_chunks`]): a participant may never be called.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            f(0);
            return;
        }
        // A poisoned lock only means another `run` panicked; the protocol state is still consistent
        // because that `run` waited for its workers before unwinding past `close`.
        let _one_job = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        let number = (s.state.load(Ordering::Relaxed) >> 32).wrapping_add(1) & 0xffff_ffff;
        // SAFETY: no worker reads `job` now: every worker of the previous job reported done, and none
        // can enter this one before `state` publishes its number below.
        unsafe {
            let erased: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f);
            *s.job.get() = Some(erased);
        }
        s.done.store(0, Ordering::Relaxed);
        s.state.store(number << 32, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        struct Close<'a>(&'a Shared);
        impl Drop for Close<'_> {
            // Runs even if `f` panics on the caller, so no worker is left holding a dangling job.
            fn drop(&mut self) {
                let s = self.0;
                let entered = (s.state.fetch_or(CLOSED, Ordering::SeqCst) & ENTERED) as usize;
                let mut spins = 0u32;
                while s.done.load(Ordering::Acquire) < entered {
                    spins = spins.saturating_add(1);
                    if spins < SPINS {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
        let close = Close(s);
        f(0);
        drop(close);
        // A worker's panic is the caller's: its chunks may be unwritten, so the job failed.
        let panic = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
    }

    /// Splits `0..n` into chunks of `chunk` (the last may be shorter; more than `u32::MAX` chunks are
    /// made larger) and calls `f` on each, spread over the pool's threads; returns when all are done.
    ///
    /// Thread `t` of `T` takes the chunks of the `t`-th of `T` contiguous regions of `0..n`, in order,
    /// and then takes over the back halves of the others' (see the module documentation).
    pub fn for_chunks(&self, n: usize, chunk: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let chunk = chunk.max(1).max(n.div_ceil(u32::MAX as usize));
        if self.workers.is_empty() || n <= chunk {
            let mut start = 0;
            while start < n {
                f(start..start.saturating_add(chunk).min(n));
                start += chunk;
            }
            return;
        }
        let regions = Regions::new(n.div_ceil(chunk), self.threads);
        self.run(&|participant| {
            regions.claim(participant, &mut |c| {
                let start = c * chunk;
                f(start..start.saturating_add(chunk).min(n));
            });
        });
    }
}

/// Most regions a job's chunks are dealt out in; participants beyond it only help.
const MAX_REGIONS: usize = 16;

/// The chunks `0..count` of one job dealt out in contiguous regions, one per participant.
///
/// A participant claims its own region's chunks from the front, in order, then moves the back half
/// of another region's unclaimed chunks into its own and goes on with those, so that while every
/// thread keeps up each reads one run of memory (a matmul's weight rows, its software prefetch
/// running ahead into its own next chunk), and a thread slowed by a busy core, or one that never
/// started, leaves its chunks to the others, who still read them forward. Until stop 44 every
/// participant claimed the next chunk of one shared counter, so the two threads took turns along a
/// matrix and each restarted its stream at every chunk: the 0.5B draft's steps took 9–11% longer
/// and the target's 4-token blocks 14% (`step_time`, alternated in one run). Stealing single chunks
/// from the other region's end instead of its back half made the target's steps 5–10% slower than
/// the shared counter's with a busy loop on one core (the thief read backwards, a fresh stream per
/// chunk); halves read forward, restarting at each steal.
struct Regions {
    /// Per region, its next chunk from the front (high 32 bits) and its end (low 32 bits).
    state: [AtomicU64; MAX_REGIONS],
    len: usize,
}

impl Regions {
    /// `count` chunks (at most `u32::MAX`) in `threads` regions (at most [`MAX_REGIONS`]).
    fn new(count: usize, threads: usize) -> Regions {
        let len = threads.clamp(1, MAX_REGIONS);
        let state = std::array::from_fn(|r| {
            // In 64 bits: `count · r` may not fit a 32-bit `usize`.
            let (count, r, len) = (count as u64, r as u64, len as u64);
            let (front, back) = if r < len {
                (count * r / len, count * (r + 1) / len)
            } else {
                (0, 0)
            };
            AtomicU64::new((front << 32) | back)
        });
        Regions { state, len }
    }

    /// Calls `f` on every chunk `participant` claims. The owner of region `r` (participant `r`)
    /// takes its chunks from the front, in order; once its region is empty it moves the back half
    /// of another region's unclaimed chunks into its own and goes on from their front, until none
    /// are left, so that even a participant doing another's work reads forward, restarting its
    /// stream only at each steal. Participants beyond the regions take single chunks from the
    /// regions' fronts.
    fn claim(&self, participant: usize, f: &mut dyn FnMut(usize)) {
        if participant >= self.len {
            for r in 0..self.len {
                while let Some(c) = self.take_front(r) {
                    f(c);
                }
            }
            return;
        }
        loop {
            while let Some(c) = self.take_front(participant) {
                f(c);
            }
            if !self.steal_half(participant) {
                return;
            }
        }
    }

    /// Region `r`'s first unclaimed chunk, claimed; `None` once it is empty.
    fn take_front(&self, r: usize) -> Option<usize> {
        self.state[r]
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
                let (first, end) = unpack(now);
                (first < end).then_some(now + (1 << 32))
            })
            .ok()
            .map(|was| unpack(was).0 as usize)
    }

    /// Moves the back half (rounded up) of the first other region with unclaimed chunks into
    /// region `own`, which must be empty; `false` once every region is empty. Only a region's
    /// owner stores into it, and only while it is empty, which no compare-and-swap ever changes
    /// (every claim and split first checks for unclaimed chunks); a word equal to one seen earlier
    /// holds the same unclaimed chunks, so a claim against it takes only chunks still unclaimed.
    fn steal_half(&self, own: usize) -> bool {
        for step in 1..self.len {
            let split = self.state[(own + step) % self.len].fetch_update(
                Ordering::Relaxed,
                Ordering::Relaxed,
                |now| {
                    let (first, end) = unpack(now);
                    (first < end).then(|| (first << 32) | (first + (end - first) / 2))
                },
            );
            if let Ok(was) = split {
                let (first, end) = unpack(was);
                let mid = first + (end - first) / 2;
                self.state[own].store((mid << 32) | end, Ordering::Relaxed);
                return true;
            }
        }
        false
    }
}

/// A region's word as (its first unclaimed chunk, its end).
fn unpack(word: u64) -> (u64, u64) {
    (word >> 32, word & 0xffff_ffff)
}

impl ThreadPool {
    /// Splits `data` into chunks of `chunk` elements (the last may be shorter) and calls `f(start,
    /// chunk)` on each, `start` being the chunk's first index in `data`, spread over the pool's threads
    /// as [`ThreadPool::for_chunks`] spreads ranges.
    pub fn for_chunks_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let (len, ptr) = (data.len(), SharedSlice(data.as_mut_ptr()));
        self.for_chunks(len, chunk, &|r| {
            let ptr = &ptr;
            // SAFETY: `for_chunks` hands out each range of `0..len` once, and the ranges are disjoint,
            // so no two calls see one element; `data` is borrowed mutably for the whole call.
            let part = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(r.start), r.len()) };
            f(r.start, part);
        });
    }
}

/// The elements of a slice shared by the calls of [`ThreadPool::for_chunks_mut`], each of which
/// takes a disjoint part.
struct SharedSlice<T>(*mut T);
// SAFETY: the calls touch disjoint elements, which may move between threads (`T: Send`).
unsafe impl<T: Send> Sync for SharedSlice<T> {}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        stop(&self.shared, &mut self.workers);
    }
}

fn stop(shared: &Shared, workers: &mut Vec<JoinHandle<()>>) {
    shared.shutdown.store(true, Ordering::SeqCst);
    {
        let _g = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
        shared.wake.notify_all();
    }
    for w in workers.drain(..) {
        // A worker that panicked has nothing left to clean up.
        let _ = w.join();
    }
}

fn worker(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for a job number other than the last one seen: spin, then sleep.
        let mut spins = 0u32;
        let state = loop {
            let state = s.state.load(Ordering::Acquire);
            if state >> 32 != seen || s.shutdown.load(Ordering::Relaxed) {
                break state;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.state.load(Ordering::SeqCst) >> 32 == seen && !s.shutdown.load(Ordering::SeqCst)
            {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            spins = 0;
        };
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        seen = state >> 32;
        // Enter the job unless the caller already closed it.
        let mut cur = state;
        let entered = loop {
            if cur >> 32 != seen || cur & CLOSED != 0 {
                break false;
            }
            match s
                .state
                .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break true,
                Err(now) => cur = now,
            }
        };
        if !entered {
            continue;
        }
        // SAFETY: this worker entered the open job, so the caller is waiting in `Close` for our `done`
        // and the job (and everything it borrows) is alive and unchanged until then.
        let job = unsafe { *s.job.get() };
        if let Some(job) = job {
            // SAFETY: as above.
            let f = unsafe { &*job };
            // A panic in `f` must still report done, or the caller would wait forever; the caller
            // resumes it once every worker is done.
            if let Err(payload) =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index)))
            {
                s.panic
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(payload);
            }
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_threads_than_the_limit_are_an_error() {
        let Err(e) = ThreadPool::new(MAX_THREADS + 1) else {
            panic!("a pool of more than MAX_THREADS threads started");
        };
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(ThreadPool::new(2).is_ok());
    }

    /// A worker's panic reaches the caller (its chunks are missing), and the pool runs the next
    /// job as before.
    #[test]
    fn a_workers_panic_is_resumed_on_the_caller() {
        let pool = ThreadPool::new(2).expect("threads start");
        let worker_in = AtomicBool::new(false);
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|participant| {
                if participant == 0 {
                    // Wait for the worker to enter (a worker that never starts is never called).
                    let start = std::time::Instant::now();
                    while !worker_in.load(Ordering::SeqCst)
                        && start.elapsed() < std::time::Duration::from_secs(30)
                    {
                        std::thread::yield_now();
                    }
                } else {
                    worker_in.store(true, Ordering::SeqCst);
                    panic!("a worker's bug");
                }
            })
        }));
        assert!(worker_in.load(Ordering::SeqCst), "the worker never started");
        let payload = got.expect_err("the worker's panic reached the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"a worker's bug"));
        let hits = AtomicUsize::new(0);
        pool.for_chunks(100, 1, &|r| {
            hits.fetch_add(r.len(), Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 100);
    }

    #[test]
    fn every_chunk_runs_exactly_once() {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads).expect("threads start");
            for n in [0usize, 1, 7, 64, 1000] {
                for chunk in [1usize, 3, 16, 2000] {
                    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    pool.for_chunks(n, chunk, &|r| {
                        for i in r {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        }
                    });
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                }
            }
        }
    }

    /// A participant alone (the others never started) takes its own region in order and then the
    /// back halves of the others', each in order; the regions split the chunks evenly.
    #[test]
    fn a_participant_reads_its_region_then_the_others_back_halves_in_order() {
        let regions = Regions::new(10, 2);
        let mut seen = Vec::new();
        regions.claim(1, &mut |c| seen.push(c));
        assert_eq!(seen, [5, 6, 7, 8, 9, 2, 3, 4, 1, 0]);
        let regions = Regions::new(7, 3);
        let mut seen = Vec::new();
        regions.claim(0, &mut |c| seen.push(c));
        assert_eq!(seen, [0, 1, 3, 2, 5, 6, 4]);
        // More participants than regions share them; fewer chunks than regions leave some empty.
        let regions = Regions::new(2, 40);
        let mut seen = Vec::new();
        regions.claim(39, &mut |c| seen.push(c));
        seen.sort_unstable();
        assert_eq!(seen, [0, 1]);
    }

    /// Concurrent participants, more of them than regions, claim every chunk exactly once.
    #[test]
    fn concurrent_claims_take_every_chunk_once() {
        for (count, threads, participants) in [(1000, 2, 2), (999, 3, 5), (64, 16, 20), (5, 8, 8)] {
            let regions = Regions::new(count, threads);
            let hits: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
            std::thread::scope(|s| {
                for p in 0..participants {
                    let (regions, hits) = (&regions, &hits);
                    s.spawn(move || {
                        regions.claim(p, &mut |c| {
                            hits[c].fetch_add(1, Ordering::Relaxed);
                        })
                    });
                }
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn mutable_chunks_cover_the_slice_once_at_their_offsets() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads).expect("threads start");
            for n in [0usize, 1, 7, 1000] {
                for chunk in [1usize, 3, 64, 2000] {
                    let mut data = vec![0usize; n];
                    pool.for_chunks_mut(&mut data, chunk, &|start, part| {
                        for (i, v) in part.iter_mut().enumerate() {
                            *v += start + i + 1;
                        }
                    });
                    assert!(data.iter().enumerate().all(|(i, &v)| v == i + 1));
                }
            }
        }
    }

    #[test]
    fn many_small_jobs_in_a_row_complete() {
        let pool = ThreadPool::new(2).expect("threads start");
        let total = AtomicUsize::new(0);
        for _ in 0..20_000 {
            pool.for_chunks(4, 1, &|r| {
                total.fetch_add(r.len(), Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 80_000);
    }

    #[test]
    fn jobs_after_a_sleep_still_run() {
        let pool = ThreadPool::new(3).expect("threads start");
        let total = AtomicUsize::new(0);
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            pool.for_chunks(100, 1, &|r| {
                total.fetch_add(r.len(), Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 300);
    }
}
