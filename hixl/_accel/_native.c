/* hixl's hot path in C: what runs per request between the Python that decides and the system
 * call (or memcpy) that moves the bytes. See hixl/_accel/__init__.py for the contract; the pure
 * Python twin in hixl/_accel/pure.py does exactly the same, and the tests run both.
 *
 * Nothing here decides what is allowed: callers pass the tables they checked against (and hold
 * the locks that keep them current). check_small is the one check made here, and it only ever
 * says "not eligible" (the Python path then decides and explains). The copies release the GIL
 * only for large totals: dropping and retaking it costs more than a small copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <emmintrin.h> /* SSE2, part of every x86-64: copy_bytes' streaming stores, prefetch_range */
#endif

/* Totals from this many bytes are copied with the GIL released (as hixl._accel.GIL_FREE_FROM). Below it
 * the GIL is kept: releasing and retaking it cost a 64 KiB cma copy ~7 %, while a copy of under 256 KiB
 * keeps other threads waiting ~13 us at most (CPython's switch interval is 5 ms). */
#define GIL_FREE_FROM (256u << 10)
/* Copies of fewer bytes stay in one lane (as hixl._accel.LANE_FROM); the most lanes one copy takes. */
#define LANE_FROM (4u << 20)
#define MAX_LANES 16
/* Memory copies (shm) of at least this many bytes use streaming stores (as hixl._accel.STREAM_FROM):
 * a call of mapped_copy or copy_pieces that copies this much, and every copy_pieces call of a
 * transfer this large (its caller says so). See copy_bytes. */
#define STREAM_FROM (16u << 20)
/* ... for each of their ranges of at least this many bytes: below it the partial cache lines at
 * its ends weigh, and a few lines left in the cache cost nothing. */
#define STREAM_RANGE_MIN 4096u
/* How much of the next range prefetch_range asks for: past it, the copy's own stream is under way. */
#define STREAM_PREFETCH_MAX (64u << 10)
/* A copy of one descriptor of at most this many bytes goes through the peer's /proc/<pid>/mem, when
 * the channel has it open (as hixl._accel.PROC_MEM_MAX): see cma_checked_call. Above a page the
 * kernel's copy through a bounce page costs more than the second system call it saves. */
#define PROC_MEM_MAX 4096u
/* The most descriptors the small-request functions take (at least hixl's SMALL_DESCS). */
#define SMALL_MAX 64
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct {
    uint64_t local, remote, len;
} desc_t;

/* memcpy(dst, src, n), with streaming (non-temporal) stores if `stream` and n >= STREAM_RANGE_MIN.
 *
 * A copy too large for the caches — a KV pull of hundreds of MiB, a 64 MiB window — gains nothing
 * from leaving its destination there: each plain store first reads its line from memory (to own
 * it), then evicts it again, so the bytes cross the memory bus three times. Streaming stores write
 * whole lines without reading them. glibc's memcpy switches to them only from its own threshold
 * (240 MiB on this machine's 2-core VM), never for the 32 KiB blocks a paged KV cache is made of;
 * measured here, one thread: 4 MiB pieces of a 1.25 GiB copy 10 -> 16 GiB/s, scattered 32 KiB
 * blocks 8.6 -> 11 GiB/s; below the caches' size plain memcpy is 2x faster (docs/tools.md). The
 * sfence makes the lines visible, in order, before the caller reports the copy done. */
static void
copy_bytes(void *dst, const void *src, size_t n, int stream)
{
#if defined(__x86_64__)
    if (stream && n >= STREAM_RANGE_MIN) {
        char *d = dst;
        const char *s = src;
        size_t head = (64 - ((uintptr_t)d & 63)) & 63; /* to the destination's next line */
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16)),
                    c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        memcpy(d + body, s + body, n - body);
        _mm_sfence();
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, n);
}

/* Ask for the first pages of the next range of a streamed copy (one line of each, both sides) while
 * this one copies: a block of a paged KV cache is a few pages somewhere in gigabytes, and each of
 * them otherwise waits for its page walk, then its first line, only when the copy reaches it. Here,
 * scattered 32 KiB blocks of a 1.25 GiB copy, one thread: 10.3 -> 12.1 GiB/s. */
static inline void
prefetch_range(const void *dst, const void *src, size_t n, int stream)
{
#if defined(__x86_64__)
    if (stream && n >= STREAM_RANGE_MIN) {
        size_t upto = n < STREAM_PREFETCH_MAX ? n : STREAM_PREFETCH_MAX;
        for (size_t p = 0; p < upto; p += 4096) {
            _mm_prefetch((const char *)src + p, _MM_HINT_T0);
            _mm_prefetch((const char *)dst + p, _MM_HINT_NTA);
        }
    }
#else
    (void)dst, (void)src, (void)n, (void)stream;
#endif
}

/* An exact Python int in [0, 2**64) into *out; 0 if it is not one (no exception left set). */
static int
exact_u64(PyObject *obj, uint64_t *out)
{
    if (!PyLong_CheckExact(obj))
        return 0;
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* negative or too large: not eligible */
        return 0;
    }
    *out = (uint64_t)value;
    return 1;
}

/* A list of up to SMALL_MAX (local, remote, len) triples of exact ints with len > 0 and no range
 * wrapping past 2**64, into descs; their count, or -1 if the list is not such a list. */
static Py_ssize_t
parse_descs(PyObject *list, desc_t *descs)
{
    if (!PyList_CheckExact(list))
        return -1;
    Py_ssize_t count = PyList_GET_SIZE(list);
    if (count == 0 || count > SMALL_MAX)
        return -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        PyObject **fields;
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 3) /* tuples and TransferOpDesc */
            fields = &PyTuple_GET_ITEM(item, 0);
        else if (PyList_CheckExact(item) && PyList_GET_SIZE(item) == 3)
            fields = &PyList_GET_ITEM(item, 0);
        else
            return -1;
        desc_t *d = &descs[i];
        if (!exact_u64(fields[0], &d->local) || !exact_u64(fields[1], &d->remote) || !exact_u64(fields[2], &d->len))
            return -1;
        if (d->len == 0 || d->local + d->len < d->local || d->remote + d->len < d->remote)
            return -1;
    }
    return count;
}

/* The index of the interval of sorted, disjoint starts/ends (lists of exact ints) holding
 * [addr, addr + len); -1 if none does, -2 with an exception set if a list is malformed. */
static Py_ssize_t
find_interval(PyObject *starts, PyObject *ends, uint64_t addr, uint64_t len)
{
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(starts);
    while (lo < hi) { /* bisect_right */
        Py_ssize_t mid = lo + (hi - lo) / 2;
        uint64_t start;
        if (!exact_u64(PyList_GET_ITEM(starts, mid), &start))
            goto malformed;
        if (addr < start)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (lo == 0)
        return -1;
    uint64_t end;
    if (lo - 1 >= PyList_GET_SIZE(ends) || !exact_u64(PyList_GET_ITEM(ends, lo - 1), &end))
        goto malformed;
    return (addr <= end && len <= end - addr) ? lo - 1 : -1;
malformed:
    PyErr_SetString(PyExc_ValueError, "interval lists must be equally long lists of ints in [0, 2**64)");
    return -2;
}

static int
lists(PyObject *const *args, Py_ssize_t first, Py_ssize_t count)
{
    for (Py_ssize_t i = first; i < first + count; i++) {
        if (!PyList_CheckExact(args[i])) {
            PyErr_SetString(PyExc_TypeError, "interval tables must be lists");
            return 0;
        }
    }
    return 1;
}

PyDoc_STRVAR(check_small_doc,
"check_small(descs, local_starts, local_ends, remote_starts, remote_ends) -> int | None\n\n"
"The total length of ``descs`` if it is a small list of (local, remote, len) int triples, every\n"
"local range inside one local interval and every remote range inside one remote interval; else None.");

static PyObject *
check_small(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "check_small takes 5 arguments");
        return NULL;
    }
    if (!lists(args, 1, 4))
        return NULL;
    desc_t descs[SMALL_MAX];
    Py_ssize_t count = parse_descs(args[0], descs);
    if (count < 0)
        Py_RETURN_NONE;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t here = find_interval(args[1], args[2], descs[i].local, descs[i].len);
        if (here == -2)
            return NULL;
        Py_ssize_t there = here < 0 ? -1 : find_interval(args[3], args[4], descs[i].remote, descs[i].len);
        if (there == -2)
            return NULL;
        if (there < 0 || total + descs[i].len < total)
            Py_RETURN_NONE;
        total += descs[i].len;
    }
    return PyLong_FromUnsignedLongLong(total);
}

PyDoc_STRVAR(cma_copy_doc,
"cma_copy(pid, pidfd, write, descs, generation_page, generation) -> int\n\n"
"One process_vm_writev (write) or process_vm_readv of a small list of (local, remote, len)\n"
"descriptors with process ``pid``, if the 8-byte generation at the start of ``generation_page``\n"
"(a buffer: the peer's mapped page) is ``generation`` and the process ``pidfd`` pins still exists.\n"
"The bytes moved; a negative number if nothing was tried or the call failed (-errno).");

/* What cma_copy answers besides bytes moved and -errno. */
#define CMA_INELIGIBLE (-(1L << 20))
#define CMA_STALE (CMA_INELIGIBLE - 1)
#define CMA_GONE (CMA_INELIGIBLE - 2)

/* The peer's generation at the start of its mapped page `page` into *out: 0 if the page cannot be
 * read (closed by the channel: no exception left set). */
static int
read_generation(PyObject *page, uint64_t *out)
{
    Py_buffer view;
    if (PyObject_GetBuffer(page, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return 0;
    }
    uint64_t generation = 0;
    if (view.len >= 8) {
        const unsigned char *bytes = view.buf;
        for (int i = 7; i >= 0; i--) /* little-endian, as the peer writes it ("<Q") */
            generation = (generation << 8) | bytes[i];
    }
    PyBuffer_Release(&view);
    *out = generation;
    return 1;
}

/* cma_copy's and CmaSmall's steps once descs are parsed: the generation check, then one pread or
 * pwrite on the peer's `proc_mem` (-1: none) for one descriptor of up to PROC_MEM_MAX bytes, or the
 * liveness check and one process_vm_* call (the GIL released around it from GIL_FREE_FROM bytes). */
static int64_t lanes_copy_iovs(pid_t pid, int write, const struct iovec *local, const struct iovec *remote,
                               Py_ssize_t count, uint64_t total, int lanes);

/* Whether the process `pidfd` pins has not exited: a pidfd turns readable when its process exits
 * (before it is reaped, which is what would free its pid for reuse). A poll() with no wait costs
 * ~0.35 us here against ~0.51 for signal 0 through pidfd_send_signal, on every process_vm_* call's
 * path; a closed descriptor answers POLLNVAL (gone). Interrupted, it asks again. */
static int
pidfd_running(long pidfd)
{
    if (pidfd < 0 || pidfd > INT_MAX)
        return 0;
    struct pollfd watch = {.fd = (int)pidfd, .events = POLLIN};
    int ready;
    do {
        ready = poll(&watch, 1, 0);
    } while (ready < 0 && errno == EINTR);
    return ready == 0;
}

static long
cma_checked_call(long pid, long pidfd, long proc_mem, int write, const desc_t *descs, Py_ssize_t count,
                 PyObject *page, uint64_t expected, int lanes)
{
    uint64_t generation;
    if (!read_generation(page, &generation))
        return CMA_INELIGIBLE; /* closed: the general path reports it */
    if (generation != expected)
        return CMA_STALE;
    if (proc_mem >= 0 && count == 1 && descs[0].len <= PROC_MEM_MAX && descs[0].remote <= (uint64_t)INT64_MAX) {
        /* The peer's /proc/<pid>/mem, opened and proven by the channel, holds its address space
         * itself, not its pid: a pid given to another process cannot redirect it, and once the
         * process has exited it reads and writes 0 bytes. So no liveness check is needed — one
         * system call instead of two, and the second (then pidfd_send_signal, ~0.55 us here)
         * cost a third of an 8-byte transfer_sync. */
        void *here = (void *)(uintptr_t)descs[0].local;
        ssize_t moved = write ? pwrite((int)proc_mem, here, descs[0].len, (off_t)descs[0].remote)
                              : pread((int)proc_mem, here, descs[0].len, (off_t)descs[0].remote);
        return moved < 0 ? -(long)errno : (long)moved;
    }
    if (!pidfd_running(pidfd)) /* (its pid not reused: the copy below goes by pid) */
        return CMA_GONE;
    struct iovec local[SMALL_MAX], remote[SMALL_MAX];
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        local[i].iov_base = (void *)(uintptr_t)descs[i].local;
        local[i].iov_len = descs[i].len;
        remote[i].iov_base = (void *)(uintptr_t)descs[i].remote;
        remote[i].iov_len = descs[i].len;
        total += descs[i].len;
    }
    ssize_t moved;
    int err = 0;
    if (lanes > 1 && total >= LANE_FROM) {
        int64_t all;
        Py_BEGIN_ALLOW_THREADS
        all = lanes_copy_iovs((pid_t)pid, write, local, remote, count, total, lanes);
        Py_END_ALLOW_THREADS
        return (long)all;
    } else if (total >= GIL_FREE_FROM) {
        Py_BEGIN_ALLOW_THREADS
        moved = write ? process_vm_writev((pid_t)pid, local, count, remote, count, 0)
                      : process_vm_readv((pid_t)pid, local, count, remote, count, 0);
        err = errno;
        Py_END_ALLOW_THREADS
    } else {
        moved = write ? process_vm_writev((pid_t)pid, local, count, remote, count, 0)
                      : process_vm_readv((pid_t)pid, local, count, remote, count, 0);
        err = errno;
    }
    return moved < 0 ? -(long)err : (long)moved;
}

static PyObject *
cma_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "cma_copy takes 6 arguments");
        return NULL;
    }
    long pid = PyLong_AsLong(args[0]);
    long pidfd = PyLong_AsLong(args[1]);
    int write = PyObject_IsTrue(args[2]);
    unsigned long long expected = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred() || write < 0)
        return NULL;
    desc_t descs[SMALL_MAX];
    Py_ssize_t count = parse_descs(args[3], descs);
    if (count < 0 || count > IOV_MAX)
        return PyLong_FromLong(CMA_INELIGIBLE);
    return PyLong_FromLong(cma_checked_call(pid, pidfd, -1, write, descs, count, args[4], expected, 1));
}

/* ---- copy lanes: one window of a copy split over threads ------------------------------------
 *
 * One process_vm_* call (or memcpy) runs at one core's copy speed; a window copied by several
 * threads at once runs at several. The threads take the window's bytes piece by piece, each piece
 * (every cut but the last on a multiple of 4 KiB of the window) a share of what is left — half of
 * it for two lanes, down to LANE_PIECE_MIN — so whoever is free takes the next: a thread that woke
 * late, or ran on a slower or busier core, leaves its share to the others instead of keeping the
 * window waiting for it, and all of them end within about one small piece of each other. The
 * calling thread copies too, with the GIL released; the others are a few C threads (no Python in
 * them: they never wait for the GIL), started on first need and shared by the whole process. The
 * caller returns once every piece has ended, so a window is one step for the Python that decides:
 * it takes the lease and the request's lock before, and they cover every lane's bytes. */

#define LANE_ALIGN 4096u
#define LANE_IOVS 1024 /* iovecs per syscall within a piece */

enum { LANE_CMA, LANE_MEMCPY };

/* A window's entries: cma's iovec pairs (equal lengths), or copy_pieces' rows and heres. */
typedef struct {
    int kind, write, stream; /* stream: memcpy entries with copy_bytes' streaming stores */
    pid_t pid;
    const struct iovec *local, *remote;
    const uint64_t *rows, *heres;
    Py_ssize_t count;
} lane_work_t;

/* The smallest piece a lane takes, but for the window's last: ~45 us of copying here, the most the
 * lanes of a window end apart once the window is shared out, and a syscall's fixed cost (~1-2 us)
 * still small beside it. */
#define LANE_PIECE_MIN (256u << 10)

/* One window being copied: what is left to hand out, and how its pieces ended. Under lane_lock. */
typedef struct {
    const lane_work_t *work;
    int lanes;
    uint64_t total, claimed; /* bytes of the window, and handed out so far */
    Py_ssize_t next; /* the next piece starts `offset` bytes into entry `next` */
    uint64_t offset;
    int64_t error; /* -errno of the first piece that failed, else 0 */
    int stuck; /* a piece moved fewer bytes than it had */
    int helpers; /* lane threads asked to help and not yet done */
} lane_job_t;

/* A lane thread's invitation to help with a job: queued until a thread takes it. */
typedef struct lane_help {
    lane_job_t *job;
    struct lane_help *next;
} lane_help_t;

static pthread_mutex_t lane_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t lane_work_cond = PTHREAD_COND_INITIALIZER, lane_done_cond = PTHREAD_COND_INITIALIZER;
static lane_help_t *lane_queue, *lane_queue_tail;
static int lane_threads;

