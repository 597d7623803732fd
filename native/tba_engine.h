/*
 * tba_engine: asynchronous positional reads and writes for tba's spill files.
 *
 * A plain C ABI (no Python headers), loaded from Python with ctypes. Two modes behind one API:
 *   - io_uring, driven through the raw syscalls (no liburing), with an optional registered
 *     buffer table (READ_FIXED / WRITE_FIXED) and a registered file table;
 *   - a pool of pthreads doing pread/pwrite, used when io_uring cannot be set up (EPERM under
 *     a seccomp profile, ENOSYS, kernel.io_uring_disabled, a kernel without the needed ops).
 *
 * Every function returns 0 (or a count, handle or id >= 0) on success and -errno on failure.
 * Nothing asserts, aborts, prints or reads the environment.
 *
 * An op moves all of its bytes or fails: a short transfer is resubmitted for the remainder,
 * from the last multiple of the op's alignment unit; EAGAIN, EINTR and ECANCELED are retried a
 * bounded number of times; a read that returns 0 bytes fails with EIO (never zero-fills); an op
 * that makes no progress for max_stalls attempts fails with EIO.
 *
 * Processes: only the process that opened an engine may submit or reap (a forked child shares
 * the ring with its parent): elsewhere those return -ECHILD, and tba_engine_close only releases
 * the child's own copies of the mappings and fds.
 *
 * Bandwidth caps: tba_engine_set_rate caps reads or writes at a rate in bytes per second, with
 * a token bucket per direction. An op leaves the engine's queue for the kernel (or a worker
 * thread) only once its direction's bucket holds its whole length; until then it waits, in
 * submission order, and submitting still never blocks. Reads and writes queue apart, so a
 * capped direction never holds back the other. An op longer than the burst is never split and
 * never runs the bucket into debt: while it waits at the head of its queue the bucket may fill
 * up to its length. While ops are queued the bucket may also keep 100 ms of the rate beyond
 * that, so a late release is made up. See native/README.md, "Bandwidth caps".
 *
 * Threads: tba_engine_submit, add/remove_file, register/unregister_buffer, inject, info, wake,
 * set_rate and shutdown may be called from any thread at any time. tba_engine_reap is meant for
 * one reaper thread (concurrent callers are serialised). tba_engine_close must not race with any
 * other call on the same engine.
 */
#ifndef TBA_ENGINE_H
#define TBA_ENGINE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TBA_ENGINE_ABI 3

/* Operations, for tba_engine_submit (READ, WRITE) and tba_engine_inject (all four). */
enum tba_op {
    TBA_OP_READ = 0,
    TBA_OP_WRITE = 1,
    TBA_OP_REGISTER_BUFFER = 2, /* inject only: tba_engine_register_buffer */
    TBA_OP_ADD_FILE = 3,        /* inject only: the file-table update in tba_engine_add_file */
};

/* Injection kinds (tests only). */
enum tba_inject_kind {
    TBA_INJECT_CLEAR = 0, /* drop every pending rule of this op */
    TBA_INJECT_SHORT = 1, /* submit at most `value` bytes (rounded up to the op's unit), and
                             report at most `value` bytes done: the real resubmission runs */
    TBA_INJECT_FAIL = 2,  /* the attempt completes with -value (a NOP goes through the ring) */
    TBA_INJECT_CLOCK = 3, /* engine-wide (op READ or WRITE): each of the engine's next `count`
                             clock readings lands `value` ns later than the real clock says,
                             on top of the jumps before it (the clock never goes back). For the
                             caps' timing in io_uring mode; threads mode's timed waits would
                             wait the jumps out in real time (ABI 3) */
};

enum tba_kind {
    TBA_KIND_IO_URING = 1,
    TBA_KIND_THREADS = 2,
};

/* Where io_uring setup stopped (tba_engine_info.setup_stage). */
enum tba_stage {
    TBA_STAGE_NONE = 0,
    TBA_STAGE_SETUP = 1,   /* io_uring_setup */
    TBA_STAGE_MMAP = 2,    /* mapping the rings */
    TBA_STAGE_PROBE = 3,   /* IORING_REGISTER_PROBE, or an opcode we need is missing */
    TBA_STAGE_EVENTFD = 4, /* the reaper's wake-up eventfd */
    TBA_STAGE_FORCED = 5,  /* TBA_OPEN_THREADS asked for the thread pool */
};

