/* ember.csprng._shuffle: the three passes of randperm (stream layout version 3), compiled.
 *
 * ember.csprng.shuffle holds a NumPy twin of each function, which is the reference for its
 * behaviour (tests run both on the same words); the layout itself is docs/csprng-stream.md.
 * Every function takes objects with the writable or readable buffer protocol and releases the
 * GIL while it works, so that disjoint bucket ranges can be shuffled on two threads.
 *
 * scatter(bucket_words, bits, out, offsets)
 *     bucket_words: n uint32; out: n int64; offsets: 2**bits + 1 int64 (written).
 *     Element i goes to bucket bucket_words[i] >> (32 - bits) (bucket 0 when bits is 0); out
 *     holds the buckets one after the other, each in increasing element order, and bucket b
 *     occupies out[offsets[b]:offsets[b + 1]].
 *
 * rejects(fy_words, offsets, lo, hi) -> list of positions
 *     The positions q (increasing) in buckets lo..hi-1 whose word Lemire's method rejects for the
 *     range m = q - offsets[b] + 1, i.e. (w * m) mod 2**32 < 2**32 mod m. Position 0 of a bucket
 *     (m = 1) never rejects.
 *
 * apply(out, fy_words, offsets, lo, hi)
 *     Fisher-Yates in each bucket lo..hi-1: for p from size - 1 down to 1, swap entries p and
 *     j = (w * (p + 1)) >> 32 of the bucket, w being fy_words[offsets[b] + p] (which the caller
 *     has already replaced where rejects() named it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_buffers.h"

/* offsets must be non-decreasing, start at 0 and end at n: checked once, before any access */
static int check_offsets(const int64_t *off, Py_ssize_t count, Py_ssize_t n)
{
    if (count < 2 || off[0] != 0 || off[count - 1] != n) {
        PyErr_SetString(PyExc_ValueError, "offsets must run from 0 to the number of elements");
        return -1;
    }
    for (Py_ssize_t b = 1; b < count; b++) {
        if (off[b] < off[b - 1]) {
            PyErr_SetString(PyExc_ValueError, "offsets must be non-decreasing");
            return -1;
        }
    }
    return 0;
}