static uint64_t
entry_len(const lane_work_t *w, Py_ssize_t i)
{
    return w->kind == LANE_CMA ? (uint64_t)w->local[i].iov_len : w->rows[3 * i + 2];
}

/* Move the place `offset` bytes into entry *i on by `step` bytes of `w`'s entries (not past their end). */
static void
entry_advance(const lane_work_t *w, Py_ssize_t *i, uint64_t *offset, uint64_t step)
{
    while (step > 0 && *i < w->count) {
        uint64_t rest = entry_len(w, *i) - *offset;
        if (step < rest) {
            *offset += step;
            return;
        }
        step -= rest;
        (*i)++;
        *offset = 0;
    }
}

/* iov[0..n) with `len` bytes at `base` after them: the last entry grown if it ends at `base`,
 * else a new one. The new count. */
static int
iov_append(struct iovec *iov, int n, char *base, uint64_t len)
{
    if (n > 0 && (char *)iov[n - 1].iov_base + iov[n - 1].iov_len == base) {
        iov[n - 1].iov_len += (size_t)len;
        return n;
    }
    iov[n].iov_base = base;
    iov[n].iov_len = (size_t)len;
    return n + 1;
}

/* Copy one piece; bytes moved (fewer only if the kernel moved nothing more) or -errno. */
static int64_t
lane_copy(const lane_work_t *w, Py_ssize_t i, uint64_t offset, uint64_t bytes)
{
    uint64_t done = 0;
    if (w->kind == LANE_MEMCPY) {
        for (; done < bytes && i < w->count; i++, offset = 0) {
            uint64_t n = w->rows[3 * i + 2] - offset;
            if (n > bytes - done)
                n = bytes - done;
            char *local = (char *)(uintptr_t)(w->rows[3 * i] + offset), *there = (char *)(uintptr_t)(w->heres[i] + offset);
            if (i + 1 < w->count && done + n < bytes) { /* the piece goes on into the next row */
                char *next_local = (char *)(uintptr_t)w->rows[3 * (i + 1)], *next_there = (char *)(uintptr_t)w->heres[i + 1];
                uint64_t next_len = w->rows[3 * (i + 1) + 2];
                prefetch_range(w->write ? next_there : next_local, w->write ? next_local : next_there, next_len, w->stream);
            }
            if (w->write)
                copy_bytes(there, local, n, w->stream);
            else
                copy_bytes(local, there, n, w->stream);
            done += n;
        }
        return (int64_t)done;
    }
    struct iovec local[LANE_IOVS], remote[LANE_IOVS];
    while (done < bytes && i < w->count) {
        int n = 0, nl = 0, nr = 0;
        uint64_t want = 0, o = offset;
        for (Py_ssize_t j = i; n < LANE_IOVS && j < w->count && want < bytes - done; j++, o = 0, n++) {
            uint64_t take = w->local[j].iov_len - o;
            if (take > bytes - done - want)
                take = bytes - done - want;
            /* Each side's entries that continue one another become one iovec of that side: the
             * kernel pins the remote pages per remote iovec (the page-table lock taken each time,
             * ~1.5 us for a 32 KiB block), so blocks adjacent over there but not here — half the
             * blocks of a paged KV pull sorted by remote address — cost one pinning, not two. */
            nl = iov_append(local, nl, (char *)w->local[j].iov_base + o, take);
            nr = iov_append(remote, nr, (char *)w->remote[j].iov_base + o, take);
            want += take;
        }
        ssize_t moved = w->write ? process_vm_writev(w->pid, local, nl, remote, nr, 0)
                                 : process_vm_readv(w->pid, local, nl, remote, nr, 0);
        if (moved < 0)
            return -(int64_t)errno;
        if (moved == 0)
            break; /* no progress: the caller sees a short piece */
        done += (uint64_t)moved;
        entry_advance(w, &i, &offset, (uint64_t)moved);
    }
    return (int64_t)done;
}

/* The next piece of `job` into *first, *offset, *bytes; 0 once nothing is left to hand out (or a
 * piece failed: the others stop where they are). Call under lane_lock. */
static int
lane_claim(lane_job_t *job, Py_ssize_t *first, uint64_t *offset, uint64_t *bytes)
{
    uint64_t left = job->total - job->claimed;
    if (left == 0 || job->error != 0 || job->stuck)
        return 0;
    uint64_t piece = (left / (uint64_t)job->lanes + LANE_ALIGN - 1) / LANE_ALIGN * LANE_ALIGN;
    if (piece < LANE_PIECE_MIN)
        piece = LANE_PIECE_MIN;
    if (piece > left)
        piece = left;
    *first = job->next;
    *offset = job->offset;
    *bytes = piece;
    job->claimed += piece;
    entry_advance(job->work, &job->next, &job->offset, piece); /* to where the next begins */
    return 1;
}

/* Copy pieces of `job` until none is left. Call under lane_lock; it is let go around each copy. */
static void
lane_run(lane_job_t *job)
{
    Py_ssize_t first;
    uint64_t offset, bytes;
    while (lane_claim(job, &first, &offset, &bytes)) {
        pthread_mutex_unlock(&lane_lock);
        int64_t moved = lane_copy(job->work, first, offset, bytes);
        pthread_mutex_lock(&lane_lock);
        if (moved < 0 && job->error == 0)
            job->error = moved;
        else if (moved >= 0 && (uint64_t)moved != bytes)
            job->stuck = 1;
    }
}

static void *
lane_main(void *unused)
{
    pthread_mutex_lock(&lane_lock);
    for (;;) {
        while (lane_queue == NULL)
            pthread_cond_wait(&lane_work_cond, &lane_lock);
        lane_help_t *help = lane_queue;
        lane_queue = help->next;
        if (lane_queue == NULL)
            lane_queue_tail = NULL;
        lane_job_t *job = help->job;
        lane_run(job);
        if (--job->helpers == 0)
            pthread_cond_broadcast(&lane_done_cond);
    }
    return NULL;
}

/* Take `job`'s invitations no thread has taken off the queue: it has nothing left to hand out. The
 * count taken. Call under lane_lock. */
static int
lane_unqueue(const lane_job_t *job)
{
    int taken = 0;
    lane_help_t *prev = NULL;
    for (lane_help_t *help = lane_queue; help != NULL;) {
        lane_help_t *next = help->next;
        if (help->job != job) {
            prev = help;
        } else {
            if (prev != NULL)
                prev->next = next;
            else
                lane_queue = next;
            if (lane_queue_tail == help)
                lane_queue_tail = prev;
            taken++;
        }
        help = next;
    }
    return taken;
}

/* After fork: the child has none of the parent's lane threads (nor its queue). */
static void
lanes_after_fork(void)
{
    pthread_mutex_init(&lane_lock, NULL);
    pthread_cond_init(&lane_work_cond, NULL);
    pthread_cond_init(&lane_done_cond, NULL);
    lane_queue = lane_queue_tail = NULL;
    lane_threads = 0;
}

/* Copy `total` bytes of `w`'s entries from `offset` bytes into entry `first` over up to `lanes`
 * lanes, the calling thread being one; call with the GIL released. The bytes moved if every piece
 * moved all of its bytes; else -errno of the first piece that failed, or 0 (a piece made no
 * progress). One lane: lane_copy's answer (a short count included). */
static int64_t
lanes_copy(const lane_work_t *w, Py_ssize_t first, uint64_t offset, uint64_t total, int lanes)
{
    if (lanes > MAX_LANES)
        lanes = MAX_LANES;
    if (lanes <= 1 || total < LANE_FROM)
        return lane_copy(w, first, offset, total);
    lane_job_t job = {w, lanes, total, 0, first, offset, 0, 0, lanes - 1};
    lane_help_t helps[MAX_LANES];
    pthread_mutex_lock(&lane_lock);
    for (int k = 0; k < lanes - 1; k++) {
        helps[k] = (lane_help_t){&job, NULL};
        if (lane_queue_tail != NULL)
            lane_queue_tail->next = &helps[k];
        else
            lane_queue = &helps[k];
        lane_queue_tail = &helps[k];
    }
    while (lane_threads < lanes - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, lane_main, NULL);
        pthread_attr_destroy(&attr);
        if (failed)
            break; /* (the window is still copied: here, and on the threads there are) */
        lane_threads++;
    }
    pthread_cond_broadcast(&lane_work_cond);
    lane_run(&job);
    /* Nothing is left to hand out: the invitations not yet taken are withdrawn (a thread that has
     * not woken by now would find nothing), and the window waits only for pieces being copied. */
    job.helpers -= lane_unqueue(&job);
    while (job.helpers > 0)
        pthread_cond_wait(&lane_done_cond, &lane_lock);
    pthread_mutex_unlock(&lane_lock);
    if (job.error != 0)
        return job.error;
    return job.stuck ? 0 : (int64_t)total;
}

static int64_t
lanes_copy_iovs(pid_t pid, int write, const struct iovec *local, const struct iovec *remote, Py_ssize_t count,
                uint64_t total, int lanes)
{
    lane_work_t w = {LANE_CMA, write, 0, pid, local, remote, NULL, NULL, count};
    return lanes_copy(&w, 0, 0, total, lanes);
}

/* The arguments cma_window and cma_windows begin with — pid, write, local_iovs, remote_iovs, count
 * (>= 0), lanes — as a copy's entries and its lanes; 0 with an exception set if one is not that, or
 * if `name` was not given `expected` arguments in all. */
static int
iov_call_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected, const char *name, lane_work_t *w,
              long *lanes)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, expected);
        return 0;
    }
    long pid = PyLong_AsLong(args[0]);
    int write = PyObject_IsTrue(args[1]);
    unsigned long long local = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long remote = PyLong_AsUnsignedLongLong(args[3]);
    Py_ssize_t count = PyLong_AsSsize_t(args[4]);
    *lanes = PyLong_AsLong(args[5]);
    if (PyErr_Occurred() || write < 0)
        return 0;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "count must be >= 0");
        return 0;
    }
    *w = (lane_work_t){LANE_CMA, write, 0, (pid_t)pid, (const struct iovec *)(uintptr_t)local,
                       (const struct iovec *)(uintptr_t)remote, NULL, NULL, count};
    return 1;
}

PyDoc_STRVAR(cma_window_doc,
"cma_window(pid, write, local_iovs, remote_iovs, count, lanes) -> int\n\n"
"process_vm_writev (write) or process_vm_readv of ``count`` iovec pairs at addresses ``local_iovs``\n"
"and ``remote_iovs`` (equal lengths pairwise), split over up to ``lanes`` threads from LANE_FROM\n"
"bytes; the GIL released from GIL_FREE_FROM bytes. One lane: one call, its answer (the bytes\n"
"moved, or -errno). Several: the bytes if every piece moved all of its own, else -errno of a piece\n"
"that failed, or 0.");

static PyObject *
cma_window(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    lane_work_t w;
    long lanes;
    if (!iov_call_args(args, nargs, 6, "cma_window", &w, &lanes))
        return NULL;
    Py_ssize_t count = w.count;
    if (count < 1 || count > IOV_MAX) {
        PyErr_SetString(PyExc_ValueError, "count must be in [1, IOV_MAX]");
        return NULL;
    }
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        total += w.local[i].iov_len;
    int64_t moved;
    if (lanes > 1 && total >= LANE_FROM) {
        Py_BEGIN_ALLOW_THREADS
        moved = lanes_copy(&w, 0, 0, total, (int)lanes);
        Py_END_ALLOW_THREADS
    } else { /* one call, as cma_copy makes it */
        int err = 0;
        PyThreadState *released = total >= GIL_FREE_FROM ? PyEval_SaveThread() : NULL;
        moved = w.write ? process_vm_writev(w.pid, w.local, count, w.remote, count, 0)
                      : process_vm_readv(w.pid, w.local, count, w.remote, count, 0);
        err = errno;
        if (released != NULL)
            PyEval_RestoreThread(released);
        if (moved < 0)
            moved = -(int64_t)err;
    }
    return PyLong_FromLongLong(moved);
}

/* A C-contiguous buffer of 8-byte unsigned ints with the given number of dimensions. */
static int
u64_buffer(PyObject *obj, Py_buffer *view, int ndim, Py_ssize_t columns, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return 0;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "Q") != 0 && strcmp(f, "L") != 0) || view->ndim != ndim ||
        (ndim == 2 && view->shape[1] != columns)) {
        if (ndim == 2)
            PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous uint64 array of shape (n, %zd)", what, columns);
        else
            PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous uint64 array of one dimension", what);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(mapped_copy_doc,
"mapped_copy(descs, write, starts, ends, heres, writable, lanes=1) -> int\n\n"
"Copy a small list of (local, remote, len) descriptors through the peer's memory mapped here:\n"
"mapping i covers the peer's [starts[i], ends[i]) at address heres[i], writable if writable[i] is\n"
"True. 1: all were mapped (writably, for a write) and are copied (from LANE_FROM bytes, split over\n"
"up to ``lanes`` threads); 0: none was, nothing copied; -1: some were, or descs is not such a list,\n"
"nothing copied.");

static PyObject *
mapped_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "mapped_copy takes 6 or 7 arguments");
        return NULL;
    }
    int write = PyObject_IsTrue(args[1]);
    long lanes = nargs == 7 ? PyLong_AsLong(args[6]) : 1;
    if (write < 0 || (lanes == -1 && PyErr_Occurred()) || !lists(args, 2, 4))
        return NULL;
    PyObject *starts = args[2], *ends = args[3], *heres = args[4], *writable = args[5];
    desc_t descs[SMALL_MAX];
    uint64_t rows[3 * SMALL_MAX], theres[SMALL_MAX]; /* as copy_pieces takes them: local, remote, len; where mapped */
    Py_ssize_t count = parse_descs(args[0], descs);
    if (count < 0)
        return PyLong_FromLong(-1);
    Py_ssize_t mapped = 0;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t m = find_interval(starts, ends, descs[i].remote, descs[i].len);
        if (m == -2)
            return NULL;
        if (m >= 0 && write && (m >= PyList_GET_SIZE(writable) || PyList_GET_ITEM(writable, m) != Py_True))
            m = -1;
        if (m < 0)
            continue;
        uint64_t here, start;
        if (m >= PyList_GET_SIZE(heres) || !exact_u64(PyList_GET_ITEM(heres, m), &here) ||
            !exact_u64(PyList_GET_ITEM(starts, m), &start)) {
            PyErr_SetString(PyExc_ValueError, "heres must list an int address per mapping");
            return NULL;
        }
        rows[3 * i] = descs[i].local;
        rows[3 * i + 1] = descs[i].remote;
        rows[3 * i + 2] = descs[i].len;
        theres[i] = here + (descs[i].remote - start);
        total += descs[i].len;
        mapped++;
    }
    if (mapped != count)
        return PyLong_FromLong(mapped == 0 ? 0 : -1);
    if (total >= GIL_FREE_FROM) {
        lane_work_t w = {LANE_MEMCPY, write, total >= STREAM_FROM, 0, NULL, NULL, rows, theres, count};
        Py_BEGIN_ALLOW_THREADS
        lanes_copy(&w, 0, 0, total, (int)lanes);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            void *local = (void *)(uintptr_t)rows[3 * i], *there = (void *)(uintptr_t)theres[i];
            memcpy(write ? there : local, write ? local : there, descs[i].len);
        }
    }
    return PyLong_FromLong(1);
}

PyDoc_STRVAR(copy_pieces_doc,
"copy_pieces(pieces, heres, write, lanes=1, stream=False) -> None\n\n"
"For every row i of ``pieces`` ((n, 3) uint64: local, remote, len) copy len bytes between the\n"
"local address and heres[i] (where the remote range is mapped here): to heres[i] if ``write``,\n"
"from it otherwise. In row order (from LANE_FROM bytes on, split over up to ``lanes`` threads:\n"
"row order within each); the GIL is released for large totals. ``stream`` (or STREAM_FROM bytes\n"
"in this call): rows of a page or more are written with streaming stores, past the caches.");

static PyObject *
copy_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 3 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "copy_pieces takes 3 to 5 arguments");
        return NULL;
    }
    int write = PyObject_IsTrue(args[2]);
    long lanes = nargs >= 4 ? PyLong_AsLong(args[3]) : 1;
    int stream = nargs == 5 ? PyObject_IsTrue(args[4]) : 0;
    if (write < 0 || stream < 0 || (lanes == -1 && PyErr_Occurred()))
        return NULL;
    Py_buffer pv, hv;
    if (!u64_buffer(args[0], &pv, 2, 3, "pieces"))
        return NULL;
    if (!u64_buffer(args[1], &hv, 1, 0, "heres")) {
        PyBuffer_Release(&pv);
        return NULL;
    }
    Py_ssize_t count = pv.shape[0];
    if (hv.shape[0] != count) {
        PyErr_SetString(PyExc_ValueError, "pieces and heres must have as many rows");
        PyBuffer_Release(&pv);
        PyBuffer_Release(&hv);
        return NULL;
    }
    const uint64_t *rows = pv.buf, *heres = hv.buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        total += rows[3 * i + 2];
    stream = stream || total >= STREAM_FROM;
    /* The rows in order: one lane's loop (lanes_copy keeps a copy under LANE_FROM in one lane). */
    lane_work_t w = {LANE_MEMCPY, write, stream, 0, NULL, NULL, rows, heres, count};
    if (total >= GIL_FREE_FROM) {
        Py_BEGIN_ALLOW_THREADS
        lanes_copy(&w, 0, 0, total, (int)lanes);
        Py_END_ALLOW_THREADS
    } else {
        lane_copy(&w, 0, 0, total);
    }
    PyBuffer_Release(&pv);
    PyBuffer_Release(&hv);
    Py_RETURN_NONE;
}

