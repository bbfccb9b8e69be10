/* The 4 KiB read hit in C, for pyfuse3's read hook (deps/passthrough/pyfuse3-read-hook.patch).
 *
 * It is the one-block branch of hit.OpenFile.read_hit, step for step, on the same Python
 * objects: the handle's CachedFile, its extent's valid bit, one pread of the cache file, the
 * block's checksum, the stream detector and the counters, and the hit's latency in the
 * handle's histogram (latency.Histogram.add). Anything else (another size, a block not
 * valid, an SSD error, a checksum that does not match, an object of another type) returns -1
 * before any change, and pyfuse3 hands the request to Operations.read, whose Python read_hit
 * then decides. So this file holds no state of its own and decides nothing that read_hit
 * would not: keep the two in step (tests/unit/test_fast_hit.py runs both on the same cases).
 *
 * What it saves is pyfuse3's per-request coroutine, two Python frames and the dispatch
 * through Operations.read (docs/benchmarks.md). The objects' attributes are __slots__, read
 * and written at their offsets as their member descriptors do (found once, at install, and
 * each object's type checked at every use): generic attribute lookups cost more than the
 * rest of the hit.
 * It runs in the thread of the trio loop with the GIL held, like every handler.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>     /* libxxhash-dev: the XXH3 of the xxhash package (integrity.block_sum) */

#define BLK_SHIFT 12
#define BLK_SIZE (1 << BLK_SHIFT)
#define EXT_SHIFT 16
#define BLK_IN_EXT ((1 << (EXT_SHIFT - BLK_SHIFT)) - 1)
#define SUM_MASK 0xFFFFFFFFULL

static PyObject *open_files;    /* Operations._open: fh -> OpenFile */
static PyObject *check_reads;   /* integrity.CHECK_READS, a list of one bool */
static long long seq_slack;     /* SequentialDetector.SLACK */
static Py_ssize_t nbuckets;     /* latency.NBUCKETS */
static PyObject *one, *blk;     /* the ints 1 and BLK_SIZE */

/* The classes whose slots the hit reads, and the slots' offsets. */
enum { OPENFILE, CACHEDFILE, EXTENT, SEQDETECTOR, STATS, HISTOGRAM, NTYPES };
static PyTypeObject *types[NTYPES];
struct offsets {
    Py_ssize_t of_cfile, of_seq, of_stats, cf_size, cf_extents, cf_cache_fd, x_valid, x_freq,
        x_summed, x_sums, seq_next_off, seq_run, st_read_ops, st_hit_ops, st_read_bytes,
        st_hit_bytes, st_lat_hit, h_counts, h_count, h_sum_ns;
};
static struct offsets S;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* The offset of slot `name` of `type` (an object slot of its own __slots__); -1 if none. */
static int find_slot(PyTypeObject *type, const char *name, Py_ssize_t *offset)
{
    PyObject *d = PyDict_GetItemString(type->tp_dict, name);
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)
        || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
        return -1;
    }
    *offset = ((PyMemberDescrObject *)d)->d_member->offset;
    return 0;
}

/* The int in a slot as a C long long; -1 (no exception kept) if unset or not an int. */
static int get_ll(PyObject *o, Py_ssize_t off, long long *out)
{
    PyObject *v = SLOT(o, off);
    if (v == NULL || !PyLong_CheckExact(v))
        return -1;
    *out = PyLong_AsLongLong(v);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

static int set_ll(PyObject *o, Py_ssize_t off, long long value)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL)
        return -1;
    Py_XSETREF(SLOT(o, off), v);
    return 0;
}

/* slot += step (ints). */
static int add_slot(PyObject *o, Py_ssize_t off, PyObject *step)
{
    PyObject *v = SLOT(o, off);
    if (v == NULL)
        return -1;
    PyObject *sum = PyNumber_Add(v, step);
    if (sum == NULL)
        return -1;
    Py_SETREF(SLOT(o, off), sum);
    return 0;
}

/* Is the block at buf what x.sums[b] says (integrity.block_sum)? 1, 0, or -1 if unknown.
 * x.sums is an array('I'): read through its buffer, without making an int of the sum. */