static PyObject *shuffle_scatter(PyObject *self, PyObject *args)
{
    PyObject *wo, *oo, *fo;
    int bits;
    Py_buffer wv, ov, fv;
    if (!PyArg_ParseTuple(args, "OiOO", &wo, &bits, &oo, &fo))
        return NULL;
    if (bits < 0 || bits > 24) {
        PyErr_Format(PyExc_ValueError, "bits must be in [0, 24], got %d", bits);
        return NULL;
    }
    const buffer_spec bufs[] = {{wo, &wv, 0, 4, "bucket_words"}, {oo, &ov, 1, 8, "out"},
                                {fo, &fv, 1, 8, "offsets"}};
    if (get_buffers(bufs, 3) < 0)
        return NULL;
    Py_ssize_t n = wv.len / 4, buckets = (Py_ssize_t)1 << bits;
    PyObject *result = NULL;
    if (ov.len / 8 != n || fv.len / 8 != buckets + 1) {
        PyErr_SetString(PyExc_ValueError, "scatter: out must hold one int64 per word and "
                        "offsets 2**bits + 1");
        goto done;
    }
    {
        const uint32_t *w = (const uint32_t *)wv.buf;
        int64_t *out = (int64_t *)ov.buf, *off = (int64_t *)fv.buf;
        Py_BEGIN_ALLOW_THREADS
        if (bits == 0) {
            for (Py_ssize_t i = 0; i < n; i++)
                out[i] = i;
            off[0] = 0;
            off[1] = n;
        } else {
            int shift = 32 - bits;
            memset(off, 0, (size_t)(buckets + 1) * sizeof(int64_t));
            for (Py_ssize_t i = 0; i < n; i++)
                off[(w[i] >> shift) + 1]++;
            for (Py_ssize_t b = 1; b <= buckets; b++)
                off[b] += off[b - 1];
            /* off[b] is now the start of bucket b; advance a cursor per bucket in off[b], then
             * shift back so that off[b] is the start again */
            for (Py_ssize_t i = 0; i < n; i++)
                out[off[w[i] >> shift]++] = i;
            memmove(off + 1, off, (size_t)buckets * sizeof(int64_t));
            off[0] = 0;
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_buffers(bufs, 3);
    return result;
}

static int bucket_range(Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t buckets)
{
    if (lo < 0 || hi < lo || hi > buckets) {
        PyErr_Format(PyExc_ValueError, "bucket range [%zd, %zd) is outside [0, %zd)", lo, hi,
                     buckets);
        return -1;
    }
    return 0;
}

static PyObject *shuffle_rejects(PyObject *self, PyObject *args)
{
    PyObject *wo, *fo;
    Py_ssize_t lo, hi;
    Py_buffer wv, fv;
    if (!PyArg_ParseTuple(args, "OOnn", &wo, &fo, &lo, &hi))
        return NULL;
    const buffer_spec bufs[] = {{wo, &wv, 0, 4, "fy_words"}, {fo, &fv, 0, 8, "offsets"}};
    if (get_buffers(bufs, 2) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = wv.len / 4, count = fv.len / 8;
    const uint32_t *w = (const uint32_t *)wv.buf;
    const int64_t *off = (const int64_t *)fv.buf;
    if (check_offsets(off, count, n) < 0 || bucket_range(lo, hi, count - 1) < 0)
        goto done;
    result = PyList_New(0);
    if (result == NULL)
        goto done;
    for (Py_ssize_t b = lo; b < hi; b++) {
        for (int64_t q = off[b] + 1; q < off[b + 1]; q++) {
            uint64_t m = (uint64_t)(q - off[b] + 1);
            uint32_t low = (uint32_t)((uint64_t)w[q] * m);
            /* 2**32 mod m, without 64-bit division in the common case low >= m */
            if (low < m && low < (uint32_t)((0x100000000ULL) % m)) {
                PyObject *pos = PyLong_FromLongLong(q);
                if (pos == NULL || PyList_Append(result, pos) < 0) {
                    Py_XDECREF(pos);
                    Py_CLEAR(result);
                    goto done;
                }
                Py_DECREF(pos);
            }
        }
    }
done:
    release_buffers(bufs, 2);
    return result;
}

static PyObject *shuffle_apply(PyObject *self, PyObject *args)
{
    PyObject *oo, *wo, *fo;
    Py_ssize_t lo, hi;
    Py_buffer ov, wv, fv;
    if (!PyArg_ParseTuple(args, "OOOnn", &oo, &wo, &fo, &lo, &hi))
        return NULL;
    const buffer_spec bufs[] = {{oo, &ov, 1, 8, "out"}, {wo, &wv, 0, 4, "fy_words"},
                                {fo, &fv, 0, 8, "offsets"}};
    if (get_buffers(bufs, 3) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = wv.len / 4, count = fv.len / 8;
    const uint32_t *w = (const uint32_t *)wv.buf;
    const int64_t *off = (const int64_t *)fv.buf;
    int64_t *out = (int64_t *)ov.buf;
    if (ov.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "apply: out must hold one int64 per word");
        goto done;
    }
    if (check_offsets(off, count, n) < 0 || bucket_range(lo, hi, count - 1) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = lo; b < hi; b++) {
        int64_t *a = out + off[b];
        const uint32_t *wb = w + off[b];
        for (int64_t p = off[b + 1] - off[b] - 1; p >= 1; p--) {
            int64_t j = (int64_t)(((uint64_t)wb[p] * (uint64_t)(p + 1)) >> 32);
            int64_t t = a[p];
            a[p] = a[j];
            a[j] = t;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release_buffers(bufs, 3);
    return result;
}

static PyMethodDef methods[] = {
    {"scatter", shuffle_scatter, METH_VARARGS, "Stable scatter of 0..n-1 into buckets."},
    {"rejects", shuffle_rejects, METH_VARARGS, "Positions whose Fisher-Yates word is rejected."},
    {"apply", shuffle_apply, METH_VARARGS, "Fisher-Yates shuffle of each bucket in a range."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ember.csprng._shuffle",
    "randperm's bucket scatter and per-bucket Fisher-Yates (see ember.csprng.shuffle).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__shuffle(void)
{
    return PyModule_Create(&module);
}