/* ---- weights_hash, copy_hash: hixl.weights' checksum (why this one: hixl/weights/_checks.py) -- */

/* The key and multiplier of word i are those of i mod HASH_KEYS; the last pair is the byte
 * length's. Drawn at import from SplitMix64's sequence from HASH_SEED, as pure.py draws them. */
#define HASH_KEYS 256
#define HASH_SEED 0x68786c2d6d6c6836ull /* "hxl-mlh6" */
static uint64_t hash_k[HASH_KEYS + 1], hash_m[HASH_KEYS + 1];

static uint64_t
splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void
hash_tables_init(void)
{
    uint64_t state = HASH_SEED;
    for (int i = 0; i <= HASH_KEYS; i++) {
        hash_k[i] = splitmix64(&state);
        hash_m[i] = splitmix64(&state) | 1; /* odd: multiplying by it loses no difference */
    }
}

static inline uint64_t
load_le64(const unsigned char *p)
{
    uint64_t w;
    memcpy(&w, p, 8); /* any alignment: the compiler makes it one load */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

/* The hash of n bytes at src, copying them to dst on the way if dst is not NULL (each word is
 * hashed as it was stored: the hash is of what landed). One pass, one multiply per word: the
 * additions need not wait for each other's multiplies, so this runs at memory speed. */
static uint64_t
hash_bytes(unsigned char *dst, const unsigned char *src, size_t n)
{
    uint64_t h = 0;
    size_t words = n / 8, i = 0;
    while (i < words) {
        size_t run = words - i < HASH_KEYS ? words - i : HASH_KEYS; /* i is a multiple of HASH_KEYS */
        const unsigned char *s = src + 8 * i;
        if (dst != NULL) {
            unsigned char *d = dst + 8 * i;
            for (size_t j = 0; j < run; j++) {
                uint64_t w;
                memcpy(&w, s + 8 * j, 8);
                memcpy(d + 8 * j, &w, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
                w = __builtin_bswap64(w);
#endif
                h += (w ^ hash_k[j]) * hash_m[j];
            }
        } else {
            for (size_t j = 0; j < run; j++)
                h += (load_le64(s + 8 * j) ^ hash_k[j]) * hash_m[j];
        }
        i += run;
    }
    size_t tail = n % 8;
    if (tail) {
        unsigned char last[8] = {0}; /* the tail, zero-padded into one more word */
        memcpy(last, src + 8 * words, tail);
        if (dst != NULL)
            memcpy(dst + 8 * words, last, tail);
        h += (load_le64(last) ^ hash_k[words % HASH_KEYS]) * hash_m[words % HASH_KEYS];
    }
    return h + ((uint64_t)n ^ hash_k[HASH_KEYS]) * hash_m[HASH_KEYS]; /* "abc" and "abc\0" differ */
}

/* hash_bytes, with the GIL released from GIL_FREE_FROM bytes (the caller holds the buffers). */
static uint64_t
hash_bytes_gil(unsigned char *dst, const unsigned char *src, size_t n)
{
    if (n < GIL_FREE_FROM)
        return hash_bytes(dst, src, n);
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = hash_bytes(dst, src, n);
    Py_END_ALLOW_THREADS
    return h;
}

/* A C-contiguous buffer of obj (writable if asked), acquired as memoryview(obj) acquires it, so
 * that the pure twin refuses the same objects with the same errors. */
static int
hash_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FULL_RO) < 0)
        return 0;
    if (!PyBuffer_IsContiguous(view, 'C') || (writable && view->readonly)) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", what, writable ? " writable" : "");
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(weights_hash_doc,
"weights_hash(buffer) -> int\n\n"
"The 64-bit checksum of a C-contiguous buffer's bytes (hixl.weights' \"mlh64\": see\n"
"hixl/weights/_checks.py); the GIL released from GIL_FREE_FROM bytes.");

static PyObject *
weights_hash(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "weights_hash takes 1 argument");
        return NULL;
    }
    Py_buffer v;
    if (!hash_buffer(args[0], &v, 0, "buffer"))
        return NULL;
    uint64_t h = hash_bytes_gil(NULL, v.buf, (size_t)v.len);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(copy_hash_doc,
"copy_hash(dst, src) -> int\n\n"
"Copy src's bytes into dst (C-contiguous buffers of one size that do not overlap) and return\n"
"weights_hash of what landed, in one pass; the GIL released from GIL_FREE_FROM bytes.");

static PyObject *
copy_hash(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy_hash takes 2 arguments");
        return NULL;
    }
    Py_buffer d, s;
    if (!hash_buffer(args[0], &d, 1, "dst"))
        return NULL;
    if (!hash_buffer(args[1], &s, 0, "src")) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (d.len != s.len) {
        PyErr_Format(PyExc_ValueError, "copy_hash: dst has %zd bytes, src %zd", d.len, s.len);
        PyBuffer_Release(&d);
        PyBuffer_Release(&s);
        return NULL;
    }
    uint64_t h = hash_bytes_gil(d.buf, s.buf, (size_t)s.len);
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return PyLong_FromUnsignedLongLong(h);
}

/* ---- row_hashes: the hash a hixl.weights table row carries (the format: hixl/weights/_rows.py) -- */

static inline uint64_t
mix64(uint64_t x) /* SplitMix64's finalizer */
{
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

#define ROW_MAX_WORDS 4096 /* keys on the stack: rows of up to 32 KiB */

/* keys[0]: the sequence word's; keys[j - 1]: payload word j's (the hash word, 1, has none). */
static void
row_keys(uint64_t *keys, Py_ssize_t width)
{
    for (Py_ssize_t i = 0; i < width - 1; i++)
        keys[i] = mix64((uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull);
}

/* The hash of one row of `width` words (its hash word left out). Four sums, four words a step:
 * the words' finalizers are independent, and one sum would make each step wait for the last
 * (1024 rows of 34 words: ~66 -> ~34 us here); the sum is the same in any order. */
static uint64_t
row_hash_scalar(const unsigned char *row, Py_ssize_t width, const uint64_t *keys)
{
    uint64_t w, a, b = 0, c = 0, d = 0;
    memcpy(&w, row, 8);
    a = mix64(w ^ keys[0]);
    Py_ssize_t j = 2;
    for (; j + 4 <= width; j += 4) {
        uint64_t x[4];
        memcpy(x, row + 8 * j, 32);
        a += mix64(x[0] ^ keys[j - 1]);
        b += mix64(x[1] ^ keys[j]);
        c += mix64(x[2] ^ keys[j + 1]);
        d += mix64(x[3] ^ keys[j + 2]);
    }
    for (; j < width; j++) {
        memcpy(&w, row + 8 * j, 8);
        a += mix64(w ^ keys[j - 1]);
    }
    return a + b + c + d;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ROW_HASH_AVX512 1
/* The same sum, eight payload words a step where the CPU multiplies 64-bit lanes (AVX-512DQ's
 * vpmullq; chosen at import): the finalizer is two multiplications a word, and a reader hashes
 * every row it gathers (1024 rows of 34 words, timed alone: ~2.5x faster than four scalar sums). */
__attribute__((target("avx512f,avx512dq"))) static uint64_t
row_hash_avx512(const unsigned char *row, Py_ssize_t width, const uint64_t *keys)
{
    uint64_t w, h;
    memcpy(&w, row, 8);
    h = mix64(w ^ keys[0]);
    const __m512i m1 = _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ull);
    const __m512i m2 = _mm512_set1_epi64((long long)0x94D049BB133111EBull);
    __m512i sum = _mm512_setzero_si512();
    Py_ssize_t j = 2;
    for (; j + 8 <= width; j += 8) {
        __m512i x = _mm512_xor_si512(_mm512_loadu_si512(row + 8 * j), _mm512_loadu_si512(keys + j - 1));
        x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 30)), m1);
        x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 27)), m2);
        sum = _mm512_add_epi64(sum, _mm512_xor_si512(x, _mm512_srli_epi64(x, 31)));
    }
    /* Summed here, unsigned: _mm512_reduce_add_epi64 adds as signed long long, which overflows (UB). */
    uint64_t lanes[8];
    _mm512_storeu_si512(lanes, sum);
    for (int k = 0; k < 8; k++)
        h += lanes[k];
    for (; j < width; j++) {
        memcpy(&w, row + 8 * j, 8);
        h += mix64(w ^ keys[j - 1]);
    }
    return h;
}
#endif

/* The row hash this CPU runs fastest (set at import; every one gives the same answer). */
static uint64_t (*row_hash)(const unsigned char *row, Py_ssize_t width, const uint64_t *keys) = row_hash_scalar;

static void
row_hash_choose(void)
{
#ifdef ROW_HASH_AVX512
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"))
        row_hash = row_hash_avx512;
#endif
}

PyDoc_STRVAR(row_hashes_doc,
"row_hashes(rows, width, out) -> None\n\n"
"The hash of each row of rows (C-contiguous native uint64 words, width words a row: the sequence\n"
"word, the hash word, the payload) into out (one uint64 a row): the sum of SplitMix64's finalizer\n"
"of each word xor its position's key, the hash word left out (hixl/weights/_rows.py).");

static PyObject *
row_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "row_hashes takes 3 arguments");
        return NULL;
    }
    Py_ssize_t width = PyLong_AsSsize_t(args[1]);
    if (width == -1 && PyErr_Occurred())
        return NULL;
    if (width < 2 || width > ROW_MAX_WORDS) {
        PyErr_Format(PyExc_ValueError, "row_hashes: width must be 2 to %d words, not %zd", ROW_MAX_WORDS, width);
        return NULL;
    }
    Py_buffer r, o;
    if (!hash_buffer(args[0], &r, 0, "rows"))
        return NULL;
    if (!hash_buffer(args[2], &o, 1, "out")) {
        PyBuffer_Release(&r);
        return NULL;
    }
    Py_ssize_t n = o.len / 8;
    if (r.len % (8 * width) || o.len % 8 || r.len / (8 * width) != n) {
        PyErr_Format(PyExc_ValueError, "row_hashes: %zd bytes of rows of %zd words need %zd bytes of out, not %zd",
                     r.len, width, r.len / (8 * width) * 8, o.len);
        PyBuffer_Release(&r);
        PyBuffer_Release(&o);
        return NULL;
    }
    uint64_t keys[ROW_MAX_WORDS];
    row_keys(keys, width);
    const unsigned char *row = r.buf;
    unsigned char *dst = o.buf;
    for (Py_ssize_t k = 0; k < n; k++, row += 8 * width) {
        uint64_t h = row_hash(row, width, keys);
        memcpy(dst + 8 * k, &h, 8);
    }
    PyBuffer_Release(&r);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* A C-contiguous buffer of native 8-byte signed ints of one dimension (a numpy int64 array). */
static int
i64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FULL_RO) < 0)
        return 0;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0) || view->ndim != 1 ||
        !PyBuffer_IsContiguous(view, 'C') || (writable && view->readonly)) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s int64 array of one dimension", what,
                     writable ? " writable" : "");
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* How many rows ahead gather_rows asks memory for: a random row is a cache (and TLB) miss, and
 * with eight rows' lines asked for ahead the misses overlap (1024 rows of 272 bytes from a
 * 272 MiB mapping, timed alone: ~82 -> ~53 us; more ahead gains nothing). */
#define GATHER_AHEAD 8

/* Ask memory for every line of row `row` of the table of stride-byte rows at src (a gather's row ahead). */
static inline void
prefetch_row(unsigned long long src, int64_t row, Py_ssize_t stride)
{
    const char *ahead = (const char *)(uintptr_t)(src + (uint64_t)row * (uint64_t)stride);
    for (Py_ssize_t line = 0; line < stride; line += 64)
        __builtin_prefetch(ahead + line);
}

PyDoc_STRVAR(gather_rows_doc,
"gather_rows(dst, src, stride, rows) -> None\n\n"
"Copy row rows[i] of the table of stride-byte rows at address src (rows[i] * stride bytes on, in\n"
"64-bit arithmetic) to address dst + i * stride, for every i: rows is a C-contiguous int64 array\n"
"of one dimension. ValueError, nothing copied, if a row number is negative or stride is not\n"
"positive; the GIL released from GIL_FREE_FROM bytes. Nothing else is checked: the caller has\n"
"made sure that every row lies in memory it may read and dst's len(rows) * stride bytes in\n"
"memory it may write (hixl.Engine.read_rows).");

static PyObject *
gather_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "gather_rows takes 4 arguments");
        return NULL;
    }
    unsigned long long dst = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long long src = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (stride < 1) {
        PyErr_Format(PyExc_ValueError, "gather_rows: stride must be positive, not %zd", stride);
        return NULL;
    }
    Py_buffer r;
    if (!i64_buffer(args[3], &r, 0, "rows"))
        return NULL;
    const int64_t *rows = r.buf;
    Py_ssize_t n = r.len / 8;
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0) {
            PyErr_Format(PyExc_ValueError, "gather_rows: row %zd is %lld: row numbers are >= 0", i, (long long)rows[i]);
            PyBuffer_Release(&r);
            return NULL;
        }
    PyThreadState *released = (uint64_t)n * (uint64_t)stride >= GIL_FREE_FROM ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + GATHER_AHEAD < n)
            prefetch_row(src, rows[i + GATHER_AHEAD], stride);
        memcpy((char *)(uintptr_t)(dst + (uint64_t)i * (uint64_t)stride),
               (const char *)(uintptr_t)(src + (uint64_t)rows[i] * (uint64_t)stride), (size_t)stride);
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    PyBuffer_Release(&r);
    Py_RETURN_NONE;
}

/* The four buffers a row batch is checked and handed over through: what came in (a gather's row
 * numbers, or the rows' words), out, versions and torn. */
typedef struct {
    Py_buffer in, out, versions, torn;
    int held; /* how many, in that order */
} row_buffers_t;

static void
row_buffers_release(row_buffers_t *b)
{
    Py_buffer *all[] = {&b->in, &b->out, &b->versions, &b->torn};
    while (b->held > 0)
        PyBuffer_Release(all[--b->held]);
}

/* Take them (in: int64 row numbers if in_rows, else C-contiguous uint64 words); 0 with the error set
 * and none held, if one is not what it must be. */
static int
row_buffers_get(row_buffers_t *b, PyObject *in, int in_rows, PyObject *out, PyObject *versions, PyObject *torn)
{
    b->held = 0;
    if (!(in_rows ? i64_buffer(in, &b->in, 0, "rows") : hash_buffer(in, &b->in, 0, "words")))
        return 0;
    b->held = 1;
    if (!hash_buffer(out, &b->out, 1, "out"))
        goto fail;
    b->held = 2;
    if (!i64_buffer(versions, &b->versions, 1, "versions"))
        goto fail;
    b->held = 3;
    if (!i64_buffer(torn, &b->torn, 1, "torn"))
        goto fail;
    b->held = 4;
    return 1;
fail:
    row_buffers_release(b);
    return 0;
}

#if defined(__x86_64__)
/* Loads are not reordered with other loads here (x86-64's TSO), nor stores with stores: a row read
 * between two loads of its sequence word that agree (and are even) was read whole, if the writer
 * stores the word odd, then the row, then the word even (hixl.weights.Table.update). */
#define ORDERED_ROW_READS 1
#else
#define ORDERED_ROW_READS 0
#endif

PyDoc_STRVAR(gather_checked_rows_doc,
"gather_checked_rows(src, stride, rows, limit, row_bytes, out, versions, torn, check) -> int\n\n"
"A gather of table rows whose first word is a sequence number, odd while the row is written, from\n"
"the table of stride-byte rows at address src straight into out: for every i, row rows[i]'s\n"
"row_bytes payload bytes (from its third word) into out (a writable C-contiguous buffer of\n"
"row_bytes a row) and its version, the word halved, into versions (int64), the payload copied\n"
"between two loads of the word (rows ahead asked of memory meanwhile). With check, a row whose\n"
"loads differ or are odd is torn (its out and version are not to be used): returns how many\n"
"are, their positions, ascending, in torn (int64, one a row). ValueError, nothing copied, for a\n"
"row number outside [0, limit) or sizes that disagree. Only where ORDERED_ROW_READS is true (the\n"
"machine keeps loads in order) does check mean anything; the caller has made sure that the rows\n"
"may be read (hixl.Engine.read_rows).");