static int sum_matches(PyObject *x, int b, const char *buf)
{
    PyObject *sums = SLOT(x, S.x_sums);
    Py_buffer view;
    if (sums == NULL || PyObject_GetBuffer(sums, &view, PyBUF_FORMAT) < 0)
        return -1;
    int r = -1;
    if (view.itemsize == 4 && view.format != NULL && strcmp(view.format, "I") == 0
        && view.len >= (Py_ssize_t)(b + 1) * 4)
        r = (XXH3_64bits(buf, BLK_SIZE) & SUM_MASK) == ((const uint32_t *)view.buf)[b];
    PyBuffer_Release(&view);
    return r;
}

/* The bookkeeping of a hit that is answered: read_hit's freq, stream and counters. */
static int note_hit(PyObject *of, PyObject *x, long long off, long long freq)
{
    if (freq < 3 && set_ll(x, S.x_freq, freq + 1) < 0)
        return -1;
    PyObject *seq = SLOT(of, S.of_seq);         /* SequentialDetector.note, as read_hit */
    long long next_off, run;
    if (seq == NULL || !Py_IS_TYPE(seq, types[SEQDETECTOR])
        || get_ll(seq, S.seq_next_off, &next_off) || get_ll(seq, S.seq_run, &run))
        return -1;
    if (next_off >= 0 && off - next_off >= -seq_slack && off - next_off <= seq_slack) {
        run += BLK_SIZE;
        if (off + BLK_SIZE > next_off)
            next_off = off + BLK_SIZE;
    } else {
        run = BLK_SIZE;
        next_off = off + BLK_SIZE;
    }
    if (set_ll(seq, S.seq_run, run) < 0 || set_ll(seq, S.seq_next_off, next_off) < 0)
        return -1;
    PyObject *st = SLOT(of, S.of_stats);
    if (st == NULL || !Py_IS_TYPE(st, types[STATS]) || add_slot(st, S.st_read_ops, one) < 0
        || add_slot(st, S.st_hit_ops, one) < 0 || add_slot(st, S.st_read_bytes, blk) < 0
        || add_slot(st, S.st_hit_bytes, blk) < 0)
        return -1;
    return 0;
}

/* latency.bucket_of */
static Py_ssize_t bucket_of(long long ns)
{
    int b = 0;
    for (unsigned long long v = ns > 0 ? (unsigned long long)ns : 0; v; v >>= 1)
        b++;                                        /* int.bit_length() */
    Py_ssize_t i = b <= 3 ? (ns > 0 ? ns : 0) : ((Py_ssize_t)(b - 3) << 2) + (ns >> (b - 3));
    return i < nbuckets ? i : nbuckets - 1;
}

/* Histogram.add (latency.py) on the handle's stats.lat_hit. */
static int note_latency(PyObject *of, long long ns)
{
    Py_ssize_t i = bucket_of(ns);
    PyObject *st = SLOT(of, S.of_stats);
    PyObject *h = st && Py_IS_TYPE(st, types[STATS]) ? SLOT(st, S.st_lat_hit) : NULL;
    if (h == NULL || !Py_IS_TYPE(h, types[HISTOGRAM]))
        return -1;
    int r = -1;
    PyObject *counts = SLOT(h, S.h_counts);
    PyObject *v = PyLong_FromLongLong(ns);
    if (v != NULL && counts != NULL
        && PyList_CheckExact(counts) && PyList_GET_SIZE(counts) > i) {
        PyObject *n = PyNumber_Add(PyList_GET_ITEM(counts, i), one);
        if (n != NULL) {
            PyList_SetItem(counts, i, n);           /* steals n */
            if (add_slot(h, S.h_count, one) == 0 && add_slot(h, S.h_sum_ns, v) == 0)
                r = 0;
        }
    }
    Py_XDECREF(v);
    return r;
}

/* One whole cached block of handle `of` into buf: BLK_SIZE, or -1 when Operations.read must
 * decide (nothing changed then). */
