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
 *
 * normal_inputs(words, m, group, bits, angle, r, th, wide)
 *     Box-Muller's inputs for m pairs. words: at least 2m words (the first 2m are read) of 4 bytes (wide = 0, float32 values) or
 *     8 bytes (wide = 1, float64), in groups of `group` pairs (the last group may be smaller): a
 *     group of s pairs holds s radius words, then s angle words. With k = word & (2**bits - 1):
 *     r[j] = (k + 1) * 2**-bits (exact), th[j] = k * angle (one rounding in the value's dtype).
 *     r and th: m values each, disjoint from words.
 *
 * normal_outputs(logr, c, s, m, group, z, wide)
 *     rad = sqrt(-2 * logr[j]); the cosine value c[j] * rad goes to z at the pair's place in the
 *     first half of its group, the sine value s[j] * rad at the same place in the second half.
 *     c and s may be z's own halves (a single group, read before written).
 *
 * Every step of both is one IEEE operation in the value's own dtype, as NumPy's ufuncs do them,
 * so the values equal those of the NumPy formulations bit for bit. That needs floats evaluated in
 * their own precision (FLT_EVAL_METHOD 0, e.g. not x87): elsewhere the two functions are not
 * built and the NumPy formulations run. No step multiplies and adds, so no fused multiply-add
 * can change a rounding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
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
    const buffer_spec bufs[] = {{wo, &wv, 0, 4, "words"}, {oo, &ov, 1, 8, "out"}};
    if (get_buffers(bufs, 2) < 0)
        return NULL;
    Py_ssize_t n = wv.len / 4;
    if (ov.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "words and out must hold the same number of items");
        release_buffers(bufs, 2);
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
    release_buffers(bufs, 2);
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
    const buffer_spec bufs[] = {{wo, &wv, 0, 4, "words"}, {oo, &ov, 1, 4, "out"}};
    if (get_buffers(bufs, 2) < 0)
        return NULL;
    Py_ssize_t n = wv.len / 4;
    if (ov.len / 4 != n) {
        PyErr_SetString(PyExc_ValueError, "words and out must hold the same number of items");
        release_buffers(bufs, 2);
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
    release_buffers(bufs, 2);
    Py_RETURN_NONE;
}

#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
#define EMBER_EXACT_FLOATS 1

static PyObject *transforms_normal_inputs(PyObject *self, PyObject *args)
{
    PyObject *wo, *ro, *to;
    Py_ssize_t m, group;
    int bits, wide;
    double angle;
    Py_buffer wv, rv, tv;
    if (!PyArg_ParseTuple(args, "OnnidOOp", &wo, &m, &group, &bits, &angle, &ro, &to, &wide))
        return NULL;
    Py_ssize_t isz = wide ? 8 : 4;
    if (bits < 1 || bits > (wide ? 53 : 24) || m < 0 || m > PY_SSIZE_T_MAX / (2 * isz)
        || group < 1) {
        PyErr_Format(PyExc_ValueError, "normal_inputs: bad m=%zd, group=%zd or bits=%d",
                     m, group, bits);
        return NULL;
    }
    const buffer_spec bufs[] = {{wo, &wv, 0, isz, "words"}, {ro, &rv, 1, isz, "r"},
                                {to, &tv, 1, isz, "th"}};
    if (get_buffers(bufs, 3) < 0)
        return NULL;
    if (wv.len < 2 * m * isz || rv.len != m * isz || tv.len != m * isz) {
        PyErr_SetString(PyExc_ValueError,
                        "normal_inputs: words must hold at least 2m items, r and th m");
        release_buffers(bufs, 3);
        return NULL;
    }
    const char *w = (const char *)wv.buf;
    char *r = (char *)rv.buf, *th = (char *)tv.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t start = 0; start < m; start += group) {
        /* the group starting at pair `start`: its words from 2 * start, `size` pairs */
        const Py_ssize_t base = 2 * start, size = (m - start) < group ? (m - start) : group;
        if (wide) {
            const uint64_t mask = (1ULL << bits) - 1;
            const double unit = ldexp(1.0, -bits);
            for (Py_ssize_t i = 0; i < size; i++) {
                uint64_t kr, kt;
                memcpy(&kr, w + 8 * (base + i), 8);
                memcpy(&kt, w + 8 * (base + size + i), 8);
                double vr = (double)(int64_t)((kr & mask) + 1) * unit;   /* exact */
                double vt = (double)(int64_t)(kt & mask) * angle;         /* one rounding */
                memcpy(r + 8 * (start + i), &vr, 8);
                memcpy(th + 8 * (start + i), &vt, 8);
            }
        } else {
            const uint32_t mask = (uint32_t)((1UL << bits) - 1);
            const float unit = (float)ldexp(1.0, -bits);
            const float angle_f = (float)angle;
            for (Py_ssize_t i = 0; i < size; i++) {
                uint32_t kr, kt;
                memcpy(&kr, w + 4 * (base + i), 4);
                memcpy(&kt, w + 4 * (base + size + i), 4);
                float vr = (float)(int32_t)((kr & mask) + 1) * unit;
                float vt = (float)(int32_t)(kt & mask) * angle_f;
                memcpy(r + 4 * (start + i), &vr, 4);
                memcpy(th + 4 * (start + i), &vt, 4);
            }
        }
    }
    Py_END_ALLOW_THREADS
    release_buffers(bufs, 3);
    Py_RETURN_NONE;
}

