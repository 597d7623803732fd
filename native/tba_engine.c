/*
 * tba_engine: see tba_engine.h for the API and native/README.md for the design.
 *
 * Layout of this file:
 *   1. our own copy of the io_uring kernel ABI (checked against <linux/io_uring.h> when present)
 *   2. the engine state, op bookkeeping and the completion rules shared by both modes, and
 *      the bandwidth caps (a token bucket per direction)
 *   3. io_uring mode: setup, submission ring, completion ring, registrations
 *   4. threads mode: workers doing pread/pwrite
 *   5. the public functions
 *
 * Queues: submitted ops wait in one FIFO per direction (pend[TBA_OP_READ], pend[TBA_OP_WRITE]);
 * pend_next hands out the oldest head whose direction's bucket has tokens for it, so a capped
 * direction never holds back the other one.
 *
 * Locking: `lock` guards everything but the completion ring, which only the reaper reads
 * (under `reap_lock`). Counters read by tba_engine_info are updated with __atomic builtins.
 * Ring memory ordering (no SQPOLL, so the kernel reads the SQ only inside io_uring_enter):
 *   - we fill an SQE and its array slot, then store the SQ tail with RELEASE;
 *   - we load the SQ head with ACQUIRE before reusing a slot the kernel has consumed;
 *   - we load the CQ tail with ACQUIRE before reading CQEs, and store the CQ head with RELEASE
 *     after we are done with them.
 */
#define _GNU_SOURCE
#include "tba_engine.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------ */
/* 1. The io_uring ABI                                                                        */
/* ------------------------------------------------------------------------------------------ */

/* io_uring came after the syscall tables were unified: the same numbers on every architecture
 * but alpha. */
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

struct k_sq_offsets {
    uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
    uint64_t resv2;
};

struct k_cq_offsets {
    uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
    uint64_t resv2;
};

struct k_params {
    uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd;
    uint32_t resv[3];
    struct k_sq_offsets sq_off;
    struct k_cq_offsets cq_off;
};

/* The 64-byte submission entry, with only the members a read or write uses. */
struct k_sqe {
    uint8_t opcode;
    uint8_t flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off;
    uint64_t addr;
    uint32_t len;
    uint32_t rw_flags;
    uint64_t user_data;
    uint16_t buf_index;
    uint16_t personality;
    uint32_t file_index;
    uint64_t addr3;
    uint64_t pad2;
};

struct k_cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
};

struct k_rsrc_register { /* IORING_REGISTER_FILES2 / BUFFERS2 */
    uint32_t nr, flags;
    uint64_t resv2, data, tags;
};

struct k_rsrc_update2 { /* IORING_REGISTER_BUFFERS_UPDATE */
    uint32_t offset, resv;
    uint64_t data, tags;
    uint32_t nr, resv2;
};

struct k_files_update { /* IORING_REGISTER_FILES_UPDATE */
    uint32_t offset, resv;
    uint64_t fds;
};

struct k_probe_op {
    uint8_t op, resv;
    uint16_t flags;
    uint32_t resv2;
};

#define K_PROBE_OPS 256
struct k_probe {
    uint8_t last_op, ops_len;
    uint16_t resv;
    uint32_t resv2[3];
    struct k_probe_op ops[K_PROBE_OPS];
};

#define K_SETUP_CLAMP (1u << 4)
#define K_SETUP_SUBMIT_ALL (1u << 7)
#define K_FEAT_SINGLE_MMAP (1u << 0)
#define K_OFF_SQ_RING 0ull
#define K_OFF_CQ_RING 0x8000000ull
#define K_OFF_SQES 0x10000000ull
#define K_SQ_CQ_OVERFLOW (1u << 1)
#define K_ENTER_GETEVENTS (1u << 0)
#define K_SQE_FIXED_FILE (1u << 0)
#define K_RSRC_SPARSE (1u << 0)
#define K_OP_SUPPORTED (1u << 0)

/* opcodes */
#define K_OP_NOP 0
#define K_OP_READ_FIXED 4
#define K_OP_WRITE_FIXED 5
#define K_OP_READ 22
#define K_OP_WRITE 23

/* io_uring_register opcodes */
#define K_REG_BUFFERS 0
#define K_UNREG_BUFFERS 1
#define K_REG_FILES 2
#define K_REG_FILES_UPDATE 6
#define K_REG_PROBE 8
#define K_REG_FILES2 13
#define K_REG_BUFFERS2 15
#define K_REG_BUFFERS_UPDATE 16

_Static_assert(sizeof(struct k_sqe) == 64, "sqe is 64 bytes");
_Static_assert(sizeof(struct k_cqe) == 16, "cqe is 16 bytes");
_Static_assert(sizeof(struct k_params) == 120, "io_uring_params is 120 bytes");
_Static_assert(offsetof(struct k_sqe, user_data) == 32, "sqe.user_data");
_Static_assert(offsetof(struct k_sqe, buf_index) == 40, "sqe.buf_index");

#if defined(__has_include)
#if __has_include(<linux/io_uring.h>)
/* Where the kernel's header exists, make sure our copy matches it. */
#include <linux/io_uring.h>
_Static_assert(sizeof(struct k_sqe) == sizeof(struct io_uring_sqe), "sqe size");
_Static_assert(sizeof(struct k_params) == sizeof(struct io_uring_params), "params size");
_Static_assert(offsetof(struct k_sqe, off) == offsetof(struct io_uring_sqe, off), "sqe.off");
_Static_assert(offsetof(struct k_sqe, addr) == offsetof(struct io_uring_sqe, addr), "sqe.addr");
_Static_assert(offsetof(struct k_sqe, len) == offsetof(struct io_uring_sqe, len), "sqe.len");
_Static_assert(offsetof(struct k_sqe, buf_index) == offsetof(struct io_uring_sqe, buf_index),
               "sqe.buf_index");
_Static_assert(offsetof(struct k_params, sq_off) == offsetof(struct io_uring_params, sq_off),
               "params.sq_off");
_Static_assert(offsetof(struct k_params, cq_off) == offsetof(struct io_uring_params, cq_off),
               "params.cq_off");
_Static_assert(sizeof(struct k_rsrc_register) == sizeof(struct io_uring_rsrc_register),
               "rsrc_register");
_Static_assert(sizeof(struct k_rsrc_update2) == sizeof(struct io_uring_rsrc_update2),
               "rsrc_update2");
_Static_assert(K_OP_READ_FIXED == IORING_OP_READ_FIXED && K_OP_WRITE_FIXED == IORING_OP_WRITE_FIXED,
               "fixed opcodes");
_Static_assert(K_OP_READ == IORING_OP_READ && K_OP_WRITE == IORING_OP_WRITE, "rw opcodes");
_Static_assert(K_REG_FILES2 == IORING_REGISTER_FILES2 && K_REG_BUFFERS2 == IORING_REGISTER_BUFFERS2
                   && K_REG_BUFFERS_UPDATE == IORING_REGISTER_BUFFERS_UPDATE
                   && K_REG_FILES_UPDATE == IORING_REGISTER_FILES_UPDATE
                   && K_REG_PROBE == IORING_REGISTER_PROBE,
               "register opcodes");
_Static_assert(K_SETUP_SUBMIT_ALL == IORING_SETUP_SUBMIT_ALL && K_SETUP_CLAMP == IORING_SETUP_CLAMP,
               "setup flags");
_Static_assert(K_OFF_SQES == IORING_OFF_SQES && K_OFF_CQ_RING == IORING_OFF_CQ_RING, "mmap offsets");
#endif
#endif

static int sys_setup(unsigned entries, struct k_params *p)
{
    long rc = syscall(__NR_io_uring_setup, entries, p);
    return rc < 0 ? -errno : (int)rc;
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    long rc = syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, (size_t)0);
    return rc < 0 ? -errno : (int)rc;
}

static int sys_register(int fd, unsigned opcode, const void *arg, unsigned nr_args)
{
    long rc = syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
    return rc < 0 ? -errno : (int)rc;
}

/* ------------------------------------------------------------------------------------------ */
/* 2. Engine state and the completion rules                                                   */
/* ------------------------------------------------------------------------------------------ */