static Py_ssize_t read_block(PyObject *of, long long off, char *buf)
{
    long long size, valid, fd, summed, freq;
    PyObject *cf = SLOT(of, S.of_cfile);
    if (cf == NULL || !Py_IS_TYPE(cf, types[CACHEDFILE]) || get_ll(cf, S.cf_size, &size)
        || off + BLK_SIZE > size)
        return -1;
    PyObject *extents = SLOT(cf, S.cf_extents);
    if (extents == NULL || !PyDict_CheckExact(extents))
        return -1;
    PyObject *key = PyLong_FromLongLong(off >> EXT_SHIFT);
    if (key == NULL)
        return -1;
    PyObject *x = PyDict_GetItemWithError(extents, key);
    Py_DECREF(key);
    if (x == NULL || !Py_IS_TYPE(x, types[EXTENT]))
        return -1;
    int b = (int)((off >> BLK_SHIFT) & BLK_IN_EXT);
    if (get_ll(x, S.x_valid, &valid) || !((valid >> b) & 1) || get_ll(x, S.x_freq, &freq)
        || get_ll(cf, S.cf_cache_fd, &fd) || get_ll(x, S.x_summed, &summed))
        return -1;
    ssize_t n = pread((int)fd, buf, BLK_SIZE, off);
    if (n < 0)          /* the SSD failed us: read_hit counts it and BACKING answers */
        return -1;
    if (n < BLK_SIZE)   /* past the cache file's end: zeros, as in a hole */
        memset(buf + n, 0, BLK_SIZE - n);
    if ((summed >> b) & 1) {
        int check = PyObject_IsTrue(PyList_GET_ITEM(check_reads, 0));
        if (check < 0 || (check && sum_matches(x, b, buf) != 1))    /* damaged: read_hit */
            return -1;                                              /* raises Damaged */
    }
    Py_INCREF(x);
    int noted = note_hit(of, x, off, freq);
    Py_DECREF(x);
    /* The answer stands from here; the bookkeeping cannot fail on read_hit's own objects. */
    if (noted < 0)
        PyErr_Clear();
    return BLK_SIZE;
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);    /* time.perf_counter_ns's clock */
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* pyfuse3's read hook: the answer's length, or -1 for Operations.read; no exception left. */
static Py_ssize_t hook(PyObject *ctx, uint64_t fh, off_t off, size_t size, char *buf)
{
    (void)ctx;
    if (size != BLK_SIZE || (off & (BLK_SIZE - 1)) || open_files == NULL)
        return -1;
    long long t0 = now_ns();
    PyObject *key = PyLong_FromUnsignedLongLong(fh);
    PyObject *of = key ? PyDict_GetItemWithError(open_files, key) : NULL;
    Py_XDECREF(key);
    Py_ssize_t n = -1;
    if (of != NULL && Py_IS_TYPE(of, types[OPENFILE])) {
        Py_INCREF(of);
        n = read_block(of, (long long)off, buf);
        if (n >= 0 && note_latency(of, now_ns() - t0) < 0)
            PyErr_Clear();                          /* the answer stands */
        Py_DECREF(of);
    }
    if (PyErr_Occurred())
        PyErr_Clear();
    return n;
}