static PyObject *transforms_normal_outputs(PyObject *self, PyObject *args)
{
    PyObject *lo, *co, *so, *zo;
    Py_ssize_t m, group;
    int wide;
    Py_buffer lv, cv, sv, zv;
    if (!PyArg_ParseTuple(args, "OOOnnOp", &lo, &co, &so, &m, &group, &zo, &wide))
        return NULL;
    Py_ssize_t isz = wide ? 8 : 4;
    if (m < 0 || m > PY_SSIZE_T_MAX / (2 * isz) || group < 1) {
        PyErr_Format(PyExc_ValueError, "normal_outputs: bad m=%zd or group=%zd", m, group);
        return NULL;
    }
    const buffer_spec bufs[] = {{lo, &lv, 0, isz, "logr"}, {co, &cv, 0, isz, "c"},
                                {so, &sv, 0, isz, "s"}, {zo, &zv, 1, isz, "z"}};
    if (get_buffers(bufs, 4) < 0)
        return NULL;
    if (lv.len != m * isz || cv.len != m * isz || sv.len != m * isz || zv.len != 2 * m * isz) {
        PyErr_SetString(PyExc_ValueError, "normal_outputs: logr, c and s must hold m items, z 2m");
        release_buffers(bufs, 4);
        return NULL;
    }
    const char *lr = (const char *)lv.buf, *c = (const char *)cv.buf, *s = (const char *)sv.buf;
    char *z = (char *)zv.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t start = 0; start < m; start += group) {
        /* the group starting at pair `start`: its words from 2 * start, `size` pairs */
        const Py_ssize_t base = 2 * start, size = (m - start) < group ? (m - start) : group;
        for (Py_ssize_t i = 0; i < size; i++) {
            Py_ssize_t j = start + i;
            if (wide) {
                double l, cj, sj;
                memcpy(&l, lr + 8 * j, 8);
                memcpy(&cj, c + 8 * j, 8);
                memcpy(&sj, s + 8 * j, 8);
                double t = l * -2.0;
                double rad = sqrt(t);
                double zc = cj * rad, zs = sj * rad;
                memcpy(z + 8 * (base + i), &zc, 8);
                memcpy(z + 8 * (base + size + i), &zs, 8);
            } else {
                float l, cj, sj;
                memcpy(&l, lr + 4 * j, 4);
                memcpy(&cj, c + 4 * j, 4);
                memcpy(&sj, s + 4 * j, 4);
                float t = l * -2.0f;
                float rad = sqrtf(t);
                float zc = cj * rad, zs = sj * rad;
                memcpy(z + 4 * (base + i), &zc, 4);
                memcpy(z + 4 * (base + size + i), &zs, 4);
            }
        }
    }
    Py_END_ALLOW_THREADS
    release_buffers(bufs, 4);
    Py_RETURN_NONE;
}
#endif

static PyMethodDef methods[] = {
    {"bounded32", transforms_bounded32, METH_VARARGS,
     "Uniform integers in [offset, offset + r) from 32-bit words; returns the rejected count."},
    {"unit_float32", transforms_unit_float32, METH_VARARGS,
     "float32 values (word & mask) * scale from 32-bit words."},
#ifdef EMBER_EXACT_FLOATS
    {"normal_inputs", transforms_normal_inputs, METH_VARARGS,
     "Box-Muller's radius and angle inputs from the keystream words of normal pairs."},
    {"normal_outputs", transforms_normal_outputs, METH_VARARGS,
     "Box-Muller's outputs from log radius, cosines and sines, laid out by groups of pairs."},
#endif
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