/* Why an op finished (tba_completion.why). */
enum tba_why {
    TBA_WHY_OK = 0,
    TBA_WHY_ERRNO = 1,   /* the kernel (or an injection) returned result */
    TBA_WHY_EOF = 2,     /* a read returned 0 bytes: result is -EIO */
    TBA_WHY_STALLED = 3, /* no progress in `tries` attempts: result is -EIO */
    TBA_WHY_RETRIES = 4, /* EAGAIN/EINTR/ECANCELED more than max_again times */
    TBA_WHY_SUBMIT = 5,  /* io_uring_enter refused the submission itself */
};

/* Open flags. */
#define TBA_OPEN_THREADS (1u << 0) /* do not try io_uring */

struct tba_engine_config {
    uint32_t size;                /* sizeof(struct tba_engine_config) */
    uint32_t depth;               /* ops in flight: ring entries, or worker threads (>= 1) */
    uint32_t flags;               /* TBA_OPEN_* */
    int32_t simulate_setup_errno; /* > 0: io_uring_setup "fails" with this errno (tests) */
    uint32_t max_files;           /* registered-file table slots; 0: 256 */
    uint32_t max_buffers;         /* registered-buffer table slots; 0: 16 */
    uint32_t max_again;           /* EAGAIN/EINTR/ECANCELED retries per op; 0: 16 */
    uint32_t max_stalls;          /* attempts without progress before EIO; 0: 8 */
};

struct tba_engine_info {
    uint32_t size;               /* set by the caller: sizeof(struct tba_engine_info) */
    int32_t kind;                /* TBA_KIND_* */
    uint32_t depth;              /* ops in flight at most */
    uint32_t ring_entries;       /* SQ entries (0 in threads mode) */
    uint32_t features;           /* io_uring_params.features */
    int32_t setup_errno;         /* why io_uring is not used (0 when it is) */
    int32_t setup_stage;         /* TBA_STAGE_* where it failed */
    int32_t files_errno;         /* why the file table is not registered, or the last per-file
                                    registration failure (0: none) */
    uint32_t files_table;        /* slots in the registered file table (0: plain fds only) */
    uint32_t files_registered;   /* files now in the table */
    uint32_t files_plain;        /* files now used through their plain fd */
    int32_t buffers_errno;       /* the last buffer registration failure (0: none) */
    uint32_t buffers_registered; /* regions now registered */
    uint32_t threads;            /* worker threads (threads mode) */
    uint64_t buffer_bytes;       /* bytes now registered */
    uint64_t ops_fixed;          /* attempts that used READ_FIXED / WRITE_FIXED */
    uint64_t ops_plain;          /* attempts with an unregistered buffer */
    uint64_t resubmit_short;     /* resubmissions after a short transfer */
    uint64_t resubmit_again;     /* resubmissions after EAGAIN / EINTR / ECANCELED */
    uint64_t injected;           /* attempts changed by an injection rule */
    uint64_t outstanding;        /* ops submitted and not yet returned by reap */
    /* Bandwidth caps (ABI 2). */
    uint64_t rate_read;          /* bytes per second; 0: no cap */
    uint64_t rate_write;
    uint64_t burst_read;         /* bytes the bucket holds at most (0 when there is no cap) */
    uint64_t burst_write;
    uint64_t throttle_ns_read;   /* total time an op waited at the head of its queue for tokens,
                                    the current wait included; the waits never overlap */
    uint64_t throttle_ns_write;
    uint64_t queued_read;        /* ops submitted and not yet handed to the kernel or a worker
                                    (waiting for tokens, or for a free slot) */
    uint64_t queued_write;
};

struct tba_completion {
    uint64_t user_data;
    int64_t result; /* bytes moved (the op's whole length), or -errno */
    uint64_t done;  /* on failure: bytes known good from the op's start (where it failed) */
    uint32_t why;   /* TBA_WHY_* */
    uint32_t tries; /* attempts made; for TBA_WHY_STALLED, attempts without progress */
};

struct tba_engine;

int tba_engine_abi(void);