static PyObject *install(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *files, *check;
    long long slack;
    Py_ssize_t buckets;
    PyTypeObject *t[NTYPES];
    if (!PyArg_ParseTuple(args, "O!O!LnO!O!O!O!O!O!", &PyDict_Type, &files, &PyList_Type,
                          &check, &slack, &buckets, &PyType_Type, &t[OPENFILE], &PyType_Type,
                          &t[CACHEDFILE], &PyType_Type, &t[EXTENT], &PyType_Type,
                          &t[SEQDETECTOR], &PyType_Type, &t[STATS], &PyType_Type,
                          &t[HISTOGRAM]))
        return NULL;
    if (PyList_GET_SIZE(check) != 1) {
        PyErr_SetString(PyExc_ValueError, "check_reads must be a list of one bool");
        return NULL;
    }
    struct offsets o;
    if (find_slot(t[OPENFILE], "cfile", &o.of_cfile) || find_slot(t[OPENFILE], "seq", &o.of_seq)
        || find_slot(t[OPENFILE], "stats", &o.of_stats)
        || find_slot(t[CACHEDFILE], "size", &o.cf_size)
        || find_slot(t[CACHEDFILE], "extents", &o.cf_extents)
        || find_slot(t[CACHEDFILE], "cache_fd", &o.cf_cache_fd)
        || find_slot(t[EXTENT], "valid", &o.x_valid) || find_slot(t[EXTENT], "freq", &o.x_freq)
        || find_slot(t[EXTENT], "summed", &o.x_summed) || find_slot(t[EXTENT], "sums", &o.x_sums)
        || find_slot(t[SEQDETECTOR], "next_off", &o.seq_next_off)
        || find_slot(t[SEQDETECTOR], "run", &o.seq_run)
        || find_slot(t[STATS], "read_ops", &o.st_read_ops)
        || find_slot(t[STATS], "hit_ops", &o.st_hit_ops)
        || find_slot(t[STATS], "read_bytes", &o.st_read_bytes)
        || find_slot(t[STATS], "hit_bytes", &o.st_hit_bytes)
        || find_slot(t[STATS], "lat_hit", &o.st_lat_hit)
        || find_slot(t[HISTOGRAM], "counts", &o.h_counts)
        || find_slot(t[HISTOGRAM], "count", &o.h_count)
        || find_slot(t[HISTOGRAM], "sum_ns", &o.h_sum_ns))
        return NULL;                    /* (the hook in use, if any, keeps what it had) */
    S = o;
    for (int i = 0; i < NTYPES; i++) {
        Py_INCREF(t[i]);
        Py_XSETREF(types[i], t[i]);
    }
    Py_INCREF(files);
    Py_INCREF(check);
    Py_XSETREF(open_files, files);
    Py_XSETREF(check_reads, check);
    seq_slack = slack;
    nbuckets = buckets;
    return PyCapsule_New((void *)hook, "pyfuse3.read_hook", NULL);
}

static PyObject *read_py(PyObject *self, PyObject *args)
{
    /* For the tests: what the hook answers for (fh, off, size): bytes, or None for -1. */
    (void)self;
    unsigned long long fh;
    long long off;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "KLn", &fh, &off, &size))
        return NULL;
    char buf[BLK_SIZE];
    if (size > BLK_SIZE)
        Py_RETURN_NONE;
    Py_ssize_t n = hook(NULL, fh, (off_t)off, (size_t)size, buf);
    if (n < 0)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(buf, n);
}

static PyObject *sum_py(PyObject *self, PyObject *arg)
{
    /* For the tests: the checksum this file compares, of one block. */
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    unsigned long long h = XXH3_64bits(view.buf, (size_t)view.len) & SUM_MASK;
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *bucket_py(PyObject *self, PyObject *arg)
{
    /* For the tests: the latency bucket of a duration in ns (after install). */
    (void)self;
    long long ns = PyLong_AsLongLong(arg);
    if (ns == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(bucket_of(ns));
}

static PyMethodDef methods[] = {
    {"install", install, METH_VARARGS,
     "install(open_files, check_reads, seq_slack, nbuckets, OpenFile, CachedFile, Extent, "
     "SequentialDetector, Stats, Histogram) -> the capsule for pyfuse3.set_read_hook"},
    {"read", read_py, METH_VARARGS, "read(fh, off, size) -> bytes, or None: the hook's answer"},
    {"block_sum", sum_py, METH_O, "block_sum(buf) -> the checksum the hook compares"},
    {"bucket_of", bucket_py, METH_O, "bucket_of(ns) -> the latency bucket the hook counts in"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cachefs._hit", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hit(void)
{
    if ((one = PyLong_FromLong(1)) == NULL || (blk = PyLong_FromLong(BLK_SIZE)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "BLK_SIZE", BLK_SIZE) < 0
                      || PyModule_AddIntConstant(m, "EXT_SHIFT", EXT_SHIFT) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