static PyObject *
gather_checked_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "gather_checked_rows takes 9 arguments");
        return NULL;
    }
    unsigned long long src = PyLong_AsUnsignedLongLong(args[0]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[1]);
    long long limit = PyLong_AsLongLong(args[3]);
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[4]);
    int check = PyObject_IsTrue(args[8]);
    if (PyErr_Occurred() || check < 0)
        return NULL;
    if (stride < 16 || stride % 8 || row_bytes < 0 || row_bytes > stride - 16) {
        PyErr_Format(PyExc_ValueError, "gather_checked_rows: %zd payload bytes do not fit rows of %zd bytes (a multiple of 8, >= 16)",
                     row_bytes, stride);
        return NULL;
    }
    if (src % 8) {
        PyErr_SetString(PyExc_ValueError, "gather_checked_rows: the table's address must be a multiple of 8");
        return NULL;
    }
    row_buffers_t b;
    if (!row_buffers_get(&b, args[2], 1, args[5], args[6], args[7]))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = b.in.len / 8;
    if (b.out.len != row_bytes * n || b.versions.len != b.in.len || b.torn.len != b.in.len) {
        PyErr_Format(PyExc_ValueError, "gather_checked_rows: %zd rows need %zd bytes of out and %zd of versions and torn, not %zd, %zd, %zd",
                     n, row_bytes * n, b.in.len, b.out.len, b.versions.len, b.torn.len);
        goto out;
    }
    const int64_t *rows = b.in.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= limit) {
            PyErr_Format(PyExc_ValueError, "gather_checked_rows: row %zd is %lld, not in [0, %lld)", i, (long long)rows[i], limit);
            goto out;
        }
    int64_t *torn = b.torn.buf, *versions = b.versions.buf;
    unsigned char *landing = b.out.buf;
    Py_ssize_t count = 0;
    PyThreadState *released = (uint64_t)n * (uint64_t)row_bytes >= GIL_FREE_FROM ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + GATHER_AHEAD < n)
            prefetch_row(src, rows[i + GATHER_AHEAD], stride);
        const uint64_t *from = (const uint64_t *)(uintptr_t)(src + (uint64_t)rows[i] * (uint64_t)stride);
        uint64_t before = __atomic_load_n(from, __ATOMIC_ACQUIRE);
        /* (memcpy at this size is plain vector loads and stores, in order: no string instructions) */
        memcpy(landing + row_bytes * i, from + 2, (size_t)row_bytes);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        versions[i] = (int64_t)(before >> 1);
        if (check && ((before & 1) || __atomic_load_n(from, __ATOMIC_RELAXED) != before))
            torn[count++] = i;
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    result = PyLong_FromSsize_t(count);
out:
    row_buffers_release(&b);
    return result;
}

PyDoc_STRVAR(accept_rows_doc,
"accept_rows(words, width, row_bytes, out, versions, torn) -> int\n\n"
"Check a gather of table rows (words: C-contiguous native uint64, width words a row: the sequence\n"
"word, the hash word, the payload; hixl/weights/_rows.py) and, if every row is whole, hand them\n"
"over. Returns how many rows are not (an odd sequence word, or a hash word other than row_hashes\n"
"of the row); their positions, ascending, in torn (a writable int64 array of one a row). If\n"
"that is 0, each row's first row_bytes payload bytes are in out (a writable C-contiguous buffer of\n"
"row_bytes a row) and its version, the sequence word halved, in versions (int64, one a row);\n"
"else out and versions are as they were. ValueError, nothing written, if the sizes disagree.");

static PyObject *
accept_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "accept_rows takes 6 arguments");
        return NULL;
    }
    Py_ssize_t width = PyLong_AsSsize_t(args[1]);
    Py_ssize_t row_bytes = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (width < 2 || width > ROW_MAX_WORDS || row_bytes < 0 || row_bytes > 8 * (width - 2)) {
        PyErr_Format(PyExc_ValueError, "accept_rows: %zd payload bytes do not fit rows of %zd words (2 to %d)",
                     row_bytes, width, ROW_MAX_WORDS);
        return NULL;
    }
    row_buffers_t b;
    if (!row_buffers_get(&b, args[0], 0, args[3], args[4], args[5]))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = b.torn.len / 8;
    if (b.in.len != 8 * width * n || b.out.len != row_bytes * n || b.versions.len != b.torn.len) {
        PyErr_Format(PyExc_ValueError,
                     "accept_rows: %zd rows (torn) need %zd bytes of words, %zd of out and %zd of versions, not %zd, %zd, %zd",
                     n, 8 * width * n, row_bytes * n, b.torn.len, b.in.len, b.out.len, b.versions.len);
        goto out;
    }
    uint64_t keys[ROW_MAX_WORDS];
    row_keys(keys, width);
    const unsigned char *words = b.in.buf;
    int64_t *torn = b.torn.buf;
    Py_ssize_t count = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        const unsigned char *row = words + 8 * width * k;
        uint64_t seq, hash;
        memcpy(&seq, row, 8);
        memcpy(&hash, row + 8, 8);
        if ((seq & 1) || row_hash(row, width, keys) != hash)
            torn[count++] = k;
    }
    if (count == 0) {
        unsigned char *dst = b.out.buf;
        int64_t *versions = b.versions.buf;
        for (Py_ssize_t k = 0; k < n; k++) {
            const unsigned char *row = words + 8 * width * k;
            uint64_t seq;
            memcpy(&seq, row, 8);
            versions[k] = (int64_t)(seq >> 1);
            memcpy(dst + row_bytes * k, row + 16, (size_t)row_bytes);
        }
    }
    result = PyLong_FromSsize_t(count);
out:
    row_buffers_release(&b);
    return result;
}

/* ---- CmaSmall: cma's whole latency path (every check and the syscall) in one call ----------- */

/* Sorted, disjoint intervals [starts[i], ends[i]) as C arrays: a RegionTable's .intervals. */
typedef struct {
    Py_ssize_t count;
    uint64_t *starts, *ends; /* one allocation: ends = starts + count */
} spans_t;

/* A RemoteRegions table's readable and writable spans, and the table they are of (held: tables
 * are replaced, never changed in place, so the same object means the same spans). */
typedef struct {
    PyObject *table;
    spans_t readable, writable;
} spans_cache_t;

static PyObject *str_table, *str_readable, *str_writable, *str_intervals, *str_state, *str_regions, *str_lease,
    *str_revoking, *str_generation, *str_enter, *str_leave, *str_io_lock, *str_cancelled, *str_acquire, *str_release;

static void
spans_free(spans_t *s)
{
    PyMem_Free(s->starts);
    s->starts = s->ends = NULL;
    s->count = 0;
}

/* `region_table.intervals` (a new reference), checked to be a pair of equally long lists; NULL with an
 * exception set if it is not that. Reads attributes only (no Python code runs). */
static PyObject *
intervals_of(PyObject *region_table)
{
    PyObject *pair = PyObject_GetAttr(region_table, str_intervals);
    if (pair != NULL &&
        (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyList_CheckExact(PyTuple_GET_ITEM(pair, 0)) ||
         !PyList_CheckExact(PyTuple_GET_ITEM(pair, 1)) ||
         PyList_GET_SIZE(PyTuple_GET_ITEM(pair, 0)) != PyList_GET_SIZE(PyTuple_GET_ITEM(pair, 1)))) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "a region table's intervals must be two equally long lists");
        return NULL;
    }
    return pair;
}

/* `region_table.intervals` (a pair of equally long lists of ints) into *out; 0 with an exception
 * set if it is not that. Reads attributes only (no Python code runs). */
static int
spans_load(PyObject *region_table, spans_t *out)
{
    PyObject *pair = intervals_of(region_table);
    if (pair == NULL)
        return 0;
    int ok = 0;
    PyObject *starts = PyTuple_GET_ITEM(pair, 0), *ends = PyTuple_GET_ITEM(pair, 1);
    Py_ssize_t count = PyList_GET_SIZE(starts);
    uint64_t *mem = PyMem_Malloc(sizeof(uint64_t) * (size_t)(2 * count + 1));
    if (mem == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!exact_u64(PyList_GET_ITEM(starts, i), &mem[i]) || !exact_u64(PyList_GET_ITEM(ends, i), &mem[count + i])) {
            PyMem_Free(mem);
            PyErr_SetString(PyExc_ValueError, "interval lists must hold ints in [0, 2**64)");
            goto done;
        }
    }
    out->count = count;
    out->starts = mem;
    out->ends = mem + count;
    ok = 1;
done:
    Py_DECREF(pair);
    return ok;
}

/* Whether [addr, addr + len) lies inside one of the spans (bisect_right, as check_small). */
static int
spans_hold(const spans_t *s, uint64_t addr, uint64_t len)
{
    Py_ssize_t lo = 0, hi = s->count;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (addr < s->starts[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo > 0 && addr <= s->ends[lo - 1] && len <= s->ends[lo - 1] - addr;
}

/* Make `cache` the spans of `table` (a RemoteRegions), unless they are already; 0 with an exception set
 * if the table is malformed. */
static int
spans_cache_load(spans_cache_t *cache, PyObject *table)
{
    if (table == cache->table)
        return 1;
    spans_t readable = {0, NULL, NULL}, writable = {0, NULL, NULL};
    PyObject *r = PyObject_GetAttr(table, str_readable);
    PyObject *w = r == NULL ? NULL : PyObject_GetAttr(table, str_writable);
    int ok = w != NULL && spans_load(r, &readable) && spans_load(w, &writable);
    Py_XDECREF(r);
    Py_XDECREF(w);
    if (!ok) {
        spans_free(&readable);
        return 0;
    }
    spans_free(&cache->readable);
    spans_free(&cache->writable);
    cache->readable = readable;
    cache->writable = writable;
    Py_INCREF(table);
    Py_XSETREF(cache->table, table);
    return 1;
}

static void
spans_cache_clear(spans_cache_t *cache)
{
    spans_free(&cache->readable);
    spans_free(&cache->writable);
    Py_CLEAR(cache->table);
}

typedef struct {
    PyObject_HEAD
    long pid, pidfd, proc_mem;
    unsigned long long chunk;
    int lanes;
    PyObject *page, *registry, *link, *regions, *connected, *read_op, *write_op;
    spans_cache_t local, remote;
} CmaSmall;

static int
CmaSmall_init(CmaSmall *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"pid", "pidfd", "generation_page", "registry", "link", "connected", "read", "write",
                            "chunk", "lanes", "proc_mem", NULL};
    PyObject *page, *registry, *link, *connected, *read_op, *write_op;
    long pid, pidfd, proc_mem = -1;
    unsigned long long chunk;
    int lanes = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "llOOOOOOK|il", names, &pid, &pidfd, &page, &registry, &link,
                                     &connected, &read_op, &write_op, &chunk, &lanes, &proc_mem))
        return -1;
    PyObject *regions = PyObject_GetAttr(link, str_regions);
    if (regions == NULL)
        return -1;
    self->pid = pid;
    self->pidfd = pidfd;
    self->proc_mem = proc_mem;
    self->chunk = chunk;
    self->lanes = lanes < 1 ? 1 : lanes;
    Py_INCREF(page);
    Py_XSETREF(self->page, page);
    Py_INCREF(registry);
    Py_XSETREF(self->registry, registry);
    Py_INCREF(link);
    Py_XSETREF(self->link, link);
    Py_XSETREF(self->regions, regions);
    Py_INCREF(connected);
    Py_XSETREF(self->connected, connected);
    Py_INCREF(read_op);
    Py_XSETREF(self->read_op, read_op);
    Py_INCREF(write_op);
    Py_XSETREF(self->write_op, write_op);
    spans_cache_clear(&self->local);
    spans_cache_clear(&self->remote);
    return 0;
}

static int
CmaSmall_traverse(CmaSmall *self, visitproc visit, void *arg)
{
    Py_VISIT(self->page);
    Py_VISIT(self->registry);
    Py_VISIT(self->link);
    Py_VISIT(self->regions);
    Py_VISIT(self->connected);
    Py_VISIT(self->read_op);
    Py_VISIT(self->write_op);
    Py_VISIT(self->local.table);
    Py_VISIT(self->remote.table);
    return 0;
}

static int
CmaSmall_clear(CmaSmall *self)
{
    Py_CLEAR(self->page);
    Py_CLEAR(self->registry);
    Py_CLEAR(self->link);
    Py_CLEAR(self->regions);
    Py_CLEAR(self->connected);
    Py_CLEAR(self->read_op);
    Py_CLEAR(self->write_op);
    spans_cache_clear(&self->local);
    spans_cache_clear(&self->remote);
    return 0;
}

static void
CmaSmall_dealloc(CmaSmall *self)
{
    PyObject_GC_UnTrack(self);
    CmaSmall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The attribute `name` of `obj` is `expected` (identity); -1 with an exception set if it cannot be read. */
static int
attr_is(PyObject *obj, PyObject *name, PyObject *expected)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int same = value == expected;
    Py_DECREF(value);
    return same;
}

PyDoc_STRVAR(CmaSmall_run_doc,
"run(op, descs) -> bool\n\n"
"transfer_sync's whole latency path for cma: True once every byte of ``descs`` (a list of up to\n"
"SMALL_MAX (local, remote, len) int triples, at most ``chunk`` bytes in all) moved in one\n"
"process_vm_* call (or pread/pwrite on ``proc_mem``); False if nothing was tried or the call fell\n"
"short (the general path then checks, explains, retries: copying again is harmless). See\n"
"hixl._accel.pure.CmaSmall.");

/* Why the steps are in this order. Below GIL_FREE_FROM bytes the GIL is held from the lease check
 * to the end of the syscall and no Python code runs in between (only attribute reads of plain
 * instance attributes and slots, no allocation of tracked objects): no other thread can run, so
 * no REVOKE can begin, or take a table away, between our look and our copy. That stands for the
 * lease's shared hold, as a token would (the pure twin takes one). A larger copy releases the GIL
 * for its syscall, so it takes a token (Lease.enter) before its checks and gives it back after. */
static PyObject *
CmaSmall_run(CmaSmall *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "run takes 2 arguments (op, descs)");
        return NULL;
    }
    int write;
    if (args[0] == self->write_op)
        write = 1;
    else if (args[0] == self->read_op)
        write = 0;
    else
        Py_RETURN_FALSE;
    desc_t descs[SMALL_MAX];
    Py_ssize_t count = parse_descs(args[1], descs);
    if (count < 0)
        Py_RETURN_FALSE;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (total + descs[i].len < total)
            Py_RETURN_FALSE;
        total += descs[i].len;
    }
    if (total > self->chunk)
        Py_RETURN_FALSE; /* more than a chunk: the general path cuts it */
    /* Our own registrations (Registry.table is a property: Python code, hence before the lease). A
     * READ lands in local memory, a WRITE in the peer's: those sides must be writable. */
    PyObject *local_table = PyObject_GetAttr(self->registry, str_table);
    if (local_table == NULL)
        return NULL;
    int ok = spans_cache_load(&self->local, local_table);
    Py_DECREF(local_table);
    if (!ok)
        return NULL;
    const spans_t *local = write ? &self->local.readable : &self->local.writable;
    for (Py_ssize_t i = 0; i < count; i++)
        if (!spans_hold(local, descs[i].local, descs[i].len))
            Py_RETURN_FALSE;
    PyObject *lease = PyObject_GetAttr(self->regions, str_lease);
    if (lease == NULL)
        return NULL;
    PyObject *token = NULL, *result = NULL;
    if (total >= GIL_FREE_FROM) {
        token = PyObject_CallMethodNoArgs(lease, str_enter);
        if (token == NULL)
            goto done;
        int held = PyObject_IsTrue(token);
        if (held <= 0) {
            result = held < 0 ? NULL : Py_NewRef(Py_False); /* a REVOKE is under way: the general path waits */
            goto done;
        }
    } else {
        PyObject *revoking = PyObject_GetAttr(lease, str_revoking);
        if (revoking == NULL)
            goto done;
        int busy = PyObject_IsTrue(revoking);
        Py_DECREF(revoking);
        if (busy != 0) {
            result = busy < 0 ? NULL : Py_NewRef(Py_False);
            goto done;
        }
    }
    /* From here to the syscall: attribute reads and C only (see above). */
    int connected = attr_is(self->link, str_state, self->connected);
    if (connected <= 0) {
        result = connected < 0 ? NULL : Py_NewRef(Py_False);
        goto done;
    }
    PyObject *remote_table = PyObject_GetAttr(self->regions, str_table);
    if (remote_table == NULL)
        goto done;
    ok = spans_cache_load(&self->remote, remote_table);
    Py_DECREF(remote_table); /* (still held by the cache) */
    if (!ok)
        goto done;
    const spans_t *remote = write ? &self->remote.writable : &self->remote.readable;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!spans_hold(remote, descs[i].remote, descs[i].len)) {
            result = Py_NewRef(Py_False);
            goto done;
        }
    }
    PyObject *generation_obj = PyObject_GetAttr(self->regions, str_generation);
    if (generation_obj == NULL)
        goto done;
    unsigned long long generation = PyLong_AsUnsignedLongLong(generation_obj);
    Py_DECREF(generation_obj);
    if (generation == (unsigned long long)-1 && PyErr_Occurred())
        goto done;
    /* The page is read first: the channel closes it before the pidfd and proc_mem, so an open page
     * means open descriptors (and no thread runs between the two, or a token holds the channel's lease). */
    long moved = cma_checked_call(self->pid, self->pidfd, self->proc_mem, write, descs, count, self->page, generation,
                                  self->lanes);
    result = Py_NewRef(moved >= 0 && (uint64_t)moved == total ? Py_True : Py_False);
