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
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* Totals from this many bytes are copied with the GIL released (as hixl._accel.GIL_FREE_FROM). */
#define GIL_FREE_FROM (64u << 10)
/* The most descriptors the small-request functions take (at least hixl's SMALL_DESCS). */
#define SMALL_MAX 64
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct {
    uint64_t local, remote, len;
} desc_t;

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

PyDoc_STRVAR(mapped_copy_doc,
"mapped_copy(descs, write, starts, ends, heres, writable) -> int\n\n"
"Copy a small list of (local, remote, len) descriptors through the peer's memory mapped here:\n"
"mapping i covers the peer's [starts[i], ends[i]) at address heres[i], writable if writable[i] is\n"
"True. 1: all were mapped (writably, for a write) and are copied; 0: none was, nothing copied;\n"
"-1: some were, or descs is not such a list, nothing copied.");

static PyObject *
mapped_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "mapped_copy takes 6 arguments");
        return NULL;
    }
    int write = PyObject_IsTrue(args[1]);
    if (write < 0 || !lists(args, 2, 4))
        return NULL;
    PyObject *starts = args[2], *ends = args[3], *heres = args[4], *writable = args[5];
    desc_t descs[SMALL_MAX];
    void *dst[SMALL_MAX];
    const void *src[SMALL_MAX];
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
        uint64_t there = here + (descs[i].remote - start);
        dst[i] = (void *)(uintptr_t)(write ? there : descs[i].local);
        src[i] = (const void *)(uintptr_t)(write ? descs[i].local : there);
        total += descs[i].len;
        mapped++;
    }
    if (mapped != count)
        return PyLong_FromLong(mapped == 0 ? 0 : -1);
    if (total >= GIL_FREE_FROM) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++)
            memcpy(dst[i], src[i], descs[i].len);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            memcpy(dst[i], src[i], descs[i].len);
    }
    return PyLong_FromLong(1);
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
    Py_buffer page;
    if (PyObject_GetBuffer(args[4], &page, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* closed: the general path reports it */
        return PyLong_FromLong(CMA_INELIGIBLE);
    }
    uint64_t generation = 0;
    if (page.len >= 8) {
        const unsigned char *bytes = page.buf;
        for (int i = 7; i >= 0; i--) /* little-endian, as the peer writes it ("<Q") */
            generation = (generation << 8) | bytes[i];
    }
    PyBuffer_Release(&page);
    if (generation != expected)
        return PyLong_FromLong(CMA_STALE);
#ifdef SYS_pidfd_send_signal
    /* Signal 0 through the pidfd: the process it pins still exists (its pid not reused). */
    if (pidfd < 0 || (syscall(SYS_pidfd_send_signal, (int)pidfd, 0, NULL, 0) < 0 && errno != EPERM))
        return PyLong_FromLong(CMA_GONE);
#else
    return PyLong_FromLong(CMA_INELIGIBLE);
#endif
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
    if (total >= GIL_FREE_FROM) {
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
    return PyLong_FromSsize_t(moved < 0 ? -(Py_ssize_t)err : (Py_ssize_t)moved);
}

/* A C-contiguous buffer of 8-byte unsigned ints with the given number of dimensions. */
static int
u64_buffer(PyObject *obj, Py_buffer *view, int ndim, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return 0;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "Q") != 0 && strcmp(f, "L") != 0) || view->ndim != ndim ||
        (ndim == 2 && view->shape[1] != 3)) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous uint64 array of %s", what,
                     ndim == 2 ? "shape (n, 3)" : "one dimension");
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(copy_pieces_doc,
"copy_pieces(pieces, heres, write) -> None\n\n"
"For every row i of ``pieces`` ((n, 3) uint64: local, remote, len) copy len bytes between the\n"
"local address and heres[i] (where the remote range is mapped here): to heres[i] if ``write``,\n"
"from it otherwise. In row order; the GIL is released for large totals.");

static PyObject *
copy_pieces(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_pieces takes 3 arguments");
        return NULL;
    }
    int write = PyObject_IsTrue(args[2]);
    if (write < 0)
        return NULL;
    Py_buffer pv, hv;
    if (!u64_buffer(args[0], &pv, 2, "pieces"))
        return NULL;
    if (!u64_buffer(args[1], &hv, 1, "heres")) {
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
    for (Py_ssize_t i = 0; i < count && total < GIL_FREE_FROM; i++)
        total += rows[3 * i + 2];
    PyThreadState *released = total >= GIL_FREE_FROM ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        void *local = (void *)(uintptr_t)rows[3 * i], *there = (void *)(uintptr_t)heres[i];
        if (write)
            memcpy(there, local, rows[3 * i + 2]);
        else
            memcpy(local, there, rows[3 * i + 2]);
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&hv);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"check_small", (PyCFunction)(void (*)(void))check_small, METH_FASTCALL, check_small_doc},
    {"mapped_copy", (PyCFunction)(void (*)(void))mapped_copy, METH_FASTCALL, mapped_copy_doc},
    {"copy_pieces", (PyCFunction)(void (*)(void))copy_pieces, METH_FASTCALL, copy_pieces_doc},
    {"cma_copy", (PyCFunction)(void (*)(void))cma_copy, METH_FASTCALL, cma_copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hixl._accel._native", "hixl's hot path in C (see hixl._accel).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "GIL_FREE_FROM", GIL_FREE_FROM) < 0 ||
                      PyModule_AddIntConstant(m, "SMALL_MAX", SMALL_MAX) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_INELIGIBLE", CMA_INELIGIBLE) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_STALE", CMA_STALE) < 0 ||
                      PyModule_AddIntConstant(m, "CMA_GONE", CMA_GONE) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