#define CHUNK (1ull << 30)  /* largest registered buffer, and largest single request */
#define MAX_RULES 8         /* injection rules queued per op */
#define N_RULE_OPS 4        /* TBA_OP_READ .. TBA_OP_ADD_FILE */
#define MAX_HANDLES (1 << 20)
#define MAX_DEPTH 32768u
#define BUSY_TRIES 200      /* io_uring_enter EAGAIN/EBUSY/EINTR retries, 1 ms apart */

struct op {
    struct op *next;
    uint64_t user_data;
    char *buf;
    uint64_t len, offset;
    uint64_t pos;     /* bytes known done from the start */
    uint64_t cap;     /* injected: report at most this many bytes for the current attempt */
    int code;         /* TBA_OP_READ / TBA_OP_WRITE */
    int handle;
    int fd;           /* threads mode: resolved when a worker takes the op */
    int inj_errno;    /* injected: the current attempt fails with this errno */
    uint32_t unit;
    uint32_t again, stalls, tries;
    uint32_t why;
    int admitted;     /* its tokens are paid: never charged again (a retry, a requeue) */
    uint64_t seq;     /* submission order, across both directions */
    int64_t result;
};

struct file_ent {
    int fd;
    int slot; /* index in the registered file table, or -1 */
    int used;
};

struct region {
    uint64_t base, len;
    uint32_t first, count; /* slots of the buffer table, one per 1 GiB chunk */
    int used;
};

struct rule {
    int kind;
    int64_t value;
    int count;
};

enum { BUF_UNTRIED = 0, BUF_SPARSE = 1, BUF_LEGACY_BUSY = 2, BUF_LEGACY_IDLE = 3 };

/* A token bucket capping one direction (see "Bandwidth caps" in native/README.md). Tokens are
 * bytes; they accrue at `rate` up to `burst`. While there is a backlog the ceiling rises to the
 * head op's length when that is longer (pay before, no debt, no splitting), plus CATCH_UP_S of
 * the rate (a late release is made up, idle time is not). Guarded by `lock`. */
struct bucket {
    uint64_t rate;         /* bytes per second; 0: no cap */
    uint64_t burst;        /* bytes */
    double tokens;
    int64_t stamp;         /* when `tokens` was last brought up to date (ns, CLOCK_MONOTONIC) */
    uint64_t held;         /* the backlog: length of the op at the head of the queue, refused
                              for want of tokens or next behind the one that went; 0: none */
    int refused;           /* the head was refused tokens, first at refused_since */
    int64_t refused_since;
    uint64_t throttled_ns; /* finished waits for tokens, summed */
};

#define NO_TIME INT64_MAX
#define MIN_BURST (1ull << 20)     /* the default burst: max(MIN_BURST, rate / BURST_DIV), */
#define BURST_DIV 50               /* i.e. 20 ms of the rate */
#define QUANTUM_NS 1000000ll       /* held ops are released at most once a millisecond */
#define MAX_HOLD_NS 3600000000000ll /* wake up at least hourly, whatever the cap */
#define TOKEN_SLACK 1e-3           /* bytes; far above the tokens' floating-point error */
#define CATCH_UP_S 0.1             /* seconds of lateness a held queue may make up */

struct tba_engine {
    int kind;
    pid_t owner; /* the process that opened it: a forked child must not touch the shared ring */
    uint32_t depth, max_again, max_stalls;
    pthread_mutex_t lock;
    pthread_mutex_t reap_lock;
    pthread_cond_t done_cv; /* threads mode: an op finished, or wake / shutdown */
    pthread_cond_t work_cv; /* threads mode: an op was queued, or stop */
    int shutdown, stop, wake_pending;
    uint64_t outstanding;       /* submitted and not yet returned by reap */
    uint32_t inflight;          /* io_uring: ops the kernel has (or will have at the next enter) */
    struct op *pend_head[2], *pend_tail[2]; /* per direction: waiting for tokens, a ring slot
                                               or a worker */
    uint64_t npend[2];
    uint64_t next_seq;
    struct bucket bucket[2];    /* indexed by TBA_OP_READ / TBA_OP_WRITE */
    int64_t reap_timer;         /* io_uring: the reaper sleeps at most until then (NO_TIME) */
    int64_t clock_jump, clock_ahead, clock_jumps; /* TBA_INJECT_CLOCK: see clock_now */
    int64_t worker_timer;       /* threads: an idle worker wakes up then (NO_TIME: none does) */
    struct op *done_head, *done_tail; /* finished, not yet reaped */

    struct file_ent *files;
    int nfiles;
    unsigned char *file_slot_used;
    uint32_t files_table, files_registered, files_plain;
    int files_errno;

    struct region *regions;
    unsigned char *buf_slot_used;
    uint32_t max_buffers; /* slots of the buffer table, once made */
    uint32_t buf_table;   /* slots in the buffer table (0 until the first registration) */
    int buf_mode;
    int buffers_errno;
    uint32_t buffers_registered;
    uint64_t buffer_bytes;

    struct rule rules[N_RULE_OPS][MAX_RULES];
    int nrules[N_RULE_OPS];
    int rules_active; /* total queued rules; written under the lock, read without it as a hint,
                         so every access is atomic */

    uint64_t ops_fixed, ops_plain, resubmit_short, resubmit_again, injected;

    /* io_uring */
    int ring_fd, event_fd;
    uint32_t features, sq_entries, cq_entries, sq_mask, cq_mask;
    int setup_errno, setup_stage;
    unsigned *sq_head, *sq_tail, *sq_array, *sq_flags;
    unsigned *cq_head, *cq_tail;
    struct k_sqe *sqes;
    struct k_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len, sqes_len;
    unsigned sq_local_tail;

    /* threads */
    pthread_t *threads;
    uint32_t nthreads;
};

static void stat_add(uint64_t *counter, uint64_t n)
{
    __atomic_fetch_add(counter, n, __ATOMIC_RELAXED);
}

static void queue_push(struct op **head, struct op **tail, struct op *op)
{
    op->next = NULL;
    if (*tail)
        (*tail)->next = op;
    else
        *head = op;
    *tail = op;
}

static struct op *queue_pop(struct op **head, struct op **tail)
{
    struct op *op = *head;
    if (op) {
        *head = op->next;
        if (!*head)
            *tail = NULL;
        op->next = NULL;
    }
    return op;
}

