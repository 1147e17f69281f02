/* ember.csprng._transforms: two word-to-value transforms of the CPU path in one pass each.
 *
 * ember.csprng.transforms holds the NumPy formulation of each function, which is the reference
 * for its values (tests run both on the same words). Both take objects with the buffer protocol,
 * release the GIL while they work (the CPU path runs chunks on two threads) and never allocate.
 *
 * bounded32(words, r, offset, out) -> number of rejected words
 *     words: n uint32 (read only); out: n uint64 (written); 1 <= r <= 2**32; offset < 2**64.
 *     A power-of-two r: out[i] = (words[i] & (r - 1)) + offset, nothing rejected.
 *     Otherwise Lemire's multiply: out[i] = ((words[i] * r) >> 32) + offset (mod 2**64), and
 *     words[i] is rejected when the low 32 bits of words[i] * r are below 2**32 mod r. The caller
 *     finds the rejected positions itself (they are rare) and replaces those values.
 *
 * unit_float32(words, bits, scale, out)
 *     words: n uint32; out: n float32, either the same memory as words or disjoint from it.
 *     out[i] = (float)(words[i] & (2**bits - 1)) * scale, one float32 multiplication
 *     (the integer is below 2**24, so its conversion is exact), as NumPy computes it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_buffers.h"

static PyObject *transforms_bounded32(PyObject *self, PyObject *args)
{
    PyObject *wo, *oo;
    unsigned long long r, offset;
    Py_buffer wv, ov;
    if (!PyArg_ParseTuple(args, "OKKO", &wo, &r, &offset, &oo))
        return NULL;
    if (r < 1 || r > (1ULL << 32)) {
        PyErr_Format(PyExc_ValueError, "r must be in [1, 2**32], got %llu", r);
        return NULL;
    }
    if (get_buffer(wo, &wv, 0, 4, "words") < 0)
        return NULL;
    if (get_buffer(oo, &ov, 1, 8, "out") < 0) {
        PyBuffer_Release(&wv);
        return NULL;
    }
    Py_ssize_t n = wv.len / 4;
    if (ov.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "words and out must hold the same number of items");
        PyBuffer_Release(&wv);
        PyBuffer_Release(&ov);
        return NULL;
    }
    const uint32_t *w = (const uint32_t *)wv.buf;
    uint64_t *x = (uint64_t *)ov.buf;
    const uint64_t add = (uint64_t)offset;
    Py_ssize_t rejected = 0;
    Py_BEGIN_ALLOW_THREADS
    if ((r & (r - 1)) == 0) {
        const uint32_t mask = (uint32_t)(r - 1);  /* r = 2**32 gives all 32 bits */
        for (Py_ssize_t i = 0; i < n; i++)
            x[i] = (uint64_t)(w[i] & mask) + add;
    } else {
        const uint64_t range = (uint64_t)r;
        const uint32_t threshold = (uint32_t)((1ULL << 32) % range);
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t product = (uint64_t)w[i] * range;
            x[i] = (product >> 32) + add;
            rejected += (uint32_t)product < threshold;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&wv);
    PyBuffer_Release(&ov);
    return PyLong_FromSsize_t(rejected);
}

static PyObject *transforms_unit_float32(PyObject *self, PyObject *args)
{
    PyObject *wo, *oo;
    int bits;
    float scale;
    Py_buffer wv, ov;
    if (!PyArg_ParseTuple(args, "OifO", &wo, &bits, &scale, &oo))
        return NULL;
    if (bits < 1 || bits > 24) {
        PyErr_Format(PyExc_ValueError, "bits must be in [1, 24], got %d", bits);
        return NULL;
    }
    if (get_buffer(wo, &wv, 0, 4, "words") < 0)
        return NULL;
    if (get_buffer(oo, &ov, 1, 4, "out") < 0) {
        PyBuffer_Release(&wv);
        return NULL;
    }
    Py_ssize_t n = wv.len / 4;
    if (ov.len / 4 != n) {
        PyErr_SetString(PyExc_ValueError, "words and out must hold the same number of items");
        PyBuffer_Release(&wv);
        PyBuffer_Release(&ov);
        return NULL;
    }
    const char *src = (const char *)wv.buf;
    char *dst = (char *)ov.buf;
    const uint32_t mask = (uint32_t)((1UL << bits) - 1);
    Py_BEGIN_ALLOW_THREADS
    /* memcpy per item: src and dst may be the same memory (read, then write, the same item) */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t k;
        memcpy(&k, src + 4 * i, 4);
        float v = (float)(int32_t)(k & mask);  /* exact: k & mask < 2**24 */
        float f = v * scale;
        memcpy(dst + 4 * i, &f, 4);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&wv);
    PyBuffer_Release(&ov);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bounded32", transforms_bounded32, METH_VARARGS,
     "Uniform integers in [offset, offset + r) from 32-bit words; returns the rejected count."},
    {"unit_float32", transforms_unit_float32, METH_VARARGS,
     "float32 values (word & mask) * scale from 32-bit words."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ember.csprng._transforms",
    "Word-to-value transforms of the CPU path in one pass (see ember.csprng.transforms).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__transforms(void)
{
    return PyModule_Create(&module);
}