done:
    if (token != NULL) {
        if (PyObject_IsTrue(token) > 0) {
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback); /* (an error of the steps above stays the one raised) */
            PyObject *left = PyObject_CallMethodOneArg(lease, str_leave, token);
            if (left == NULL && type == NULL)
                Py_CLEAR(result);
            else if (left == NULL)
                PyErr_Clear();
            Py_XDECREF(left);
            if (type != NULL)
                PyErr_Restore(type, value, traceback);
        }
        Py_DECREF(token);
    }
    Py_DECREF(lease);
    return result;
}

static PyMethodDef CmaSmall_methods[] = {
    {"run", (PyCFunction)(void (*)(void))CmaSmall_run, METH_FASTCALL, CmaSmall_run_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(CmaSmall_doc,
"CmaSmall(pid, pidfd, generation_page, registry, link, connected, read, write, chunk, lanes=1,\n"
"         proc_mem=-1)\n\n"
"cma's latency path to one peer in one call (see run): the peer's process ``pid`` pinned by\n"
"``pidfd``, its mapped generation page; this engine's ``registry`` (its .table), the ``link``\n"
"(its .state must be ``connected``; its .regions hold the peer's table, generation and lease);\n"
"``read``/``write``: the two ops; ``chunk``: the most bytes one call may move; ``lanes``: threads a\n"
"copy of LANE_FROM bytes or more is split over (see cma_window); ``proc_mem``: the peer's\n"
"/proc/<pid>/mem open for reading and writing and proven to be its memory, for a copy of one\n"
"descriptor of up to PROC_MEM_MAX bytes (-1: none; process_vm_* then).");

static PyTypeObject CmaSmallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hixl._accel._native.CmaSmall",
    .tp_basicsize = sizeof(CmaSmall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = CmaSmall_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)CmaSmall_init,
    .tp_traverse = (traverseproc)CmaSmall_traverse,
    .tp_clear = (inquiry)CmaSmall_clear,
    .tp_dealloc = (destructor)CmaSmall_dealloc,
    .tp_methods = CmaSmall_methods,
};
/* ---- TCP's latency path: a small request's frame out, its reply header in, its data landed ---------
 * The three steps the initiator's link takes for a small transfer_sync when it holds the read role
 * (hixl/_session/wire.py). The socket is non-blocking; every wait is a poll bounded by the time the
 * caller passes (time.monotonic() seconds), the GIL released around it and around each syscall.
 * Nothing here decides anything: tcp_reply only recognises the expected answer's header, the
 * connection (Python) then accounts for it, and only then does tcp_land move its data. */
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>

#define TCP_HEADER 28
#define TCP_DATA 7
#define TCP_ACK 8
#define TCP_WAIT (-1)
#define TCP_EOF (-2)
#define TCP_RANGES 16
#define TCP_LOWAT (256 << 10)      /* the low-water mark a large DATA is waited for at (tcp_land) */
#define TCP_LOWAT_FROM (4 << 20)   /* the smallest DATA landed so */
#define IOV_BATCH 64 /* iovecs per readv in tcp_land_words (a WRITE's data: one to a few, mostly) */

static double
monotonic_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic()'s clock */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Wait (GIL released) until fd is ready for events or the clock reaches until: 1 ready, 0 not
 * (time is up), -1 with errno set. EINTR is retried after the caller's signal handlers ran. */
static int
wait_fd(int fd, short events, double until)
{
    for (;;) {
        double left = until - monotonic_now();
        if (left <= 0)
            return 0;
        struct pollfd p = {fd, events, 0};
        int ms = left > 3600.0 ? 3600000 : (int)(left * 1000.0) + 1;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = poll(&p, 1, ms);
        Py_END_ALLOW_THREADS
        if (rc > 0)
            return 1;
        if (rc < 0 && errno != EINTR)
            return -1;
        if (rc < 0 && PyErr_CheckSignals() < 0)
            return -2;
    }
}

/* As wait_fd, but while the clock is before spin_until only yield the CPU once (the GIL released)
 * and answer 1, for the caller to try again: a peer due within microseconds costs a sleeping
 * thread's wake-up otherwise (~30 us on a VM whose idle vCPU halts; docs/engine.md, busy polling). */
static int
spin_or_wait(int fd, short events, double until, double spin_until)
{
    if (spin_until > 0.0 && monotonic_now() < spin_until) {
        Py_BEGIN_ALLOW_THREADS
        sched_yield();
        Py_END_ALLOW_THREADS
        return 1;
    }
    return wait_fd(fd, events, until);
}

/* A list of up to TCP_RANGES (addr, len) tuples of exact ints into iov; their count, or -1 with
 * an exception set. */
static Py_ssize_t
parse_ranges(PyObject *list, struct iovec *iov, uint64_t *total)
{
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) > TCP_RANGES) {
        PyErr_Format(PyExc_ValueError, "ranges must be a list of at most %d (addr, len) tuples", TCP_RANGES);
        return -1;
    }
    Py_ssize_t count = PyList_GET_SIZE(list);
    *total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        uint64_t addr, len;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 || !exact_u64(PyTuple_GET_ITEM(item, 0), &addr) ||
            !exact_u64(PyTuple_GET_ITEM(item, 1), &len) || addr + len < addr) {
            PyErr_SetString(PyExc_ValueError, "ranges must be (addr, len) tuples of ints in [0, 2**64)");
            return -1;
        }
        iov[i].iov_base = (void *)(uintptr_t)addr;
        iov[i].iov_len = (size_t)len;
        *total += len;
    }
    return count;
}

/* Drop the first n bytes of an iovec array in place; the index of the first one left. */
static int
iov_advance(struct iovec *iov, int count, size_t n)
{
    int i = 0;
    while (i < count && n >= iov[i].iov_len) {
        n -= iov[i].iov_len;
        i++;
    }
    if (i < count) {
        iov[i].iov_base = (char *)iov[i].iov_base + n;
        iov[i].iov_len -= n;
    }
    return i;
}

static int
socket_fd(PyObject *sock)
{
    return PyObject_AsFileDescriptor(sock);
}

/* The socket's descriptor for a tcp_* call taking ``fixed`` arguments and an optional spin; -1 with
 * an exception set. */
static int
tcp_call_fd(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t fixed)
{
    if (nargs != fixed && nargs != fixed + 1) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd or %zd arguments", name, fixed, fixed + 1);
        return -1;
    }
    return socket_fd(args[0]);
}

/* The steps of TCP's latency path on the initiator, for the tcp_* functions below and for TcpSmall.
 * Each answers 0, -1 with errno set for a socket error, or -2 with an exception set (a signal
 * handler raised); each waits with the GIL released. */

/* Send iov[0..count) (total bytes in all) from byte *sent on, waiting for room until `until`: for
 * `spin` seconds after the last bytes went by trying again, then asleep. *sent is short of total
 * only once `until` passed. */
static int
send_iov(int fd, struct iovec *iov, int count, uint64_t total, uint64_t *sent, double until, double spin)
{
    double spin_until = spin > 0.0 ? monotonic_now() + spin : 0.0;
    int first = iov_advance(iov, count, (size_t)*sent);
    while (*sent < total) {
        struct msghdr msg = {0};
        msg.msg_iov = iov + first;
        msg.msg_iovlen = (size_t)(count - first);
        ssize_t n;
        int err;
        Py_BEGIN_ALLOW_THREADS
        n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        err = errno;
        Py_END_ALLOW_THREADS
        errno = err;
        if (n > 0) {
            *sent += (uint64_t)n;
            first += iov_advance(iov + first, count - first, (size_t)n);
            if (spin > 0.0)
                spin_until = monotonic_now() + spin;
            continue;
        }
        if (n < 0 && errno == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -2;
            continue;
        }
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        int ready = spin_or_wait(fd, POLLOUT, until, spin_until);
        if (ready <= 0)
            return ready;
    }
    return 0;
}

/* Read into buf (cap bytes, *have held already) until it holds a frame header, until `until` at
 * most (the first `spin` seconds trying again): *kind as tcp_reply answers it, *data_len. */
static int
read_header(int fd, char *buf, Py_ssize_t cap, Py_ssize_t *have, uint64_t req_id, double until, double spin,
            long *kind, uint64_t *data_len)
{
    double spin_until = spin > 0.0 ? monotonic_now() + spin : 0.0;
    *kind = TCP_WAIT;
    *data_len = 0;
    while (*have < TCP_HEADER) {
        ssize_t n;
        int err;
        Py_BEGIN_ALLOW_THREADS
        /* A reply due within microseconds is caught by trying again: asleep in poll(), the wake-up
         * alone costs ~30 us on a VM whose idle vCPU halts (see docs/engine.md, busy_poll). */
        while ((n = recv(fd, buf + *have, (size_t)(cap - *have), 0)) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
               spin_until > 0.0 && monotonic_now() < spin_until)
            sched_yield();
        err = errno;
        Py_END_ALLOW_THREADS
        errno = err;
        if (n > 0) {
            *have += n;
            continue;
        }
        if (n == 0) {
            *kind = TCP_EOF;
            return 0;
        }
        if (errno == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -2;
            continue;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        int ready = wait_fd(fd, POLLIN, until);
        if (ready <= 0)
            return ready; /* (0: TCP_WAIT) */
    }
    /* The header as hixl._protocol.frames lays it out: magic, type, flags, reserved, req_id,
     * body_len, data_len (little-endian). Anything but the two expected replies is the
     * connection's to judge. */
    unsigned char *h = (unsigned char *)buf;
    uint64_t id, dlen;
    uint32_t body;
    memcpy(&id, h + 8, 8);
    memcpy(&body, h + 16, 4);
    memcpy(&dlen, h + 20, 8);
    *kind = 0;
    if (memcmp(h, "HXL1", 4) == 0 && (h[4] == TCP_DATA || h[4] == TCP_ACK) && h[5] == 0 && h[6] == 0 && h[7] == 0 &&
        id == req_id && body == 0 && (h[4] == TCP_DATA || dlen == 0)) {
        *kind = h[4];
        *data_len = dlen;
    }
    return 0;
}

/* Land a reply's data (total bytes) into iov[0..count): first `buffered` bytes from `held`, then
 * straight from the socket, until `until` at most (nothing read once it passed; `spin` as above;
 * a large DATA waited for at a low-water mark, see tcp_land). *landed: the bytes landed. The peer's
 * end of stream before the data is in is ECONNRESET. */
static int
land_iov(int fd, const char *held, uint64_t buffered, struct iovec *iov, int count, uint64_t total, double until,
         double spin, uint64_t *landed)
{
    double spin_until = spin > 0.0 ? monotonic_now() + spin : 0.0;
    int first = 0;
    *landed = 0;
    while (*landed < buffered) { /* what came with the header: a memcpy per range */
        size_t n = iov[first].iov_len < buffered - *landed ? iov[first].iov_len : (size_t)(buffered - *landed);
        memcpy(iov[first].iov_base, held + *landed, n);
        *landed += n;
        first += iov_advance(iov + first, count - first, n);
    }
    while (*landed < total) {
        if (monotonic_now() >= until)
            return 0;
        ssize_t n;
        int err;
        Py_BEGIN_ALLOW_THREADS
        n = readv(fd, iov + first, count - first);
        err = errno;
        Py_END_ALLOW_THREADS
        errno = err;
        if (n > 0) {
            *landed += (uint64_t)n;
            first += iov_advance(iov + first, count - first, (size_t)n);
            if (spin > 0.0)
                spin_until = monotonic_now() + spin;
            continue;
        }
        if (n == 0) {
            errno = ECONNRESET;
            return -1;
        }
        if (errno == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -2;
            continue;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -1;
        int ready;
        if (total >= TCP_LOWAT_FROM && total - *landed > TCP_LOWAT) {
            /* A large DATA, dry for now: asleep until TCP_LOWAT more has come, not spinning for
             * every few segments (tiny readvs; 0.75-0.8x a plain socket read at 16 MiB). Never for
             * the last TCP_LOWAT: a mark above what is still to come would never be reached. */
            int mark = TCP_LOWAT, one = 1;
            if (setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &mark, sizeof mark) < 0)
                return -1;
            ready = wait_fd(fd, POLLIN, until);
            int err = errno;
            if (setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one) < 0 && ready >= 0)
                return -1;
            errno = err;
        } else {
            ready = spin_or_wait(fd, POLLIN, until, spin_until);
        }
        if (ready <= 0)
            return ready;
    }
    return 0;
}

/* NULL with the exception a step's answer `rc` (-1 or -2) stands for set. */
static PyObject *
step_failed(int rc)
{
    if (rc == -1)
        PyErr_SetFromErrno(PyExc_OSError);
    return NULL;
}

PyDoc_STRVAR(tcp_send_doc,
"tcp_send(sock, frame, ranges, offset, until, spin=0.0) -> int\n\n"
"Send ``frame`` then the memory of ``ranges`` (a list of (addr, len)) on the non-blocking\n"
"``sock``, from byte ``offset`` of the whole on: one sendmsg, more if the socket takes less,\n"
"waiting for room until ``until`` (time.monotonic()): for ``spin`` seconds after the last\n"
"bytes went by trying again (as tcp_reply), then asleep. The bytes sent in all (``offset``\n"
"included): fewer than the whole once ``until`` passed. Raises OSError for a socket error.");

static PyObject *
tcp_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int fd = tcp_call_fd("tcp_send", args, nargs, 5);
    if (fd < 0)
        return NULL;
    Py_buffer frame;
    if (PyObject_GetBuffer(args[1], &frame, PyBUF_SIMPLE) < 0)
        return NULL;
    struct iovec iov[TCP_RANGES + 1];
    uint64_t data = 0;
    Py_ssize_t ranges = parse_ranges(args[2], iov + 1, &data);
    Py_ssize_t offset = PyLong_AsSsize_t(args[3]);
    double until = PyFloat_AsDouble(args[4]);
    double spin = nargs == 6 ? PyFloat_AsDouble(args[5]) : 0.0;
    PyObject *result = NULL;
    if (ranges < 0 || PyErr_Occurred())
        goto done;
    iov[0].iov_base = frame.buf;
    iov[0].iov_len = (size_t)frame.len;
    uint64_t total = (uint64_t)frame.len + data;
    if (offset < 0 || (uint64_t)offset > total) {
        PyErr_SetString(PyExc_ValueError, "offset outside what is to be sent");
        goto done;
    }
    uint64_t sent = (uint64_t)offset;
    int rc = send_iov(fd, iov, (int)ranges + 1, total, &sent, until, spin);
    result = rc < 0 ? step_failed(rc) : PyLong_FromUnsignedLongLong(sent);
done:
    PyBuffer_Release(&frame);
    return result;
}

PyDoc_STRVAR(tcp_reply_doc,
"tcp_reply(sock, scratch, have, req_id, until, spin=0.0) -> (kind, have, data_len)\n\n"
"Read from the non-blocking ``sock`` into the writable ``scratch`` (holding ``have`` bytes\n"
"already) until it holds a frame header, waiting until ``until`` (time.monotonic()) at most:\n"
"for the first ``spin`` seconds by trying again (yielding the CPU between tries, the GIL\n"
"released), then asleep in poll().\n"
"``kind`` is 7 (DATA) or 8 (ACK) if that header is a well-formed one of those for ``req_id``\n"
"with no body (``data_len``: its data_len); 0 if it is anything else, -1 if no header came in\n"
"time, -2 if the peer closed its end. ``have``: the bytes ``scratch`` holds now (a header and\n"
"whatever came with it). Raises OSError for a socket error.");

static PyObject *
tcp_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int fd = tcp_call_fd("tcp_reply", args, nargs, 5);
    if (fd < 0)
        return NULL;
    Py_buffer scratch;
    if (PyObject_GetBuffer(args[1], &scratch, PyBUF_WRITABLE) < 0)
        return NULL;
    Py_ssize_t have = PyLong_AsSsize_t(args[2]);
    uint64_t req_id;
    double until = PyFloat_AsDouble(args[4]);
    double spin = nargs == 6 ? PyFloat_AsDouble(args[5]) : 0.0;
    PyObject *result = NULL;
    if ((have == -1 && PyErr_Occurred()) || (until == -1.0 && PyErr_Occurred()) || (spin == -1.0 && PyErr_Occurred()))
        goto done;
    if (!exact_u64(args[3], &req_id) || have < 0 || have > scratch.len || scratch.len < TCP_HEADER) {
        PyErr_SetString(PyExc_ValueError, "tcp_reply: bad req_id, have or scratch");
        goto done;
    }
    long kind;
    uint64_t data_len;
    int rc = read_header(fd, scratch.buf, scratch.len, &have, req_id, until, spin, &kind, &data_len);
    result = rc < 0 ? step_failed(rc) : Py_BuildValue("(lnK)", kind, have, (unsigned long long)data_len);