/* Opens an engine. io_uring is tried first (unless TBA_OPEN_THREADS); when it cannot be set up
 * the engine runs `depth` threads instead and tba_engine_info says why. Fails only when neither
 * works (-ENOMEM, -EAGAIN from pthread_create, -EINVAL for a bad config). */
int tba_engine_open(const struct tba_engine_config *cfg, struct tba_engine **out);

int tba_engine_info(struct tba_engine *eng, struct tba_engine_info *info);

/* Makes `fd` usable by submit; returns a handle >= 0. The engine registers it in the ring's
 * file table when it can (else uses the fd itself); the caller keeps the fd open until
 * tba_engine_remove_file, which must not be called while ops on the handle are in flight. */
int tba_engine_add_file(struct tba_engine *eng, int fd);
int tba_engine_remove_file(struct tba_engine *eng, int handle);

/* Registers [addr, addr + len) with IORING_REGISTER_BUFFERS(2); returns a region id >= 0.
 * Ops whose buffer lies inside one registered 1 GiB chunk use READ_FIXED / WRITE_FIXED.
 * -EOPNOTSUPP in threads mode; -ENOMEM when RLIMIT_MEMLOCK refuses; the memory must stay
 * valid until tba_engine_unregister_buffer or tba_engine_close. */
int tba_engine_register_buffer(struct tba_engine *eng, void *addr, uint64_t len);
int tba_engine_unregister_buffer(struct tba_engine *eng, int region);

/* Queues one read or write of len bytes at offset; never blocks on I/O. The op's result comes
 * back from tba_engine_reap with user_data. unit: resume a short transfer from a multiple of
 * it (the device's O_DIRECT unit; 0 or 1 for buffered files). -ESHUTDOWN after shutdown. */
int tba_engine_submit(struct tba_engine *eng, int op, int handle, void *buf, uint64_t len,
                      uint64_t offset, uint32_t unit, uint64_t user_data);

/* Waits up to timeout_ms (-1: no limit, 0: do not wait) for finished ops and stores up to max
 * of them in out. Returns their count (0 on time-out or tba_engine_wake), or -ESHUTDOWN once
 * tba_engine_shutdown was called and every op submitted before it has been returned. */
int tba_engine_reap(struct tba_engine *eng, struct tba_completion *out, int max, int timeout_ms);

/* Caps op (TBA_OP_READ or TBA_OP_WRITE) at bytes_per_sec (0: no cap) with a bucket of burst
 * bytes (0: the default, max(1 MiB, 20 ms of the rate)). Takes effect at once, also for ops
 * already queued: a lower rate holds them longer, removing the cap releases them. A new cap
 * starts with a full bucket; changing a cap keeps the tokens (at most the new burst).
 * In io_uring mode the ops held by a cap are released by tba_engine_reap, which sleeps no
 * longer than until the next one may go, and by tba_engine_submit; keep a reaper in reap (or
 * call it with timeout 0 now and then). In threads mode the idle workers release them.
 * tba_engine_shutdown lifts both caps: what is still queued then goes at full speed.
 * -EINVAL for another op, -ECHILD in a forked child. */
int tba_engine_set_rate(struct tba_engine *eng, int op, uint64_t bytes_per_sec, uint64_t burst);

/* Makes a blocked (or the next) tba_engine_reap return 0. */
int tba_engine_wake(struct tba_engine *eng);

/* Tests only: the next `count` attempts of `op` (a resubmission is an attempt too) follow
 * `kind` with `value` (bytes for SHORT, an errno for FAIL). Rules queue up in order (at most
 * 8 per op). -ENOSPC when the queue is full. CLOCK is no rule: it moves the engine's clock
 * (see tba_inject_kind) and replaces a CLOCK set before. */
int tba_engine_inject(struct tba_engine *eng, int op, int kind, int64_t value, int count);

/* Refuses new ops, lifts the bandwidth caps (ops waiting for tokens go at once) and wakes the
 * reaper, which returns the remaining ones then -ESHUTDOWN. */
int tba_engine_shutdown(struct tba_engine *eng);

/* Shuts down, waits for every op still in flight (discarding results no one reaped), and frees
 * everything: the ring, its registrations, the threads, the eventfd. */
int tba_engine_close(struct tba_engine *eng);

#ifdef __cplusplus
}
#endif

#endif /* TBA_ENGINE_H */