static void queue_push_front(struct op **head, struct op **tail, struct op *op)
{
    op->next = *head;
    *head = op;
    if (!*tail)
        *tail = op;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The engine's clock: CLOCK_MONOTONIC, plus what TBA_INJECT_CLOCK added. A test makes each
 * reading jump ahead so that tokens accrue between two readings that are microseconds apart
 * for real (how the hang fixed in hold_due struck). Any thread, lock held or not. */
static int64_t clock_now(struct tba_engine *e)
{
    int64_t t = now_ns();
    if (__atomic_load_n(&e->clock_jumps, __ATOMIC_ACQUIRE) > 0
        && __atomic_sub_fetch(&e->clock_jumps, 1, __ATOMIC_ACQUIRE) >= 0) {
        int64_t jump = __atomic_load_n(&e->clock_jump, __ATOMIC_RELAXED);
        return t + __atomic_add_fetch(&e->clock_ahead, jump, __ATOMIC_RELAXED);
    }
    return t + __atomic_load_n(&e->clock_ahead, __ATOMIC_RELAXED);
}

static struct timespec ns_to_timespec(int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    return ts;
}

/* The next injection rule for `code`, consumed (lock held). Returns its kind, 0 for none. */
static int take_rule(struct tba_engine *e, int code, int64_t *value)
{
    if (e->nrules[code] == 0)
        return 0;
    struct rule *r = &e->rules[code][0];
    int kind = r->kind;
    *value = r->value;
    if (--r->count <= 0) {
        memmove(&e->rules[code][0], &e->rules[code][1],
                sizeof(struct rule) * (size_t)(e->nrules[code] - 1));
        e->nrules[code]--;
        __atomic_fetch_sub(&e->rules_active, 1, __ATOMIC_RELAXED);
    }
    stat_add(&e->injected, 1);
    return kind;
}

/* Bytes to ask for in the next attempt, given the injection rule (kind, value) that applies
 * to it. Sets op->inj_errno and op->cap for the completion side. */
static uint64_t plan_attempt(struct op *op, int kind, int64_t value)
{
    uint64_t want = op->len - op->pos;
    if (want > CHUNK)
        want = CHUNK; /* larger ops go as several requests, like a short transfer */
    op->inj_errno = 0;
    op->cap = UINT64_MAX;
    if (kind == TBA_INJECT_FAIL) {
        op->inj_errno = value > 0 ? (int)value : EIO;
        return 0;
    }
    if (kind == TBA_INJECT_SHORT) {
        uint64_t v = value > 0 ? (uint64_t)value : 0;
        uint64_t sub = (v + op->unit - 1) / op->unit * op->unit; /* keep O_DIRECT requests aligned */
        if (sub < want)
            want = sub;
        op->cap = v;
    }
    return want;
}

static int op_finish(struct op *op, int64_t result, uint32_t why)
{
    op->result = result;
    op->why = why;
    return 1;
}

/* Applies one attempt's result to op. Returns 1 when the op is finished (result and why set),
 * 0 when it must be attempted again from op->pos. The rules of NOTE [Transfers]. */
static int op_advance(struct tba_engine *e, struct op *op, int64_t res)
{
    op->tries++;
    if (op->inj_errno) {
        res = -(int64_t)op->inj_errno;
        op->inj_errno = 0;
    } else if (res > 0 && (uint64_t)res > op->cap) {
        res = (int64_t)op->cap; /* the device did more than it says: resume from what it says */
    }
    op->cap = UINT64_MAX;
    if (res < 0) {
        int err = (int)-res;
        if (err == EAGAIN || err == EINTR || err == ECANCELED) {
            if (op->again < e->max_again) {
                op->again++;
                stat_add(&e->resubmit_again, 1);
                return 0;
            }
            return op_finish(op, res, TBA_WHY_RETRIES);
        }
        return op_finish(op, res, TBA_WHY_ERRNO);
    }
    if (res == 0 && op->code == TBA_OP_READ)
        return op_finish(op, -EIO, TBA_WHY_EOF); /* never hand back bytes nobody read */
    uint64_t end = op->pos + (uint64_t)res;
    if (end >= op->len) {
        op->pos = op->len;
        return op_finish(op, (int64_t)op->len, TBA_WHY_OK);
    }
    uint64_t next = end - end % op->unit;
    if (next > op->pos) {
        op->pos = next;
        op->stalls = 0;
    } else if (++op->stalls >= e->max_stalls) {
        return op_finish(op, -EIO, TBA_WHY_STALLED);
    }
    stat_add(&e->resubmit_short, 1);
    return 0;
}

static void fill_completion(struct tba_completion *c, const struct op *op)
{
    c->user_data = op->user_data;
    c->result = op->result;
    c->done = op->result < 0 ? op->pos : op->len;
    c->why = op->why;
    c->tries = op->why == TBA_WHY_STALLED ? op->stalls : op->tries;
}

/* Moves up to max finished ops of the done list into out (lock held). */
static int take_done(struct tba_engine *e, struct tba_completion *out, int max)
{
    int n = 0;
    while (n < max && e->done_head) {
        struct op *op = queue_pop(&e->done_head, &e->done_tail);
        fill_completion(&out[n++], op);
        free(op);
    }
    return n;
}

static void wake_reaper(struct tba_engine *e)
{
    if (e->event_fd >= 0) {
        uint64_t one = 1;
        ssize_t rc;
        do {
            rc = write(e->event_fd, &one, sizeof one);
        } while (rc < 0 && errno == EINTR);
    }
}

/* -- bandwidth caps ------------------------------------------------------------------------ */

static uint64_t default_burst(uint64_t rate)
{
    uint64_t b = rate / BURST_DIV;
    return b > MIN_BURST ? b : MIN_BURST;
}

/* Adds the tokens accrued since the last update (lock held). During a backlog the bucket may
 * hold the head op's length even when it exceeds the burst, plus CATCH_UP_S of the rate, so
 * that releasing it late (a descheduled reaper or worker) does not lose the time. */
static void bucket_fill(struct bucket *b, int64_t now)
{
    if (now <= b->stamp)
        return;
    double ceiling = (double)(b->held > b->burst ? b->held : b->burst);
    if (b->held)
        ceiling += (double)b->rate * CATCH_UP_S; /* a late release is made up, idle time not */
    b->tokens += (double)(now - b->stamp) * (double)b->rate * 1e-9;
    if (b->tokens > ceiling)
        b->tokens = ceiling; /* every time: catch-up credit does not outlive its backlog */
    b->stamp = now;
}

/* The head op is no longer held (it went, or the cap went): count its wait (lock held). */
static void bucket_unhold(struct bucket *b, int64_t now)
{
    if (b->refused) {
        if (now > b->refused_since)
            b->throttled_ns += (uint64_t)(now - b->refused_since);
        b->refused = 0;
    }
    b->held = 0;
}

/* When the held head may go at the current rate (lock held; the bucket is up to date). */
static int64_t bucket_due(const struct bucket *b, uint64_t n, int64_t now)
{
    double wait = ((double)n - b->tokens) * 1e9 / (double)b->rate;
    if (wait < 0)
        wait = 0;
    return now + (wait < (double)MAX_HOLD_NS ? (int64_t)wait + 1 : MAX_HOLD_NS);
}

/* Whether an op of n bytes may go now. If so, takes its tokens, carries the backlog on to the
 * op of `then` bytes queued behind it (0: none) and returns 1; else marks it as held, sets *due
 * to when it may go, and returns 0 (lock held, capped bucket). TOKEN_SLACK absorbs the
 * rounding of the floating-point tokens. */
static int bucket_take(struct bucket *b, uint64_t n, uint64_t then, int64_t now, int64_t *due)
{
    bucket_fill(b, now);
    if (b->tokens + TOKEN_SLACK >= (double)n) {
        b->tokens -= (double)n;
        bucket_unhold(b, now);
        b->held = then;
        return 1;
    }
    b->held = n;
    if (!b->refused) {
        b->refused = 1;
        b->refused_since = now;
    }
    *due = bucket_due(b, n, now);
    return 0;
}

static void pend_push(struct tba_engine *e, struct op *op, int front)
{
    int d = op->code;
    if (front)
        queue_push_front(&e->pend_head[d], &e->pend_tail[d], op);
    else
        queue_push(&e->pend_head[d], &e->pend_tail[d], op);
    e->npend[d]++;
}

static int pend_any(const struct tba_engine *e)
{
    return e->pend_head[TBA_OP_READ] || e->pend_head[TBA_OP_WRITE];
}

/* Takes the next op to hand to the kernel or a worker (lock held): the older of the two queue
 * heads whose bucket pays for it now. NULL when neither may go; then *due is the earliest time a
 * head held by its cap may go (NO_TIME: none is held). After shutdown the caps are ignored. */
static struct op *pend_next(struct tba_engine *e, int64_t *due)
{
    *due = NO_TIME;
    int first = TBA_OP_READ;
    const struct op *r = e->pend_head[TBA_OP_READ], *w = e->pend_head[TBA_OP_WRITE];
    if (w && (!r || w->seq < r->seq))
        first = TBA_OP_WRITE;
    int64_t now = 0;
    for (int i = 0; i < 2; i++) {
        int d = i == 0 ? first : 1 - first;
        struct op *op = e->pend_head[d];
        if (!op)
            continue;
        struct bucket *b = &e->bucket[d];
        if (!op->admitted && b->rate && !e->shutdown) {
            int64_t when = NO_TIME;
            if (!now)
                now = clock_now(e);
            if (!bucket_take(b, op->len, op->next ? op->next->len : 0, now, &when)) {
                if (when < *due)
                    *due = when;
                continue;
            }
        }
        op->admitted = 1;
        e->npend[d]--;
        return queue_pop(&e->pend_head[d], &e->pend_tail[d]);
    }
    return NULL;
}

/* The earliest time a queue head held by its cap will have its tokens, or NO_TIME (lock held). */
static int64_t hold_due(struct tba_engine *e)
{
    int64_t due = NO_TIME, now = 0;
    if (e->shutdown)
        return NO_TIME;
    for (int d = 0; d < 2; d++) {
        struct bucket *b = &e->bucket[d];
        if (!b->rate || !b->held || !e->pend_head[d])
            continue;
        if (!now)
            now = clock_now(e);
        bucket_fill(b, now);
        uint64_t n = e->pend_head[d]->len;
        int64_t when;
        if (b->tokens + TOKEN_SLACK < (double)n)
            when = bucket_due(b, n, now);
        else if (e->inflight >= e->depth)
            continue; /* paid for, and waiting for a ring slot: a completion frees one */
        else
            /* Paid for since sq_refill refused it: the tokens accrued between its clock reading
             * and this one (a preempted reaper, at 200 MB/s 1 ms is 200 KB). Nothing in flight
             * may wake the reaper, so it must come back now: skipping the head here left it
             * queued for good (a hang seen at 200 MB/s, with the head paid for and nothing in
             * flight). */
            when = now;
        if (when < due)
            due = when;
    }
    return due;
}

/* ------------------------------------------------------------------------------------------ */
/* 3. io_uring mode                                                                           */
/* ------------------------------------------------------------------------------------------ */

static void ring_unmap(struct tba_engine *e)
{
    if (e->sqes && e->sqes != MAP_FAILED)
        munmap(e->sqes, e->sqes_len);
    if (e->cq_map && e->cq_map != MAP_FAILED && e->cq_map != e->sq_map)
        munmap(e->cq_map, e->cq_map_len);
    if (e->sq_map && e->sq_map != MAP_FAILED)
        munmap(e->sq_map, e->sq_map_len);
    e->sqes = NULL;
    e->sq_map = e->cq_map = NULL;
}

static int ring_map(struct tba_engine *e, const struct k_params *p)
{
    e->sq_map_len = p->sq_off.array + p->sq_entries * sizeof(uint32_t);
    e->cq_map_len = p->cq_off.cqes + p->cq_entries * sizeof(struct k_cqe);
    int single = (p->features & K_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        if (e->cq_map_len > e->sq_map_len)
            e->sq_map_len = e->cq_map_len;
        e->cq_map_len = e->sq_map_len;
    }
    e->sq_map = mmap(NULL, e->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                     e->ring_fd, K_OFF_SQ_RING);
    if (e->sq_map == MAP_FAILED) {
        e->sq_map = NULL;
        return -errno;
    }
    if (single) {
        e->cq_map = e->sq_map;
    } else {
        e->cq_map = mmap(NULL, e->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                         e->ring_fd, K_OFF_CQ_RING);
        if (e->cq_map == MAP_FAILED) {
            e->cq_map = NULL;
            return -errno;
        }
    }
    e->sqes_len = p->sq_entries * sizeof(struct k_sqe);
    e->sqes = mmap(NULL, e->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                   e->ring_fd, K_OFF_SQES);
    if (e->sqes == MAP_FAILED) {
        e->sqes = NULL;
        return -errno;
    }
    char *sq = e->sq_map, *cq = e->cq_map;
    e->sq_head = (unsigned *)(sq + p->sq_off.head);
    e->sq_tail = (unsigned *)(sq + p->sq_off.tail);
    e->sq_flags = (unsigned *)(sq + p->sq_off.flags);
    e->sq_array = (unsigned *)(sq + p->sq_off.array);
    e->sq_mask = *(unsigned *)(sq + p->sq_off.ring_mask);
    e->cq_head = (unsigned *)(cq + p->cq_off.head);
    e->cq_tail = (unsigned *)(cq + p->cq_off.tail);
    e->cq_mask = *(unsigned *)(cq + p->cq_off.ring_mask);
    e->cqes = (struct k_cqe *)(cq + p->cq_off.cqes);
    e->sq_entries = p->sq_entries;
    e->cq_entries = p->cq_entries;
    e->sq_local_tail = *e->sq_tail;
    return 0;
}

/* Every opcode we issue must be there (IORING_REGISTER_PROBE itself needs Linux 5.6). */
static int ring_probe_ops(struct tba_engine *e)
{
    struct k_probe *probe = calloc(1, sizeof *probe);
    if (!probe)
        return -ENOMEM;
    int rc = sys_register(e->ring_fd, K_REG_PROBE, probe, K_PROBE_OPS);
    if (rc >= 0) {
        static const uint8_t need[] = {K_OP_NOP, K_OP_READ, K_OP_WRITE, K_OP_READ_FIXED,
                                       K_OP_WRITE_FIXED};
        for (size_t i = 0; i < sizeof need; i++) {
            uint8_t op = need[i];
            if (op > probe->last_op || op >= probe->ops_len
                || !(probe->ops[op].flags & K_OP_SUPPORTED)) {
                rc = -EOPNOTSUPP;
                break;
            }
        }
    }
    free(probe);
    return rc < 0 ? rc : 0;
}

/* A sparse registered file table; on failure the engine uses plain fds and says why. */
static void ring_files_table(struct tba_engine *e, uint32_t want)
{
    for (;;) {
        struct k_rsrc_register reg = {.nr = want, .flags = K_RSRC_SPARSE};
        int rc = sys_register(e->ring_fd, K_REG_FILES2, &reg, sizeof reg);
        if (rc == -EINVAL) { /* before Linux 5.19: a table of -1 entries */
            int32_t *fds = malloc(sizeof(int32_t) * want);
            if (!fds) {
                rc = -ENOMEM;
            } else {
                for (uint32_t i = 0; i < want; i++)
                    fds[i] = -1;
                rc = sys_register(e->ring_fd, K_REG_FILES, fds, want);
                free(fds);
            }
        }
        if (rc == -EMFILE && want > 16) { /* RLIMIT_NOFILE is lower than the table */
            want = 16;
            continue;
        }
        if (rc < 0) {
            e->files_errno = -rc;
            return;
        }
        e->file_slot_used = calloc(want, 1);
        if (!e->file_slot_used) { /* unusable without bookkeeping: drop it with the ring */
            e->files_errno = ENOMEM;
            return;
        }
        e->files_table = want;
        return;
    }
}

static int ring_open(struct tba_engine *e, const struct tba_engine_config *cfg)
{
    if (cfg->simulate_setup_errno > 0) {
        e->setup_stage = TBA_STAGE_SETUP;
        return -cfg->simulate_setup_errno;
    }
    static const uint32_t flag_sets[] = {K_SETUP_CLAMP | K_SETUP_SUBMIT_ALL, K_SETUP_CLAMP, 0};
    int fd = -EINVAL;
    struct k_params p;
    for (size_t i = 0; i < sizeof flag_sets / sizeof flag_sets[0]; i++) {
        memset(&p, 0, sizeof p);
        p.flags = flag_sets[i];
        fd = sys_setup(e->depth, &p);
        if (fd != -EINVAL)
            break; /* EINVAL: an older kernel without that flag */
    }
    if (fd < 0) {
        e->setup_stage = TBA_STAGE_SETUP;
        return fd;
    }
    e->ring_fd = fd;
    e->features = p.features;
    int rc = ring_map(e, &p);
    if (rc < 0) {
        e->setup_stage = TBA_STAGE_MMAP;
        return rc;
    }
    rc = ring_probe_ops(e);
    if (rc < 0) {
        e->setup_stage = TBA_STAGE_PROBE;
        return rc;
    }
    e->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (e->event_fd < 0) {
        e->setup_stage = TBA_STAGE_EVENTFD;
        return -errno;
    }
    if (e->depth > e->sq_entries)
        e->depth = e->sq_entries; /* clamped by the kernel */
    ring_files_table(e, cfg->max_files ? cfg->max_files : 256);
    return 0;
}

static void ring_close(struct tba_engine *e)
{
    ring_unmap(e);
    if (e->ring_fd >= 0)
        close(e->ring_fd); /* drops the registered files and buffers with it */
    if (e->event_fd >= 0)
        close(e->event_fd);
    e->ring_fd = e->event_fd = -1;
}

/* The registered-buffer slot covering [p, p + n), or -1 (lock held). */
static int buf_slot_for(const struct tba_engine *e, const char *p, uint64_t n)
{
    if (!e->buffers_registered || n == 0)
        return -1;
    uint64_t a = (uintptr_t)p;
    for (uint32_t i = 0; i < e->buf_table; i++) {
        const struct region *r = &e->regions[i];
        if (!r->used || a < r->base || a + n > r->base + r->len)
            continue;
        uint64_t rel = a - r->base;
        if (rel / CHUNK != (rel + n - 1) / CHUNK)
            return -1; /* straddles two registered chunks */
        return (int)(r->first + rel / CHUNK);
    }
    return -1;
}

static unsigned sq_space(const struct tba_engine *e)
{
    unsigned head = __atomic_load_n(e->sq_head, __ATOMIC_ACQUIRE);
    return e->sq_entries - (e->sq_local_tail - head);
}

/* Fills the next SQE with op's next attempt (lock held; the caller checked sq_space). */
static void sq_push(struct tba_engine *e, struct op *op)
{
    int64_t value = 0;
    int kind = __atomic_load_n(&e->rules_active, __ATOMIC_RELAXED) ? take_rule(e, op->code, &value)
                                                                   : 0;
    uint64_t n = plan_attempt(op, kind, value);
    unsigned idx = e->sq_local_tail & e->sq_mask;
    struct k_sqe *s = &e->sqes[idx];
    memset(s, 0, sizeof *s);
    s->user_data = (uint64_t)(uintptr_t)op;
    if (op->inj_errno) {
        s->opcode = K_OP_NOP; /* the failure still travels through the ring */
    } else {
        const struct file_ent *f = &e->files[op->handle];
        if (f->slot >= 0) {
            s->fd = f->slot;
            s->flags = K_SQE_FIXED_FILE;
        } else {
            s->fd = f->fd;
        }
        s->off = op->offset + op->pos;
        s->addr = (uint64_t)(uintptr_t)(op->buf + op->pos);
        s->len = (uint32_t)n;
        int slot = buf_slot_for(e, op->buf + op->pos, n);
        if (slot >= 0) {
            s->opcode = op->code == TBA_OP_READ ? K_OP_READ_FIXED : K_OP_WRITE_FIXED;
            s->buf_index = (uint16_t)slot;
            stat_add(&e->ops_fixed, 1);
        } else {
            s->opcode = op->code == TBA_OP_READ ? K_OP_READ : K_OP_WRITE;
            stat_add(&e->ops_plain, 1);
        }
    }
    e->sq_array[idx] = idx;
    e->sq_local_tail++;
    __atomic_store_n(e->sq_tail, e->sq_local_tail, __ATOMIC_RELEASE);
}

/* Takes back the SQEs the kernel has not consumed and fails their ops (lock held). Safe without
 * SQPOLL: the kernel reads the SQ only inside our io_uring_enter calls, made under the lock. */
static void sq_retract(struct tba_engine *e, int err)
{
    unsigned head = __atomic_load_n(e->sq_head, __ATOMIC_ACQUIRE);
    for (unsigned t = head; t != e->sq_local_tail; t++) {
        struct op *op = (struct op *)(uintptr_t)e->sqes[t & e->sq_mask].user_data;
        e->inflight--;
        op_finish(op, -err, TBA_WHY_SUBMIT);
        queue_push(&e->done_head, &e->done_tail, op);
    }
    e->sq_local_tail = head;
    __atomic_store_n(e->sq_tail, head, __ATOMIC_RELEASE);
    wake_reaper(e);
}

/* Hands every filled SQE to the kernel (lock held). */
static void sq_flush(struct tba_engine *e)
{
    int busy = 0;
    for (;;) {
        unsigned head = __atomic_load_n(e->sq_head, __ATOMIC_ACQUIRE);
        unsigned todo = e->sq_local_tail - head;
        if (todo == 0)
            return;
        int rc = sys_enter(e->ring_fd, todo, 0, 0);
        if (rc > 0)
            continue;
        if (rc == 0)
            rc = -EAGAIN;
        if ((rc == -EAGAIN || rc == -EBUSY || rc == -EINTR || rc == -ENOMEM)
            && busy++ < BUSY_TRIES) {
            if (rc != -EINTR)
                sleep_ms(1); /* the reaper drains the CQ meanwhile: it does not need the lock */
            continue;
        }
        sq_retract(e, -rc);
        return;
    }
}

/* Pushes queued ops into free ring slots, up to depth in flight and as far as the caps allow
 * (lock held). */
static int sq_refill(struct tba_engine *e)
{
    int pushed = 0;
    int64_t due;
    while (pend_any(e) && e->inflight < e->depth && sq_space(e) > 0) {
        struct op *op = pend_next(e, &due);
        if (!op)
            break; /* the heads wait for tokens: the reaper's timer releases them */
        e->inflight++;
        sq_push(e, op);
        pushed++;
    }
    return pushed;
}

static int ring_reap(struct tba_engine *e, struct tba_completion *out, int max, int timeout_ms)
{
    int64_t deadline = timeout_ms > 0 ? clock_now(e) + (int64_t)timeout_ms * 1000000 : NO_TIME;
    for (;;) {
        int n = 0, finished = 0;
        struct op *retry = NULL, *retry_tail = NULL, *gone = NULL;

        pthread_mutex_lock(&e->lock);
        n = take_done(e, out, max);
        pthread_mutex_unlock(&e->lock);

        unsigned head = *e->cq_head; /* only we move it */
        unsigned tail = __atomic_load_n(e->cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail && n < max) {
            const struct k_cqe *c = &e->cqes[head & e->cq_mask];
            struct op *op = (struct op *)(uintptr_t)c->user_data;
            int32_t res = c->res;
            head++;
            if (!op)
                continue;
            if (op_advance(e, op, res)) {
                fill_completion(&out[n++], op);
                op->next = gone;
                gone = op;
                finished++;
            } else {
                queue_push(&retry, &retry_tail, op);
            }
        }
        __atomic_store_n(e->cq_head, head, __ATOMIC_RELEASE);

        pthread_mutex_lock(&e->lock);
        e->inflight -= (uint32_t)finished;
        int pushed = 0;
        struct op *op;
        while ((op = queue_pop(&retry, &retry_tail))) {
            if (sq_space(e) > 0) {
                sq_push(e, op); /* still counted in flight */
                pushed++;
            } else { /* cannot happen with inflight <= depth <= SQ entries; be safe anyway */
                e->inflight--;
                pend_push(e, op, 1); /* admitted already: its tokens are not charged again */
            }
        }
        pushed += sq_refill(e);
        if (pushed)
            sq_flush(e);
        e->outstanding -= (uint64_t)n;
        int shut = e->shutdown && e->outstanding == 0;
        int woken = n == 0 && e->wake_pending;
        if (woken)
            e->wake_pending = 0;
        unsigned sq_flags = __atomic_load_n(e->sq_flags, __ATOMIC_ACQUIRE);
        /* Ops held by a cap are released by this thread: it sleeps no longer than until the
         * first of them may go. submit() wakes it if a new op must go sooner. */
        int64_t release = hold_due(e);
        e->reap_timer = release;
        pthread_mutex_unlock(&e->lock);

        while (gone) {
            struct op *next = gone->next;
            free(gone);
            gone = next;
        }
        if (n > 0)
            return n;
        if (shut)
            return -ESHUTDOWN;
        if (woken || timeout_ms == 0)
            return 0;
        if (sq_flags & K_SQ_CQ_OVERFLOW) { /* cannot happen at our depth; flush it if it does */
            sys_enter(e->ring_fd, 0, 0, K_ENTER_GETEVENTS);
            continue;
        }
        if (__atomic_load_n(e->cq_tail, __ATOMIC_ACQUIRE) != head)
            continue;
        int64_t now = clock_now(e);
        if (deadline != NO_TIME && deadline <= now)
            return 0;
        int64_t until = deadline;
        if (release != NO_TIME) {
            if (release < now + QUANTUM_NS)
                release = now + QUANTUM_NS; /* release in batches, not one wake-up per op */
            if (release < until)
                until = release;
        }
        struct timespec ts, *wait = NULL;
        if (until != NO_TIME) {
            ts = ns_to_timespec(until - now);
            wait = &ts;
        }
        struct pollfd pfd[2] = {{e->ring_fd, POLLIN, 0}, {e->event_fd, POLLIN, 0}};
        int rc = ppoll(pfd, 2, wait, NULL);
        if (rc < 0 && errno != EINTR)
            sleep_ms(1);
        if (rc > 0 && (pfd[1].revents & POLLIN)) {
            uint64_t v;
            ssize_t got = read(e->event_fd, &v, sizeof v);
            (void)got;
        }
    }
}

/* Registers chunks of [base, base + len) at slots first.. of the sparse table (lock held). */
static int buffers_update(struct tba_engine *e, uint32_t first, uint64_t base, uint64_t len,
                          uint32_t count, int clear)
{
    for (uint32_t i = 0; i < count; i++) {
        uint64_t off = (uint64_t)i * CHUNK;
        struct iovec iov = {NULL, 0};
        if (!clear) {
            iov.iov_base = (void *)(uintptr_t)(base + off);
            iov.iov_len = len - off < CHUNK ? len - off : CHUNK;
        }
        struct k_rsrc_update2 up = {.offset = first + i, .data = (uint64_t)(uintptr_t)&iov,
                                    .nr = 1};
        int rc = sys_register(e->ring_fd, K_REG_BUFFERS_UPDATE, &up, sizeof up);
        if (rc < 0 && !clear) {
            if (i)
                buffers_update(e, first, base, len, i, 1);
            return rc;
        }
    }
    return 0;
}

static int ring_register_buffer(struct tba_engine *e, uint64_t base, uint64_t len)
{
    uint32_t count = (uint32_t)((len + CHUNK - 1) / CHUNK);
    if (e->buf_mode == BUF_UNTRIED) { /* the table is made on first use */
        if (!e->regions)
            e->regions = calloc(e->max_buffers, sizeof(struct region));
        if (!e->buf_slot_used)
            e->buf_slot_used = calloc(e->max_buffers, 1);
        if (!e->regions || !e->buf_slot_used)
            return -ENOMEM;
        struct k_rsrc_register reg = {.nr = e->max_buffers, .flags = K_RSRC_SPARSE};
        int rc = sys_register(e->ring_fd, K_REG_BUFFERS2, &reg, sizeof reg);
        e->buf_table = e->max_buffers;
        e->buf_mode = rc < 0 ? BUF_LEGACY_IDLE : BUF_SPARSE; /* sparse tables: Linux 5.19 */
    }
    /* count free slots in a row, first fit */
    uint32_t first = 0, run = 0;
    for (uint32_t i = 0; i < e->buf_table && run < count; i++) {
        if (e->buf_slot_used[i]) {
            run = 0;
            first = i + 1;
        } else {
            run++;
        }
    }
    if (run < count)
        return -ENOSPC;
    int rc;
    if (e->buf_mode == BUF_SPARSE) {
        rc = buffers_update(e, first, base, len, count, 0);
    } else if (e->buf_mode == BUF_LEGACY_IDLE) { /* one region at a time, in one call */
        struct iovec *iov = calloc(count, sizeof *iov);
        if (!iov)
            return -ENOMEM;
        for (uint32_t i = 0; i < count; i++) {
            uint64_t off = (uint64_t)i * CHUNK;
            iov[i].iov_base = (void *)(uintptr_t)(base + off);
            iov[i].iov_len = len - off < CHUNK ? len - off : CHUNK;
        }
        first = 0;
        rc = sys_register(e->ring_fd, K_REG_BUFFERS, iov, count);
        free(iov);
        if (rc >= 0)
            e->buf_mode = BUF_LEGACY_BUSY;
    } else {
        rc = -EBUSY; /* this kernel takes one registered region at a time */
    }
    if (rc < 0)
        return rc;
    for (uint32_t r = 0; r < e->buf_table; r++) {
        if (!e->regions[r].used) {
            e->regions[r] = (struct region){base, len, first, count, 1};
            for (uint32_t i = 0; i < count; i++)
                e->buf_slot_used[first + i] = 1;
            e->buffers_registered++;
            e->buffer_bytes += len;
            return (int)r;
        }
    }
    return -ENOSPC; /* not reached: a region needs at least one slot */
}

static int ring_unregister_buffer(struct tba_engine *e, struct region *r)
{
    if (e->buf_mode == BUF_SPARSE) {
        buffers_update(e, r->first, 0, 0, r->count, 1);
    } else {
        sys_register(e->ring_fd, K_UNREG_BUFFERS, NULL, 0);
        e->buf_mode = BUF_LEGACY_IDLE;
    }
    for (uint32_t i = 0; i < r->count; i++)
        e->buf_slot_used[r->first + i] = 0;
    e->buffers_registered--;
    e->buffer_bytes -= r->len;
    r->used = 0;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* 4. threads mode                                                                            */
/* ------------------------------------------------------------------------------------------ */

static void run_op(struct tba_engine *e, struct op *op)
{
    for (;;) {
        int64_t value = 0;
        int kind = 0;
        if (__atomic_load_n(&e->rules_active, __ATOMIC_RELAXED)) {
            pthread_mutex_lock(&e->lock);
            kind = take_rule(e, op->code, &value);
            pthread_mutex_unlock(&e->lock);
        }
        uint64_t n = plan_attempt(op, kind, value);
        int64_t res = 0;
        if (!op->inj_errno) {
            char *p = op->buf + op->pos;
            off_t at = (off_t)(op->offset + op->pos);
            ssize_t k = op->code == TBA_OP_READ ? pread(op->fd, p, n, at) : pwrite(op->fd, p, n, at);
            res = k < 0 ? -(int64_t)errno : (int64_t)k;
            stat_add(&e->ops_plain, 1);
        }
        uint32_t again = op->again;
        if (op_advance(e, op, res))
            return;
        if (op->again > again)
            sleep_ms(op->again); /* back off a little more each time */
    }
}

/* Idle workers take the next op the caps allow. When the queue heads wait for tokens, one idle
 * worker sleeps until the first may go (worker_timer) and the others until they are signalled;
 * a worker that takes an op signals the next one, which then looks at what is left. */
static void *worker(void *arg)
{
    struct tba_engine *e = arg;
    pthread_mutex_lock(&e->lock);
    for (;;) {
        int64_t due;
        struct op *op = pend_next(e, &due);
        if (!op) {
            if (e->stop && !pend_any(e))
                break; /* stop, and nothing left */
            if (due != NO_TIME && due < e->worker_timer) {
                int64_t now = clock_now(e);
                if (due < now + QUANTUM_NS)
                    due = now + QUANTUM_NS; /* release in batches, not one wake-up per op */
                e->worker_timer = due;
                struct timespec at = ns_to_timespec(due);
                pthread_cond_timedwait(&e->work_cv, &e->lock, &at);
                if (e->worker_timer == due)
                    e->worker_timer = NO_TIME;
            } else {
                pthread_cond_wait(&e->work_cv, &e->lock);
            }
            continue;
        }
        if (pend_any(e))
            pthread_cond_signal(&e->work_cv);
        op->fd = e->files[op->handle].fd;
        pthread_mutex_unlock(&e->lock);
        run_op(e, op);
        pthread_mutex_lock(&e->lock);
        queue_push(&e->done_head, &e->done_tail, op);
        pthread_cond_signal(&e->done_cv);
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

static int threads_start(struct tba_engine *e)
{
    e->threads = calloc(e->depth, sizeof(pthread_t));
    if (!e->threads)
        return -ENOMEM;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* workers inherit it: signals go elsewhere */
    int err = 0;
    for (uint32_t i = 0; i < e->depth; i++) {
        err = pthread_create(&e->threads[i], &attr, worker, e);
        if (err)
            break;
        e->nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (e->nthreads == 0)
        return -err;
    e->depth = e->nthreads; /* fewer threads than asked for still work */
    return 0;
}

static int threads_reap(struct tba_engine *e, struct tba_completion *out, int max, int timeout_ms)
{
    struct timespec until;
    if (timeout_ms > 0) {
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += timeout_ms / 1000;
        until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    int timed_out = 0, n = 0;
    pthread_mutex_lock(&e->lock);
    for (;;) {
        if (e->done_head) {
            n = take_done(e, out, max);
            e->outstanding -= (uint64_t)n;
            break;
        }
        if (e->shutdown && e->outstanding == 0) {
            n = -ESHUTDOWN;
            break;
        }
        if (e->wake_pending) {
            e->wake_pending = 0;
            break;
        }
        if (timeout_ms == 0 || timed_out)
            break;
        if (timeout_ms < 0)
            pthread_cond_wait(&e->done_cv, &e->lock);
        else if (pthread_cond_timedwait(&e->done_cv, &e->lock, &until) == ETIMEDOUT)
            timed_out = 1; /* one last look, then return */
    }
    pthread_mutex_unlock(&e->lock);
    return n;
}

static void threads_stop(struct tba_engine *e)
{
    pthread_mutex_lock(&e->lock);
    e->stop = 1;
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->lock);
    for (uint32_t i = 0; i < e->nthreads; i++)
        pthread_join(e->threads[i], NULL);
    e->nthreads = 0;
}

/* ------------------------------------------------------------------------------------------ */
/* 5. Public functions                                                                        */
/* ------------------------------------------------------------------------------------------ */

int tba_engine_abi(void)
{
    return TBA_ENGINE_ABI;
}

static void engine_free(struct tba_engine *e)
{
    if (e->threads)
        threads_stop(e);
    ring_close(e);
    free(e->threads);
    free(e->files);
    free(e->file_slot_used);
    free(e->regions);
    free(e->buf_slot_used);
    pthread_cond_destroy(&e->done_cv);
    pthread_cond_destroy(&e->work_cv);
    pthread_mutex_destroy(&e->reap_lock);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

int tba_engine_open(const struct tba_engine_config *cfg, struct tba_engine **out)
{
    if (!cfg || !out || cfg->size < sizeof(struct tba_engine_config) || cfg->depth == 0)
        return -EINVAL;
    *out = NULL;
    struct tba_engine *e = calloc(1, sizeof *e);
    if (!e)
        return -ENOMEM;
    e->ring_fd = e->event_fd = -1;
    e->owner = getpid();
    e->reap_timer = e->worker_timer = NO_TIME;
    e->depth = cfg->depth < MAX_DEPTH ? cfg->depth : MAX_DEPTH;
    e->max_again = cfg->max_again ? cfg->max_again : 16;
    e->max_stalls = cfg->max_stalls ? cfg->max_stalls : 8;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->reap_lock, NULL);
    pthread_cond_init(&e->done_cv, &ca);
    pthread_cond_init(&e->work_cv, &ca);
    pthread_condattr_destroy(&ca);
    e->nfiles = 16;
    e->files = calloc((size_t)e->nfiles, sizeof(struct file_ent));
    if (!e->files) {
        engine_free(e);
        return -ENOMEM;
    }
    e->max_buffers = cfg->max_buffers ? cfg->max_buffers : 16;
    if (e->max_buffers > 1024)
        e->max_buffers = 1024;

    int rc = -EPERM;
    if (cfg->flags & TBA_OPEN_THREADS) {
        e->setup_stage = TBA_STAGE_FORCED;
    } else {
        rc = ring_open(e, cfg);
        if (rc == 0) {
            e->kind = TBA_KIND_IO_URING;
        } else {
            e->setup_errno = -rc;
            e->files_errno = 0;
            ring_close(e);
            e->depth = cfg->depth < MAX_DEPTH ? cfg->depth : MAX_DEPTH;
        }
    }
    if (e->kind != TBA_KIND_IO_URING) {
        e->kind = TBA_KIND_THREADS;
        rc = threads_start(e);
        if (rc < 0) {
            engine_free(e);
            return rc;
        }
    }
    *out = e;
    return 0;
}

int tba_engine_info(struct tba_engine *e, struct tba_engine_info *info)
{
    if (!e || !info || info->size < sizeof(struct tba_engine_info))
        return -EINVAL;
    memset(info, 0, sizeof *info);
    info->size = sizeof *info;
    pthread_mutex_lock(&e->lock);
    info->kind = e->kind;
    info->depth = e->depth;
    info->ring_entries = e->kind == TBA_KIND_IO_URING ? e->sq_entries : 0;
    info->features = e->features;
    info->setup_errno = e->setup_errno;
    info->setup_stage = e->setup_stage;
    info->files_errno = e->files_errno;
    info->files_table = e->files_table;
    info->files_registered = e->files_registered;
    info->files_plain = e->files_plain;
    info->buffers_errno = e->buffers_errno;
    info->buffers_registered = e->buffers_registered;
    info->threads = e->nthreads;
    info->buffer_bytes = e->buffer_bytes;
    info->outstanding = e->outstanding;
    int64_t now = clock_now(e);
    for (int d = 0; d < 2; d++) {
        const struct bucket *b = &e->bucket[d];
        uint64_t throttled = b->throttled_ns;
        if (b->refused && now > b->refused_since)
            throttled += (uint64_t)(now - b->refused_since); /* the wait going on now */
        if (d == TBA_OP_READ) {
            info->rate_read = b->rate;
            info->burst_read = b->burst;
            info->throttle_ns_read = throttled;
            info->queued_read = e->npend[d];
        } else {
            info->rate_write = b->rate;
            info->burst_write = b->burst;
            info->throttle_ns_write = throttled;
            info->queued_write = e->npend[d];
        }
    }
    pthread_mutex_unlock(&e->lock);
    info->ops_fixed = __atomic_load_n(&e->ops_fixed, __ATOMIC_RELAXED);
    info->ops_plain = __atomic_load_n(&e->ops_plain, __ATOMIC_RELAXED);
    info->resubmit_short = __atomic_load_n(&e->resubmit_short, __ATOMIC_RELAXED);
    info->resubmit_again = __atomic_load_n(&e->resubmit_again, __ATOMIC_RELAXED);
    info->injected = __atomic_load_n(&e->injected, __ATOMIC_RELAXED);
    return 0;
}

int tba_engine_add_file(struct tba_engine *e, int fd)
{
    if (!e)
        return -EINVAL;
    if (fd < 0)
        return -EBADF;
    pthread_mutex_lock(&e->lock);
    int h = 0;
    while (h < e->nfiles && e->files[h].used)
        h++;
    if (h == e->nfiles) {
        if (e->nfiles >= MAX_HANDLES) {
            pthread_mutex_unlock(&e->lock);
            return -EMFILE;
        }
        struct file_ent *grown = realloc(e->files, sizeof(struct file_ent) * (size_t)e->nfiles * 2);
        if (!grown) {
            pthread_mutex_unlock(&e->lock);
            return -ENOMEM;
        }
        memset(grown + e->nfiles, 0, sizeof(struct file_ent) * (size_t)e->nfiles);
        e->files = grown;
        e->nfiles *= 2;
    }
    struct file_ent *f = &e->files[h];
    *f = (struct file_ent){fd, -1, 1};
    if (e->kind == TBA_KIND_IO_URING && e->files_table) {
        int64_t value = 0;
        int rc;
        if (take_rule(e, TBA_OP_ADD_FILE, &value) == TBA_INJECT_FAIL) {
            rc = value > 0 ? -(int)value : -EIO;
        } else {
            uint32_t slot = 0;
            while (slot < e->files_table && e->file_slot_used[slot])
                slot++;
            if (slot == e->files_table) {
                rc = -ENFILE; /* table full: this file goes by its plain fd */
            } else {
                int32_t one = fd;
                struct k_files_update up = {.offset = slot, .fds = (uint64_t)(uintptr_t)&one};
                rc = sys_register(e->ring_fd, K_REG_FILES_UPDATE, &up, 1);
                if (rc == 1) {
                    f->slot = (int)slot;
                    e->file_slot_used[slot] = 1;
                } else if (rc >= 0) {
                    rc = -EIO;
                }
            }
        }
        if (rc < 0)
            e->files_errno = -rc;
    }
    if (f->slot >= 0)
        e->files_registered++;
    else
        e->files_plain++;
    pthread_mutex_unlock(&e->lock);
    return h;
}

int tba_engine_remove_file(struct tba_engine *e, int h)
{
    if (!e)
        return -EINVAL;
    pthread_mutex_lock(&e->lock);
    if (h < 0 || h >= e->nfiles || !e->files[h].used) {
        pthread_mutex_unlock(&e->lock);
        return -EBADF;
    }
    struct file_ent *f = &e->files[h];
    if (f->slot >= 0) {
        int32_t none = -1;
        struct k_files_update up = {.offset = (uint32_t)f->slot,
                                    .fds = (uint64_t)(uintptr_t)&none};
        sys_register(e->ring_fd, K_REG_FILES_UPDATE, &up, 1);
        e->file_slot_used[f->slot] = 0;
        e->files_registered--;
    } else {
        e->files_plain--;
    }
    *f = (struct file_ent){-1, -1, 0};
    pthread_mutex_unlock(&e->lock);
    return 0;
}

int tba_engine_register_buffer(struct tba_engine *e, void *addr, uint64_t len)
{
    if (!e || !addr || len == 0)
        return -EINVAL;
    pthread_mutex_lock(&e->lock);
    int rc;
    int64_t value = 0;
    if (take_rule(e, TBA_OP_REGISTER_BUFFER, &value) == TBA_INJECT_FAIL)
        rc = value > 0 ? -(int)value : -ENOMEM;
    else if (e->kind != TBA_KIND_IO_URING)
        rc = -EOPNOTSUPP;
    else
        rc = ring_register_buffer(e, (uint64_t)(uintptr_t)addr, len);
    if (rc < 0)
        e->buffers_errno = -rc;
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int tba_engine_unregister_buffer(struct tba_engine *e, int region)
{
    if (!e)
        return -EINVAL;
    pthread_mutex_lock(&e->lock);
    int rc = -EINVAL;
    if (e->kind == TBA_KIND_IO_URING && region >= 0 && (uint32_t)region < e->buf_table
        && e->regions[region].used)
        rc = ring_unregister_buffer(e, &e->regions[region]);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int tba_engine_submit(struct tba_engine *e, int code, int handle, void *buf, uint64_t len,
                      uint64_t offset, uint32_t unit, uint64_t user_data)
{
    if (!e || (code != TBA_OP_READ && code != TBA_OP_WRITE) || len == 0)
        return -EINVAL;
    if (!buf)
        return -EFAULT;
    if (getpid() != e->owner)
        return -ECHILD; /* its completions would reach the parent's reaper */
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        return -ENOMEM;
    op->user_data = user_data;
    op->buf = buf;
    op->len = len;
    op->offset = offset;
    op->code = code;
    op->handle = handle;
    op->fd = -1;
    op->unit = unit ? unit : 1;
    op->cap = UINT64_MAX;
    pthread_mutex_lock(&e->lock);
    int rc = 0;
    if (e->shutdown)
        rc = -ESHUTDOWN;
    else if (handle < 0 || handle >= e->nfiles || !e->files[handle].used)
        rc = -EBADF;
    if (rc < 0) {
        pthread_mutex_unlock(&e->lock);
        free(op);
        return rc;
    }
    e->outstanding++;
    op->seq = e->next_seq++;
    pend_push(e, op, 0);
    int wake = 0;
    if (e->kind == TBA_KIND_IO_URING) {
        if (sq_refill(e))
            sq_flush(e);
        /* A head held by a cap may need the reaper sooner than it planned to wake up. */
        int64_t release = hold_due(e);
        if (release < e->reap_timer) {
            e->reap_timer = release;
            wake = 1;
        }
    } else {
        pthread_cond_signal(&e->work_cv);
    }
    pthread_mutex_unlock(&e->lock);
    if (wake)
        wake_reaper(e);
    return 0;
}

int tba_engine_reap(struct tba_engine *e, struct tba_completion *out, int max, int timeout_ms)
{
    if (!e || !out || max <= 0)
        return -EINVAL;
    if (getpid() != e->owner)
        return -ECHILD; /* the CQEs belong to the parent */
    pthread_mutex_lock(&e->reap_lock);
    int rc = e->kind == TBA_KIND_IO_URING ? ring_reap(e, out, max, timeout_ms)
                                           : threads_reap(e, out, max, timeout_ms);
    pthread_mutex_unlock(&e->reap_lock);
    return rc;
}

/* Sets *flag under the lock, then wakes whoever waits in reap (either mode), and the idle
 * workers (after shutdown they release what the caps held). */
static int raise_flag(struct tba_engine *e, int *flag)
{
    pthread_mutex_lock(&e->lock);
    *flag = 1;
    if (flag == &e->shutdown) {
        int64_t now = clock_now(e);
        bucket_unhold(&e->bucket[TBA_OP_READ], now);
        bucket_unhold(&e->bucket[TBA_OP_WRITE], now);
    }
    pthread_cond_broadcast(&e->done_cv);
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->lock);
    wake_reaper(e);
    return 0;
}

int tba_engine_set_rate(struct tba_engine *e, int code, uint64_t rate, uint64_t burst)
{
    if (!e || (code != TBA_OP_READ && code != TBA_OP_WRITE))
        return -EINVAL;
    if (getpid() != e->owner)
        return -ECHILD; /* releasing ops would touch the parent's ring */
    pthread_mutex_lock(&e->lock);
    struct bucket *b = &e->bucket[code];
    int64_t now = clock_now(e);
    if (b->rate)
        bucket_fill(b, now); /* what accrued so far accrued at the old rate */
    if (!rate) {
        bucket_unhold(b, now);
        *b = (struct bucket){.throttled_ns = b->throttled_ns};
    } else {
        uint64_t size = burst ? burst : default_burst(rate);
        if (!b->rate) {
            b->tokens = (double)size; /* a new cap starts with a full bucket */
        } else {
            double ceiling = (double)(b->held > size ? b->held : size);
            if (b->tokens > ceiling)
                b->tokens = ceiling;
        }
        b->rate = rate;
        b->burst = size;
        b->stamp = now;
    }
    /* Re-time what is queued: release what may go now; the reaper and the workers recompute
     * their timers when woken. */
    if (e->kind == TBA_KIND_IO_URING && sq_refill(e))
        sq_flush(e);
    e->reap_timer = NO_TIME;
    e->worker_timer = NO_TIME;
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->lock);
    wake_reaper(e);
    return 0;
}

int tba_engine_wake(struct tba_engine *e)
{
    return e ? raise_flag(e, &e->wake_pending) : -EINVAL;
}

int tba_engine_inject(struct tba_engine *e, int code, int kind, int64_t value, int count)
{
    if (!e || code < 0 || code >= N_RULE_OPS || kind < TBA_INJECT_CLEAR || kind > TBA_INJECT_CLOCK)
        return -EINVAL;
    int is_io = code == TBA_OP_READ || code == TBA_OP_WRITE;
    if (kind == TBA_INJECT_CLOCK) {
        if (!is_io || count < 0 || value < 0)
            return -EINVAL;
        __atomic_store_n(&e->clock_jump, value, __ATOMIC_RELAXED);
        __atomic_store_n(&e->clock_jumps, (int64_t)count, __ATOMIC_RELEASE);
        return 0;
    }
    if (kind != TBA_INJECT_CLEAR && (count < 1 || value < 0 || (!is_io && kind != TBA_INJECT_FAIL)))
        return -EINVAL;
    pthread_mutex_lock(&e->lock);
    int rc = 0;
    if (kind == TBA_INJECT_CLEAR) {
        __atomic_fetch_sub(&e->rules_active, e->nrules[code], __ATOMIC_RELAXED);
        e->nrules[code] = 0;
    } else if (e->nrules[code] == MAX_RULES) {
        rc = -ENOSPC;
    } else {
        e->rules[code][e->nrules[code]++] = (struct rule){kind, value, count};
        __atomic_fetch_add(&e->rules_active, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int tba_engine_shutdown(struct tba_engine *e)
{
    return e ? raise_flag(e, &e->shutdown) : -EINVAL;
}

int tba_engine_close(struct tba_engine *e)
{
    if (!e)
        return -EINVAL;
    if (getpid() != e->owner) {
        /* A forked child's copy: drop this process's mappings and fds only. The parent's ops,
         * threads and locks are not ours to wait for, join or destroy. */
        ring_close(e);
        free(e->threads);
        free(e->files);
        free(e->file_slot_used);
        free(e->regions);
        free(e->buf_slot_used);
        free(e);
        return 0;
    }
    tba_engine_shutdown(e);
    struct tba_completion sink[32];
    while (tba_engine_reap(e, sink, 32, -1) >= 0) {
        /* results nobody reaped are dropped; the ops themselves have finished */
    }
    engine_free(e);
    return 0;
}