done:
    PyBuffer_Release(&scratch);
    return result;
}

PyDoc_STRVAR(tcp_land_doc,
"tcp_land(sock, scratch, start, have, ranges, until, spin=0.0) -> (landed, end)\n\n"
"Land a reply's data into the memory of ``ranges`` (a list of (addr, len)): first what\n"
"``scratch[start:have]`` holds of it, then straight from the non-blocking ``sock`` with readv,\n"
"waiting until ``until`` (time.monotonic()) at most and reading nothing once it passed; for\n"
"``spin`` seconds after the last bytes came by trying again (as tcp_reply), then asleep. Data of\n"
"TCP_LOWAT_FROM bytes or more is waited for asleep, TCP_LOWAT at a time (SO_RCVLOWAT; 1 again\n"
"before it returns), but for its last TCP_LOWAT bytes.\n"
"``landed``: the bytes landed (all of ``ranges`` unless time ran out); ``end``: where what\n"
"``scratch`` holds beyond the data begins. Raises OSError for a socket error, and\n"
"ConnectionResetError if the peer closed its end before the data was in.");

static PyObject *
tcp_land(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int fd = tcp_call_fd("tcp_land", args, nargs, 6);
    if (fd < 0)
        return NULL;
    Py_buffer scratch;
    if (PyObject_GetBuffer(args[1], &scratch, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), have = PyLong_AsSsize_t(args[3]);
    struct iovec iov[TCP_RANGES];
    uint64_t total = 0;
    Py_ssize_t ranges = parse_ranges(args[4], iov, &total);
    double until = PyFloat_AsDouble(args[5]);
    double spin = nargs == 7 ? PyFloat_AsDouble(args[6]) : 0.0;
    PyObject *result = NULL;
    if (ranges < 0 || PyErr_Occurred())
        goto done;
    if (start < 0 || have < start || have > scratch.len) {
        PyErr_SetString(PyExc_ValueError, "tcp_land: start and have must lie in scratch, in order");
        goto done;
    }
    uint64_t buffered = (uint64_t)(have - start) < total ? (uint64_t)(have - start) : total, landed;
    int rc = land_iov(fd, (const char *)scratch.buf + start, buffered, iov, (int)ranges, total, until, spin, &landed);
    result = rc < 0 ? step_failed(rc) : Py_BuildValue("(Kn)", (unsigned long long)landed, start + (Py_ssize_t)buffered);
done:
    PyBuffer_Release(&scratch);
    return result;
}

PyDoc_STRVAR(tcp_land_words_doc,
"tcp_land_words(sock, iovs, first, want, done, left, until, piece, spin=0.0) -> int\n\n"
"The target's side of a WRITE's data: land up to ``want`` bytes of it straight from the\n"
"non-blocking ``sock`` into the iovecs ``iovs[first:]`` (a C-contiguous (N, 2) uint64 array:\n"
"addr, len; only read), ``done`` bytes of the data landed before and ``left`` still due\n"
"(these included). Each readv takes at most ``piece`` bytes, only what the socket holds\n"
"already (FIONREAD) and, except for the data's last bytes, only whole 8-byte words of the\n"
"data: no word is left half-written while the rest of it is awaited. ``until``\n"
"(time.monotonic()) is checked before each readv, nothing read once it passed. When the\n"
"socket has nothing more (or only part of a word), it tries again for ``spin`` seconds\n"
"after the last bytes came (yielding the CPU), never sleeps. The GIL is released\n"
"throughout. The bytes landed:\n"
"fewer than ``want`` when the socket ran dry, held only part of a word, or ``until``\n"
"passed. Raises ConnectionResetError at end of stream, OSError for a socket error.");

static PyObject *
tcp_land_words(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int fd = tcp_call_fd("tcp_land_words", args, nargs, 8);
    if (fd < 0)
        return NULL;
    Py_buffer iovs;
    if (!u64_buffer(args[1], &iovs, 2, 2, "iovs"))
        return NULL;
    Py_ssize_t first = PyLong_AsSsize_t(args[2]);
    uint64_t want, done, left, piece;
    double until = PyFloat_AsDouble(args[6]);
    double spin = nargs == 9 ? PyFloat_AsDouble(args[8]) : 0.0;
    PyObject *result = NULL;
    if (!exact_u64(args[3], &want) || !exact_u64(args[4], &done) || !exact_u64(args[5], &left) ||
        !exact_u64(args[7], &piece) || PyErr_Occurred()) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "tcp_land_words: want, done, left and piece must be ints >= 0");
        goto done;
    }
    Py_ssize_t rows = iovs.shape[0];
    if (first < 0 || first > rows || want > left || piece < 8) {
        PyErr_SetString(PyExc_ValueError, "tcp_land_words: bad iovs, first, want or piece");
        goto done;
    }
    const uint64_t *table = (const uint64_t *)iovs.buf;
    uint64_t room = 0; /* what iovs[first:] can take: never more is read */
    for (Py_ssize_t i = first; i < rows && room < want; i++)
        room += table[2 * i + 1];
    if (want > room)
        want = room;
    uint64_t moved = 0;
    int failed = 0; /* errno of a failure, or -1: end of stream */
    Py_ssize_t row = first;
    uint64_t into_row = 0; /* bytes of iovs[row] landed in this call */
    Py_BEGIN_ALLOW_THREADS
    double spin_until = spin > 0.0 ? monotonic_now() + spin : 0.0;
    while (moved < want) {
        int ready = 0;
        if (ioctl(fd, FIONREAD, &ready) < 0) {
            failed = errno;
            break;
        }
        uint64_t n = want - moved;
        if ((uint64_t)ready < n)
            n = (uint64_t)ready;
        if (n > piece)
            n = piece;
        if (moved + n < left) { /* not the data's last bytes: whole words only (none, if no word ends in them) */
            uint64_t part = (done + moved + n) % 8;
            n = part < n ? n - part : 0;
        }
        if (n == 0) {
            if (ready == 0 && (spin_until == 0.0 || monotonic_now() >= spin_until)) {
                char peek; /* dry, or at its end? (FIONREAD says 0 for both) */
                ssize_t end = recv(fd, &peek, 1, MSG_PEEK | MSG_DONTWAIT);
                if (end > 0)
                    continue; /* (it came just now) */
                if (end == 0)
                    failed = -1;
                else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    failed = errno;
                break;
            }
            if (ready > 0 && (spin_until == 0.0 || monotonic_now() >= spin_until))
                break; /* a part-word, and the rest of it did not come: the caller keeps it */
            sched_yield(); /* (mid-stream the rest of a part-word is due with the next segment) */
            continue;
        }
        struct iovec iov[IOV_BATCH];
        int count = 0;
        uint64_t planned = 0, skip = into_row;
        for (Py_ssize_t i = row; i < rows && count < IOV_BATCH && planned < n; i++, skip = 0) {
            uint64_t len = table[2 * i + 1] - skip;
            if (len == 0)
                continue;
            if (len > n - planned)
                len = n - planned;
            iov[count].iov_base = (char *)(uintptr_t)table[2 * i] + skip;
            iov[count].iov_len = (size_t)len;
            planned += len;
            count++;
        }
        if (planned < n && moved + planned < left) {
            /* More rows than one readv takes: cut back to a word. The batch fell short of n only
             * because it is full (the rows hold all of want, and n is no more), so it holds
             * IOV_BATCH rows of a byte or more: a cut of under a word leaves some of them. */
            uint64_t cut = (done + moved + planned) % 8;
            while (cut > 0) {
                uint64_t off = cut < iov[count - 1].iov_len ? cut : iov[count - 1].iov_len;
                iov[count - 1].iov_len -= off;
                cut -= off;
                planned -= off;
                if (iov[count - 1].iov_len == 0)
                    count--;
            }
        }
        if (monotonic_now() >= until)
            break;
        ssize_t got = readv(fd, iov, count);
        if (got == 0) {
            failed = -1;
            break;
        }
        if (got < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                break; /* (a signal: the caller's handlers run, it calls again) */
            failed = errno;
            break;
        }
        moved += (uint64_t)got;
        for (uint64_t g = (uint64_t)got; g > 0 && row < rows;) {
            uint64_t rest = table[2 * row + 1] - into_row;
            if (g < rest) {
                into_row += g;
                break;
            }
            g -= rest;
            row++;
            into_row = 0;
        }
        if (spin > 0.0)
            spin_until = monotonic_now() + spin;
    }
    Py_END_ALLOW_THREADS
    if (failed == -1) {
        errno = ECONNRESET;
        PyErr_SetFromErrno(PyExc_ConnectionResetError);
    } else if (failed) {
        errno = failed;
        PyErr_SetFromErrno(PyExc_OSError);
    } else
        result = PyLong_FromUnsignedLongLong(moved);
done:
    PyBuffer_Release(&iovs);
    return result;
}

PyDoc_STRVAR(tcp_request_doc,
"tcp_request(sock, scratch, registry=None) -> (kind, have, end, req_id, deadline, pairs, data_len, unsent)\n\n"
"The target's side of TCP's latency path: one non-blocking recv from ``sock`` into the\n"
"writable ``scratch``; if what it holds starts with a whole, well-formed READ (5) or WRITE (6)\n"
"frame of 1 to 8 descriptors, ``kind`` is its type, ``end`` where it ends in ``scratch``, and\n"
"``req_id``, ``deadline``, ``pairs`` (a list of (addr, len)) and ``data_len`` its fields.\n"
"Else ``kind`` is 0 (anything else, or a frame not all here yet), -1 (nothing to read) or -2\n"
"(the peer closed its end), and ``have`` says what ``scratch`` holds.\n"
"With a ``registry`` (this engine's registrations: ``.table.readable`` / ``.writable``) a READ,\n"
"or a WRITE with all its data in that recv, is also served here if every rule would let it\n"
"through: a request id, at most TCP_SERVE_MAX bytes, its deadline (our clock, microseconds; 0:\n"
"none) not passed, every range inside one readable (READ) or writable (WRITE) registration. A\n"
"READ's DATA frame and bytes then go out in one non-blocking sendmsg; a WRITE's data is copied\n"
"in, in order, and its ACK sent. The GIL is held from the look at the registrations until the\n"
"bytes are in the socket or copied: a\n"
"deregistration comes wholly before or wholly after. ``unsent`` is then what the socket did not\n"
"take (bytes, b'' if nothing), to be sent after; ``pairs`` None. Not served: ``unsent`` None.\n"
"Raises OSError.");

#define TCP_READ 5
#define TCP_WRITE 6
#define TCP_SMALL_DESCS 8
#define TCP_SERVE_MAX (64u << 10) /* the most a READ served in tcp_request moves: the GIL is held for it */

/* tcp_request's serving of a small READ or WRITE: None if a rule refuses it (the caller's path
 * decides and says why), else what the socket did not take of its reply (b"" if nothing). ``data``:
 * a WRITE's data, all of it, in the receive buffer. Holds the GIL from the look at the
 * registrations to the end (no Python code runs: attributes and lists only, past the registry's
 * table property, which is read first). */
static PyObject *
serve_small_request(int fd, PyObject *registry, int kind, uint64_t id, int64_t deadline, const uint64_t *addrs,
                    const uint64_t *lens, Py_ssize_t count, uint64_t total, const unsigned char *data)
{
    if (id == 0 || total > TCP_SERVE_MAX || (deadline && monotonic_now() * 1e6 >= (double)deadline))
        Py_RETURN_NONE;
    PyObject *table = PyObject_GetAttr(registry, str_table);
    PyObject *side = table == NULL ? NULL : PyObject_GetAttr(table, kind == TCP_WRITE ? str_writable : str_readable);
    PyObject *pair = side == NULL ? NULL : intervals_of(side);
    Py_XDECREF(table);
    Py_XDECREF(side);
    if (pair == NULL)
        return NULL;
    Py_ssize_t inside = 0;
    for (Py_ssize_t i = 0; i < count && inside >= 0; i++) /* (bisected in place: a registry may be large) */
        inside = find_interval(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), addrs[i], lens[i]);
    Py_DECREF(pair);
    if (inside == -2)
        return NULL;
    if (inside < 0)
        Py_RETURN_NONE;
    unsigned char header[TCP_HEADER] = {'H', 'X', 'L', '1', kind == TCP_WRITE ? TCP_ACK : TCP_DATA, 0, 0, 0};
    memcpy(header + 8, &id, 8); /* (little-endian, as hixl._protocol.frames packs it; body 0) */
    struct iovec iov[TCP_SMALL_DESCS + 1] = {{header, TCP_HEADER}};
    int parts = 1;
    if (kind == TCP_WRITE) { /* the data lands, in order, then a bare ACK */
        for (Py_ssize_t i = 0; i < count; data += lens[i], i++)
            memcpy((void *)(uintptr_t)addrs[i], data, (size_t)lens[i]);
        total = 0;
    } else {
        memcpy(header + 20, &total, 8);
        for (Py_ssize_t i = 0; i < count; i++, parts++) {
            iov[parts].iov_base = (void *)(uintptr_t)addrs[i];
            iov[parts].iov_len = (size_t)lens[i];
        }
    }
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)parts;
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            return PyErr_SetFromErrno(PyExc_OSError);
        sent = 0;
    }
    PyObject *unsent = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(TCP_HEADER + total - (uint64_t)sent));
    if (unsent == NULL)
        return NULL;
    char *to = PyBytes_AS_STRING(unsent);
    for (int i = iov_advance(iov, parts, (size_t)sent); i < parts; i++) { /* (iov[i] left at its unsent part) */
        memcpy(to, iov[i].iov_base, iov[i].iov_len);
        to += iov[i].iov_len;
    }
    return unsent;
}

static PyObject *
tcp_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "tcp_request takes 2 or 3 arguments");
        return NULL;
    }
    PyObject *registry = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    int fd = socket_fd(args[0]);
    if (fd < 0)
        return NULL;
    Py_buffer scratch;
    if (PyObject_GetBuffer(args[1], &scratch, PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *result = NULL;
    if (scratch.len < TCP_HEADER + 8 + 16 * TCP_SMALL_DESCS) {
        PyErr_SetString(PyExc_ValueError, "tcp_request: scratch too small");
        goto done;
    }
    unsigned char *h = scratch.buf;
    ssize_t have;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        have = recv(fd, h, (size_t)scratch.len, 0);
        Py_END_ALLOW_THREADS
        if (have >= 0 || errno != EINTR)
            break;
        if (PyErr_CheckSignals() < 0)
            goto done;
    }
    if (have < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        result = Py_BuildValue("(iiiiiOiO)", TCP_WAIT, 0, 0, 0, 0, Py_None, 0, Py_None);
        goto done;
    }
    if (have == 0) {
        result = Py_BuildValue("(iiiiiOiO)", TCP_EOF, 0, 0, 0, 0, Py_None, 0, Py_None);
        goto done;
    }
    /* Recognised only if every rule hixl._protocol.frames applies to such a frame holds; for
     * anything else that parser decides (and says why). */
    uint64_t id, dlen;
    uint32_t body;
    int64_t deadline;
    if (have < TCP_HEADER + 8)
        goto other;
    memcpy(&id, h + 8, 8);
    memcpy(&body, h + 16, 4);
    memcpy(&dlen, h + 20, 8);
    memcpy(&deadline, h + TCP_HEADER, 8);
    if (memcmp(h, "HXL1", 4) != 0 || (h[4] != TCP_READ && h[4] != TCP_WRITE) || h[5] || h[6] || h[7])
        goto other;
    if (body < 8 + 16 || body > 8 + 16 * TCP_SMALL_DESCS || (body - 8) % 16 || (Py_ssize_t)(TCP_HEADER + body) > have)
        goto other;
    if (deadline < 0 || (h[4] == TCP_READ && dlen))
        goto other;
    Py_ssize_t count = (body - 8) / 16;
    uint64_t addrs[TCP_SMALL_DESCS], lens[TCP_SMALL_DESCS], total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy(&addrs[i], h + TCP_HEADER + 8 + 16 * i, 8);
        memcpy(&lens[i], h + TCP_HEADER + 16 + 16 * i, 8);
        if (!lens[i] || addrs[i] > UINT64_MAX - lens[i] || total > UINT64_MAX - lens[i])
            goto other;
        total += lens[i];
    }
    if (h[4] == TCP_WRITE && total != dlen)
        goto other;
    if (registry != NULL && (h[4] == TCP_READ || (uint64_t)have - (TCP_HEADER + body) >= total)) {
        PyObject *unsent = serve_small_request(fd, registry, h[4], id, deadline, addrs, lens, count, total,
                                               h + TCP_HEADER + body);
        if (unsent == NULL)
            goto done;
        if (unsent != Py_None) {
            result = Py_BuildValue("(innKLOKN)", (int)h[4], (Py_ssize_t)have, (Py_ssize_t)(TCP_HEADER + body),
                                   (unsigned long long)id, (long long)deadline, Py_None, (unsigned long long)dlen, unsent);
            goto done;
        }
        Py_DECREF(unsent);
    }
    PyObject *pairs = PyList_New(count);
    if (pairs == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = Py_BuildValue("(KK)", (unsigned long long)addrs[i], (unsigned long long)lens[i]);
        if (pair == NULL) {
            Py_DECREF(pairs);
            goto done;
        }
        PyList_SET_ITEM(pairs, i, pair);
    }
    result = Py_BuildValue("(innKLNKO)", (int)h[4], (Py_ssize_t)have, (Py_ssize_t)(TCP_HEADER + body),
                           (unsigned long long)id, (long long)deadline, pairs, (unsigned long long)dlen, Py_None);
    goto done;
other:
    result = Py_BuildValue("(iniiiOiO)", 0, (Py_ssize_t)have, 0, 0, 0, Py_None, 0, Py_None);
done:
    PyBuffer_Release(&scratch);
    return result;
}

/* ---- cma_windows: a large copy's window loop, each window's checks and its copy ---------------- */

/* What cma_windows answers besides 0 (every byte moved) and -errno: it stopped before a window. */
#define CMA_REVOKING (CMA_INELIGIBLE - 3) /* a REVOKE is under way: wait for it, go on */
#define CMA_CANCELLED (CMA_INELIGIBLE - 4) /* the request was cancelled (or expired) */
#define CMA_STUCK (CMA_INELIGIBLE - 5) /* a window moved nothing */

/* The truth of obj.name; -1 with an exception set. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* The checks before one window, in the order of the Python loop they replace, and the window's
 * copy: `*moved` the bytes it moved, the answer 0, a CMA_* stop or -1 with an exception set. Holds
 * req.io_lock and a lease token around the copy, as CmaChannel's loop would. */
static long
cma_one_window(PyObject *const *args, const lane_work_t *w, Py_ssize_t first, uint64_t offset, uint64_t bytes,
               int lanes, int64_t *moved)
{
    long pidfd = PyLong_AsLong(args[6]);
    PyObject *page = args[9], *regions = args[10], *table = args[11], *req = args[12];
    if (pidfd == -1 && PyErr_Occurred())
        return -1;
    PyObject *lease = PyObject_GetAttr(regions, str_lease);
    if (lease == NULL)
        return -1;
    long stop = -1;
    PyObject *lock = NULL, *token = NULL;
    int revoking = attr_true(lease, str_revoking);
    if (revoking != 0) {
        stop = revoking < 0 ? -1 : CMA_REVOKING;
        goto done;
    }
    lock = PyObject_GetAttr(req, str_io_lock);
    PyObject *got = lock == NULL ? NULL : PyObject_CallMethodNoArgs(lock, str_acquire);
    if (got == NULL) {
        Py_CLEAR(lock);
        goto done;
    }
    Py_DECREF(got);
    int cancelled = attr_true(req, str_cancelled);
    if (cancelled != 0) {
        stop = cancelled < 0 ? -1 : CMA_CANCELLED;
        goto done;
    }
    token = PyObject_CallMethodNoArgs(lease, str_enter);
    int held = token == NULL ? -1 : PyObject_IsTrue(token);
    if (held <= 0) {
        stop = held < 0 ? -1 : CMA_REVOKING;
        goto done;
    }
    /* The page first: the channel closes it before the pidfd, so an open page means an open pidfd
     * (no thread runs between the two: the GIL is held). A closed one is answered as stale: the
     * caller's refresh then says the channel closed. A process gone goes before a stale table, as
     * the Python loop had it. */
    uint64_t current;
    if (!read_generation(page, &current)) {
        stop = CMA_STALE;
        goto done;
    }
    if (!pidfd_running(pidfd)) {
        stop = CMA_GONE;
        goto done;
    }
    int same = attr_is(regions, str_table, table);
    if (same <= 0) {
        stop = same < 0 ? -1 : CMA_STALE; /* replaced since the caller checked the ranges */
        goto done;
    }
    PyObject *generation_obj = PyObject_GetAttr(regions, str_generation);
    if (generation_obj == NULL)
        goto done;
    unsigned long long generation = PyLong_AsUnsignedLongLong(generation_obj);
    Py_DECREF(generation_obj);
    if (generation == (unsigned long long)-1 && PyErr_Occurred())
        goto done;
    if (current != generation) {
        stop = CMA_STALE;
        goto done;
    }
    if (bytes >= GIL_FREE_FROM) {
        Py_BEGIN_ALLOW_THREADS
        *moved = lanes_copy(w, first, offset, bytes, bytes >= LANE_FROM ? lanes : 1);
        Py_END_ALLOW_THREADS
    } else {
        *moved = lane_copy(w, first, offset, bytes);
    }
    stop = 0;
done:;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback); /* (an error of the steps above stays the one raised) */
    int undone = 0;
    if (token != NULL) {
        if (PyObject_IsTrue(token) > 0) {
            PyObject *left = PyObject_CallMethodOneArg(lease, str_leave, token);
            undone |= left == NULL;
            Py_XDECREF(left);
        }
        Py_DECREF(token);
    }
    if (lock != NULL) {
        PyObject *released = PyObject_CallMethodNoArgs(lock, str_release);
        undone |= released == NULL;
        Py_XDECREF(released);
        Py_DECREF(lock);
    }
    Py_DECREF(lease);
    if (type != NULL) {
        PyErr_Clear();
        PyErr_Restore(type, value, traceback);
    }
    return undone || type != NULL ? -1 : stop;
}

PyDoc_STRVAR(cma_windows_doc,
"cma_windows(pid, write, local_iovs, remote_iovs, count, lanes, pidfd, start, limit, generation_page,\n"
"            regions, table, req) -> (moved, stop)\n\n"
"process_vm_writev (write) or process_vm_readv of ``count`` iovec pairs at addresses ``local_iovs``\n"
"and ``remote_iovs`` (equal lengths pairwise; any count) from byte ``start`` on, in windows of up\n"
"to ``limit`` bytes split over up to ``lanes`` threads. Before each window, as CmaChannel's loop:\n"
"no REVOKE under way (``regions.lease``), ``req.io_lock`` taken and ``req.cancelled`` false, a\n"
"lease token taken, ``regions.table`` still ``table`` and the 8-byte generation at the start of\n"
"``generation_page`` still ``regions.generation``, the process ``pidfd`` pins still there; the\n"
"token and the lock given back after it. ``moved``: bytes moved from ``start``; ``stop``: 0 once\n"
"every byte moved, else why it stopped: -errno of a failed copy, CMA_REVOKING, CMA_CANCELLED,\n"
"CMA_STALE, CMA_GONE or CMA_STUCK (a window moved nothing).");

static PyObject *
cma_windows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    lane_work_t w;
    long lanes;
    if (!iov_call_args(args, nargs, 13, "cma_windows", &w, &lanes))
        return NULL;
    Py_ssize_t count = w.count;
    unsigned long long start = PyLong_AsUnsignedLongLong(args[7]);
    unsigned long long limit = PyLong_AsUnsignedLongLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (limit == 0) {
        PyErr_SetString(PyExc_ValueError, "limit must be > 0");
        return NULL;
    }
    Py_ssize_t i = 0; /* the next byte to move: `offset` bytes into entry i */
    uint64_t offset = start, left = 0, done = 0;
    for (; i < count && offset >= w.local[i].iov_len; i++)
        offset -= w.local[i].iov_len;
    if (i == count && offset > 0) {
        PyErr_SetString(PyExc_ValueError, "start lies past the iovecs' end");
        return NULL;
    }
    for (Py_ssize_t j = i; j < count; j++)
        left += w.local[j].iov_len;
    left -= offset;
    long stop = 0;
    while (left > 0) {
        uint64_t bytes = left < limit ? left : limit;
        int64_t moved = 0;
        stop = cma_one_window(args, &w, i, offset, bytes, (int)lanes, &moved);
        if (stop == -1)
            return NULL;
        if (stop == 0 && moved < 0)
            stop = (long)moved;
        else if (stop == 0 && moved == 0)
            stop = CMA_STUCK;
        if (stop != 0)
            break;
        done += (uint64_t)moved;
        left -= (uint64_t)moved;
        entry_advance(&w, &i, &offset, (uint64_t)moved);
    }
    return Py_BuildValue("(Kl)", (unsigned long long)done, stop);
}

/* -- TcpSmall: TCP's latency path on the initiator in one call ------------------------------ */

static PyObject *str_on_event, *str_on_send_failed, *str_disarmed, *str_pending, *str_dead_reason, *str_data_left,
    *str_buf, *str_pos, *str_clock_offset, *str_ids, *str_busy_since, *str_last_alive, *str_last_exchange,
    *str_interval, *str_busy_poll, *str_rearm, *str_data, *str_conn, *str_fd,
    *str_read_lock, *str_send_lock, *stage_send, *stage_reply, *stage_land, *stage_tail;

typedef struct {
    PyObject_HEAD
    int fd;
    PyObject *link, *wire, *conn, *scratch, *read_lock, *send_lock, *connected, *open;
    double guard, landing_rate, landing_spin_max;
} TcpSmall;

static int
TcpSmall_init(TcpSmall *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"link", "wire", "scratch", "connected", "open", "guard", "landing_rate",
                            "landing_spin_max", NULL};
    PyObject *link, *wire, *scratch, *connected, *open;
    double guard, landing_rate, landing_spin_max;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOddd", names, &link, &wire, &scratch, &connected, &open, &guard,
                                     &landing_rate, &landing_spin_max))
        return -1;
    if (landing_rate <= 0.0) {
        PyErr_SetString(PyExc_ValueError, "landing_rate must be positive");
        return -1;
    }
    PyObject *conn = PyObject_GetAttr(wire, str_conn);
    PyObject *read_lock = conn == NULL ? NULL : PyObject_GetAttr(wire, str_read_lock);
    PyObject *send_lock = read_lock == NULL ? NULL : PyObject_GetAttr(wire, str_send_lock);
    PyObject *fd_obj = send_lock == NULL ? NULL : PyObject_GetAttr(wire, str_fd);
    long fd = fd_obj == NULL ? -1 : PyLong_AsLong(fd_obj);
    Py_XDECREF(fd_obj);
    if (fd_obj == NULL || (fd == -1 && PyErr_Occurred())) {
        Py_XDECREF(conn);
        Py_XDECREF(read_lock);
        Py_XDECREF(send_lock);
        return -1;
    }
    self->fd = (int)fd;
    self->guard = guard;
    self->landing_rate = landing_rate;
    self->landing_spin_max = landing_spin_max;
    Py_XSETREF(self->conn, conn);
    Py_XSETREF(self->read_lock, read_lock);
    Py_XSETREF(self->send_lock, send_lock);
    Py_XSETREF(self->link, Py_NewRef(link));
    Py_XSETREF(self->wire, Py_NewRef(wire));
    Py_XSETREF(self->scratch, Py_NewRef(scratch));
    Py_XSETREF(self->connected, Py_NewRef(connected));
    Py_XSETREF(self->open, Py_NewRef(open));
    return 0;
}

static int
TcpSmall_traverse(TcpSmall *self, visitproc visit, void *arg)
{
    Py_VISIT(self->link);
    Py_VISIT(self->wire);
    Py_VISIT(self->conn);
    Py_VISIT(self->scratch);
    Py_VISIT(self->read_lock);
    Py_VISIT(self->send_lock);
    Py_VISIT(self->connected);
    Py_VISIT(self->open);
    return 0;
}

static int
TcpSmall_clear(TcpSmall *self)
{
    Py_CLEAR(self->link);
    Py_CLEAR(self->wire);
    Py_CLEAR(self->conn);
    Py_CLEAR(self->scratch);
    Py_CLEAR(self->read_lock);
    Py_CLEAR(self->send_lock);
    Py_CLEAR(self->connected);
    Py_CLEAR(self->open);
    return 0;
}

static void
TcpSmall_dealloc(TcpSmall *self)
{
    PyObject_GC_UnTrack(self);
    TcpSmall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* lock.acquire(False): 1 taken, 0 not, -1 with an exception set. */
static int
lock_try(PyObject *lock)
{
    PyObject *got = PyObject_CallMethodOneArg(lock, str_acquire, Py_False);
    if (got == NULL)
        return -1;
    int taken = got == Py_True;
    Py_DECREF(got);
    return taken;
}

/* lock.release(); -1 with an exception set. */
static int
lock_release(PyObject *lock)
{
    PyObject *done = PyObject_CallMethodNoArgs(lock, str_release);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* obj.name as a float (an int or a float); -1 with an exception set. */
static int
attr_double(PyObject *obj, PyObject *name, double *out)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    *out = PyFloat_AsDouble(value);
    Py_DECREF(value);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* obj.name = value (a float, or None if value is NULL); -1 with an exception set. */
static int
set_time(PyObject *obj, PyObject *name, const double *value)
{
    PyObject *v = value == NULL ? Py_NewRef(Py_None) : PyFloat_FromDouble(*value);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* The number of entries of link._pending (a dict); -1 with an exception set. */
static Py_ssize_t
pending_count(PyObject *link)
{
    PyObject *pending = PyObject_GetAttr(link, str_pending);
    if (pending == NULL)
        return -1;
    Py_ssize_t n = PyDict_Check(pending) ? PyDict_GET_SIZE(pending) : -1;
    Py_DECREF(pending);
    if (n < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "a link's _pending must be a dict");
    return n;
}

/* Whether the call is the one TcpSmall_run is written for (the caller holds the read lock): the
 * socket left disarmed by an earlier call of the burst, no request waiting on a reply, the wire
 * alive, the connection open with nothing buffered or due. 1, 0, or -1 with an exception set. Reads
 * plain attributes only: Connection.buffered is a property, so its two fields are read instead. */
static int
tcp_small_eligible(TcpSmall *self)
{
    int disarmed = attr_true(self->link, str_disarmed);
    if (disarmed <= 0)
        return disarmed;
    Py_ssize_t waiting = pending_count(self->link);
    if (waiting != 0)
        return waiting < 0 ? -1 : 0;
    int dead = attr_true(self->wire, str_dead_reason);
    if (dead != 0)
        return dead < 0 ? -1 : 0;
    int open = attr_is(self->conn, str_state, self->open);
    if (open <= 0)
        return open;
    int due = attr_true(self->conn, str_data_left);
    if (due != 0)
        return due < 0 ? -1 : 0;
    PyObject *buf = PyObject_GetAttr(self->conn, str_buf);
    PyObject *pos = buf == NULL ? NULL : PyObject_GetAttr(self->conn, str_pos);
    int empty = -1;
    if (pos != NULL && PyByteArray_Check(buf)) {
        Py_ssize_t at = PyLong_AsSsize_t(pos);
        empty = at == -1 && PyErr_Occurred() ? -1 : PyByteArray_GET_SIZE(buf) == at;
    } else if (pos != NULL) {
        PyErr_SetString(PyExc_TypeError, "a connection's _buf must be a bytearray");
    }
    Py_XDECREF(buf);
    Py_XDECREF(pos);
    return empty;
}

/* Our monotonic deadline in the peer's clock, microseconds, as Connection.peer_deadline computes it
 * (the offset's lower bound, moved earlier by the guard; clamped to [1, 2**63 - 1]); -1 with an
 * exception set. */
static int
peer_micros(TcpSmall *self, double deadline, int64_t *out)
{
    PyObject *offset_obj = PyObject_GetAttr(self->conn, str_clock_offset);
    if (offset_obj == NULL)
        return -1;
    double offset = offset_obj == Py_None ? 0.0 : PyFloat_AsDouble(offset_obj);
    Py_DECREF(offset_obj);
    if (offset == -1.0 && PyErr_Occurred())
        return -1;
    double micros = (deadline + offset - self->guard) * 1e6;
    *out = micros >= 9.2233720368547758e18 ? INT64_MAX : micros < 1.0 ? 1 : (int64_t)micros;
    return 0;
}

/* Where TcpSmall_run stopped short, for the link to go on from (see TcpSmall_run_doc); the read lock
 * (and, stopped while sending, the send lock) still held. `rc` -1 or -2: a step failed, and the
 * exception it stands for goes into the tuple, not raised. NULL (the locks released) only if the
 * tuple itself cannot be made. */
static PyObject *
tcp_small_stopped(TcpSmall *self, PyObject *stage, uint64_t req_id, const unsigned char *frame, Py_ssize_t frame_len,
                  uint64_t sent, uint64_t landed, const char *extra, Py_ssize_t extra_len, int eof, int rc)
{
    PyObject *error = Py_NewRef(Py_None);
    if (rc < 0) {
        if (rc == -1)
            PyErr_SetFromErrno(PyExc_OSError);
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (value != NULL && traceback != NULL)
            PyException_SetTraceback(value, traceback);
        Py_XDECREF(type);
        Py_XDECREF(traceback);
        if (value != NULL)
            Py_SETREF(error, value);
    }
    PyObject *frame_obj = frame == NULL ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize((const char *)frame, frame_len);
    PyObject *extra_obj = frame_obj == NULL ? NULL : PyBytes_FromStringAndSize(extra, extra_len);
    PyObject *result = extra_obj == NULL ? NULL
                                         : Py_BuildValue("(OKNKKNON)", stage, (unsigned long long)req_id, frame_obj,
                                                         (unsigned long long)sent, (unsigned long long)landed,
                                                         extra_obj, eof ? Py_True : Py_False, error);
    if (extra_obj == NULL) {
        Py_XDECREF(frame_obj);
        Py_DECREF(error);
    }
    if (result == NULL) {
        if (stage == stage_send)
            lock_release(self->send_lock);
        lock_release(self->read_lock);
    }
    return result;
}

PyDoc_STRVAR(TcpSmall_run_doc,
"run(write, descs, deadline) -> True | None | tuple\n\n"
"A small READ or WRITE of ``descs`` (a list of up to 8 (local, remote, len) int triples, checked\n"
"by the caller against both sides' registrations) over the link, in one call, where the link's\n"
"latency path would do the same in Python (PeerLink.exchange): with the read role free and the\n"
"socket left disarmed by an earlier call of the burst, no request waiting on a reply, the\n"
"connection open with nothing buffered. It sends the frame (a WRITE's data from local memory in\n"
"the same sendmsg), reads the reply straight off the socket and, if it is the one the request\n"
"waits for — the ACK, or a DATA of the READ's length — lands its data in local memory; the\n"
"connection never hears of a request so answered (it would register and forget it).\n\n"
"True: done, every byte moved, the locks given back. None: not taken, nothing done. A tuple\n"
"(stage, req_id, frame, sent, landed, extra, eof, error): it stopped short, holding the read\n"
"lock — and, at stage 'send', the send lock — for PeerLink.resume to go on from: 'send' (the\n"
"socket took ``sent`` bytes of ``frame`` and the data before ``deadline`` or a heartbeat\n"
"interval passed, or ``error``), 'reply' (what came, ``extra``, is not that reply, or nothing\n"
"came within an interval, or the peer closed its end: ``eof``), 'land' (a READ's DATA, ``landed``\n"
"bytes of it in by the deadline), 'tail' (answered, and ``extra`` came behind the reply).\n"
"``error``: the exception a socket error (OSError) or a signal handler raised, not raised.");

static PyObject *
TcpSmall_run(TcpSmall *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run takes 3 arguments (write, descs, deadline)");
        return NULL;
    }
    int write = args[0] == Py_True;
    desc_t descs[SMALL_MAX];
    Py_ssize_t count = parse_descs(args[1], descs);
    double deadline = PyFloat_AsDouble(args[2]);
    if (deadline == -1.0 && PyErr_Occurred())
        return NULL;
    if (count < 0 || count > TCP_SMALL_DESCS)
        Py_RETURN_NONE;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (total + descs[i].len < total)
            Py_RETURN_NONE;
        total += descs[i].len;
    }
    int ok = attr_is(self->link, str_state, self->connected);
    if (ok > 0)
        ok = attr_is(self->link, str_on_event, Py_None); /* (fault injection sees every event: not here) */
    if (ok > 0)
        ok = attr_is(self->link, str_on_send_failed, Py_None);
    if (ok > 0)
        ok = lock_try(self->read_lock);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    /* The read role is ours from here: every way out gives it back, or hands it to the link. */
    double interval, busy_poll;
    PyObject *data = NULL, *id_obj = NULL, *ids = NULL;
    ok = tcp_small_eligible(self);
    if (ok > 0)
        ok = attr_double(self->wire, str_interval, &interval) < 0 || attr_double(self->wire, str_busy_poll, &busy_poll) < 0
                 ? -1
                 : lock_try(self->send_lock);
    if (ok <= 0) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        int released = lock_release(self->read_lock);
        if (type != NULL)
            PyErr_Restore(type, value, traceback);
        return ok < 0 || released < 0 ? NULL : Py_NewRef(Py_None);
    }
    /* Both locks ours. Nothing has been sent: a failure before the sendmsg gives both back. */
    int64_t micros;
    uint64_t req_id = 0;
    data = PyObject_GetAttr(self->scratch, str_data); /* this thread's receive buffer (Wire.scratch) */
    ids = data == NULL ? NULL : PyObject_GetAttr(self->link, str_ids);
    id_obj = ids == NULL ? NULL : PyIter_Next(ids);
    if (id_obj == NULL || !PyByteArray_Check(data) || PyByteArray_GET_SIZE(data) < TCP_HEADER ||
        !exact_u64(id_obj, &req_id) || peer_micros(self, deadline, &micros) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "TcpSmall: a malformed scratch buffer or request id");
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        lock_release(self->send_lock);
        lock_release(self->read_lock);
        PyErr_Restore(type, value, traceback);
        Py_XDECREF(data);
        Py_XDECREF(ids);
        Py_XDECREF(id_obj);
        return NULL;
    }
    Py_DECREF(ids);
    Py_DECREF(id_obj);
    char *buf = PyByteArray_AS_STRING(data);
    Py_ssize_t cap = PyByteArray_GET_SIZE(data);
    PyObject *result = NULL;
    double now = monotonic_now();
    /* As PeerLink.expect: the peer owes us progress from now (nothing else waits, checked above). */
    if (set_time(self->wire, str_busy_since, &now) < 0)
        goto fail_locked;
    /* The frame as hixl._protocol.frames.small_request packs it (little-endian). */
    unsigned char frame[TCP_HEADER + 8 + 16 * TCP_SMALL_DESCS] = {'H', 'X', 'L', '1', write ? TCP_WRITE : TCP_READ, 0, 0, 0};
    uint32_t body = (uint32_t)(8 + 16 * count);
    uint64_t sent_data = write ? total : 0;
    memcpy(frame + 8, &req_id, 8);
    memcpy(frame + 16, &body, 4);
    memcpy(frame + 20, &sent_data, 8);
    memcpy(frame + TCP_HEADER, &micros, 8);
    struct iovec iov[TCP_SMALL_DESCS + 1] = {{frame, TCP_HEADER + body}}, local[TCP_SMALL_DESCS];
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy(frame + TCP_HEADER + 8 + 16 * i, &descs[i].remote, 8);
        memcpy(frame + TCP_HEADER + 16 + 16 * i, &descs[i].len, 8);
        local[i].iov_base = (void *)(uintptr_t)descs[i].local;
        local[i].iov_len = (size_t)descs[i].len;
        iov[i + 1] = local[i];
    }
    uint64_t whole = TCP_HEADER + body + sent_data, sent = 0;
    double until = deadline < now + interval ? deadline : now + interval;
    int rc = send_iov(self->fd, iov, write ? (int)count + 1 : 1, whole, &sent, until, busy_poll);
    if (rc < 0 || sent < whole) {
        result = tcp_small_stopped(self, stage_send, req_id, frame, TCP_HEADER + body, sent, 0, NULL, 0, 0, rc);
        goto out;
    }
    if (lock_release(self->send_lock) < 0)
        goto fail_read_locked;
    now = monotonic_now();
    until = deadline < now + interval ? deadline : now + interval;
    double spin = busy_poll > 0.0 ? busy_poll + (sent_data / self->landing_rate < self->landing_spin_max
                                                     ? sent_data / self->landing_rate
                                                     : self->landing_spin_max)
                                  : 0.0; /* as Wire.reply_spin */
    Py_ssize_t have = 0;
    long kind;
    uint64_t data_len;
    rc = read_header(self->fd, buf, cap, &have, req_id, until, spin, &kind, &data_len);
    if (have) {
        double heard = monotonic_now();
        if (set_time(self->wire, str_last_alive, &heard) < 0)
            goto fail_read_locked;
    }
    if (rc < 0 || kind != (write ? TCP_ACK : TCP_DATA) || (!write && data_len != total)) {
        result = tcp_small_stopped(self, stage_reply, req_id, NULL, 0, sent, 0, buf, have, kind == TCP_EOF, rc);
        goto out;
    }
    Py_ssize_t end = TCP_HEADER;
    if (!write) {
        uint64_t buffered = (uint64_t)(have - TCP_HEADER) < total ? (uint64_t)(have - TCP_HEADER) : total, landed;
        rc = land_iov(self->fd, buf + TCP_HEADER, buffered, local, (int)count, total, deadline, busy_poll, &landed);
        end += (Py_ssize_t)buffered;
        if (rc < 0 || landed < total) {
            result = tcp_small_stopped(self, stage_land, req_id, NULL, 0, sent, landed, buf + end, have - end, 0, rc);
            goto out;
        }
    }
    if (end < have) { /* frames that came behind the reply: the connection's */
        result = tcp_small_stopped(self, stage_tail, req_id, NULL, 0, sent, write ? 0 : total, buf + end, have - end, 0, 0);
        goto out;
    }
    /* Done: the read role given back as PeerLink._give_back_read_role does (nothing buffered). */
    now = monotonic_now();
    Py_ssize_t waiting = pending_count(self->link);
    if (waiting < 0 || set_time(self->link, str_last_exchange, &now) < 0 ||
        (waiting == 0 && set_time(self->wire, str_busy_since, NULL) < 0))
        goto fail_read_locked;
    if (lock_release(self->read_lock) < 0)
        goto out;
    if (waiting > 0) { /* a request sent meanwhile, for the reader thread to answer: re-arm */
        PyObject *rearmed = PyObject_CallMethodNoArgs(self->link, str_rearm);
        if (rearmed == NULL)
            goto out;
        Py_DECREF(rearmed);
    }
    result = Py_NewRef(Py_True);
    goto out;
fail_locked:
    lock_release(self->send_lock);
fail_read_locked: {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    lock_release(self->read_lock);
    PyErr_Restore(type, value, traceback);
}
out:
    Py_DECREF(data);
    return result;
}

static PyMethodDef TcpSmall_methods[] = {
    {"run", (PyCFunction)(void (*)(void))TcpSmall_run, METH_FASTCALL, TcpSmall_run_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(TcpSmall_doc,
"TcpSmall(link, wire, scratch, connected, open, guard, landing_rate, landing_spin_max)\n\n"
"TCP's latency path on the initiator to one peer in one call (see run): the ``link`` (a\n"
"PeerLink: its .state must be ``connected``), its ``wire`` (socket, locks, connection, whose\n"
".state must be ``open``), ``scratch`` (a threading.local whose .data is the calling thread's\n"
"receive buffer), and the constants of Connection.peer_deadline (``guard``) and Wire.reply_spin\n"
"(``landing_rate``, ``landing_spin_max``). Only in the C extension: the pure twin's latency path\n"
"is PeerLink.exchange itself.");

static PyTypeObject TcpSmallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hixl._accel._native.TcpSmall",
    .tp_basicsize = sizeof(TcpSmall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = TcpSmall_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)TcpSmall_init,
    .tp_traverse = (traverseproc)TcpSmall_traverse,
    .tp_clear = (inquiry)TcpSmall_clear,
    .tp_dealloc = (destructor)TcpSmall_dealloc,
    .tp_methods = TcpSmall_methods,
};

static PyMethodDef methods[] = {
    {"check_small", (PyCFunction)(void (*)(void))check_small, METH_FASTCALL, check_small_doc},
    {"mapped_copy", (PyCFunction)(void (*)(void))mapped_copy, METH_FASTCALL, mapped_copy_doc},
    {"copy_pieces", (PyCFunction)(void (*)(void))copy_pieces, METH_FASTCALL, copy_pieces_doc},
    {"cma_copy", (PyCFunction)(void (*)(void))cma_copy, METH_FASTCALL, cma_copy_doc},
    {"cma_window", (PyCFunction)(void (*)(void))cma_window, METH_FASTCALL, cma_window_doc},
    {"cma_windows", (PyCFunction)(void (*)(void))cma_windows, METH_FASTCALL, cma_windows_doc},
    {"tcp_send", (PyCFunction)(void (*)(void))tcp_send, METH_FASTCALL, tcp_send_doc},
    {"tcp_reply", (PyCFunction)(void (*)(void))tcp_reply, METH_FASTCALL, tcp_reply_doc},
    {"tcp_land", (PyCFunction)(void (*)(void))tcp_land, METH_FASTCALL, tcp_land_doc},
    {"tcp_land_words", (PyCFunction)(void (*)(void))tcp_land_words, METH_FASTCALL, tcp_land_words_doc},
    {"tcp_request", (PyCFunction)(void (*)(void))tcp_request, METH_FASTCALL, tcp_request_doc},
    {"weights_hash", (PyCFunction)(void (*)(void))weights_hash, METH_FASTCALL, weights_hash_doc},
    {"copy_hash", (PyCFunction)(void (*)(void))copy_hash, METH_FASTCALL, copy_hash_doc},
    {"row_hashes", (PyCFunction)(void (*)(void))row_hashes, METH_FASTCALL, row_hashes_doc},
    {"gather_rows", (PyCFunction)(void (*)(void))gather_rows, METH_FASTCALL, gather_rows_doc},
    {"gather_checked_rows", (PyCFunction)(void (*)(void))gather_checked_rows, METH_FASTCALL, gather_checked_rows_doc},
    {"accept_rows", (PyCFunction)(void (*)(void))accept_rows, METH_FASTCALL, accept_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hixl._accel._native", "hixl's hot path in C (see hixl._accel).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } strings[] = {
        {&str_table, "table"},       {&str_readable, "readable"}, {&str_writable, "writable"},
        {&str_intervals, "intervals"}, {&str_state, "state"},     {&str_regions, "regions"},
        {&str_lease, "lease"},       {&str_revoking, "revoking"}, {&str_generation, "generation"},
        {&str_enter, "enter"},       {&str_leave, "leave"},       {&str_io_lock, "io_lock"},
        {&str_cancelled, "cancelled"},
        {&str_on_event, "on_event"}, {&str_on_send_failed, "on_send_failed"}, {&str_disarmed, "_disarmed"},
        {&str_pending, "_pending"}, {&str_dead_reason, "dead_reason"}, {&str_data_left, "data_left"},
        {&str_buf, "_buf"}, {&str_pos, "_pos"}, {&str_clock_offset, "_clock_offset"}, {&str_ids, "_ids"},
        {&str_busy_since, "busy_since"}, {&str_last_alive, "last_alive"}, {&str_last_exchange, "_last_exchange"},
        {&str_interval, "interval"}, {&str_busy_poll, "busy_poll"}, {&str_acquire, "acquire"},
        {&str_release, "release"}, {&str_rearm, "_rearm"}, {&str_data, "data"}, {&str_conn, "conn"},
        {&str_fd, "fd"}, {&str_read_lock, "read_lock"}, {&str_send_lock, "send_lock"},
        {&stage_send, "send"}, {&stage_reply, "reply"}, {&stage_land, "land"}, {&stage_tail, "tail"},
    };
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++)
        if (*strings[i].slot == NULL && (*strings[i].slot = PyUnicode_InternFromString(strings[i].text)) == NULL)
            return NULL;
    if (PyType_Ready(&CmaSmallType) < 0 || PyType_Ready(&TcpSmallType) < 0)
        return NULL;
    hash_tables_init();
    row_hash_choose();
    static int forked_handler;
    if (!forked_handler && pthread_atfork(NULL, NULL, lanes_after_fork) == 0)
        forked_handler = 1;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "GIL_FREE_FROM", GIL_FREE_FROM) < 0 ||
                      PyModule_AddIntConstant(m, "ORDERED_ROW_READS", ORDERED_ROW_READS) < 0 ||
                      PyModule_AddIntConstant(m, "SMALL_MAX", SMALL_MAX) < 0 ||
                      PyModule_AddIntConstant(m, "PROC_MEM_MAX", PROC_MEM_MAX) < 0 ||
                      PyModule_AddIntConstant(m, "LANE_FROM", LANE_FROM) < 0 ||
                      PyModule_AddIntConstant(m, "STREAM_FROM", STREAM_FROM) < 0 ||
                      PyModule_AddIntConstant(m, "MAX_LANES", MAX_LANES) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_INELIGIBLE", CMA_INELIGIBLE) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_STALE", CMA_STALE) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_GONE", CMA_GONE) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_REVOKING", CMA_REVOKING) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_CANCELLED", CMA_CANCELLED) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_STUCK", CMA_STUCK) < 0 ||
                      PyModule_AddObjectRef(m, "CmaSmall", (PyObject *)&CmaSmallType) < 0 ||
                      PyModule_AddObjectRef(m, "TcpSmall", (PyObject *)&TcpSmallType) < 0 ||
                      PyModule_AddIntConstant(m, "TCP_WAIT", TCP_WAIT) < 0 ||
                      PyModule_AddIntConstant(m, "TCP_EOF", TCP_EOF) < 0 ||
                      PyModule_AddIntConstant(m, "TCP_RANGES", TCP_RANGES) < 0 ||
                      PyModule_AddIntConstant(m, "TCP_SERVE_MAX", TCP_SERVE_MAX) < 0 ||
                      PyModule_AddIntConstant(m, "TCP_LOWAT", TCP_LOWAT) < 0 ||
                      PyModule_AddIntConstant(m, "TCP_LOWAT_FROM", TCP_LOWAT_FROM) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
