/* ember.shards._speedups: the two per-member steps of reading a shard, compiled. Each has a
 * pure-Python twin that is the reference for its behaviour (tests run both on the same input):
 *
 * scan(buf, pos, end, base, with_data, max_count, max_bytes) -> (members, pos)
 *
 * Walks the tar headers of a window buf[pos:end] (any object with the buffer protocol: bytes,
 * a memory map) as long as each one is the plain case: a regular file whose header checksum
 * (unsigned byte sum) and size field are canonical octal numbers, whose data lie inside the
 * window, and with no long-name or PAX record before it. It returns the members it parsed,
 * as (name, data, offset) tuples, or (name, offset, end) tuples when with_data is false (the
 * same tuples as ember.shards.tar._members), and the window offset of the first header it did
 * not parse. It stops before anything else (another member type, a zero block, a checksum or
 * field it cannot read, a member running past the window) and after max_count members or
 * max_bytes of data: the pure-Python parser in tar.py handles that header, with the error
 * reporting and the rare formats, and is the reference for every value returned here.
 *
 * group_samples(members, url, error_type): ember.shards.format._group_samples as an iterator:
 * (name, data, offset) members -> sample dicts, by the WebDataset naming rules of format.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define BLOCK 512

/* Value of a numeric field read the way tar.py reads it, in the one spelling accepted here:
 * optional spaces, octal digits, optional spaces, then NUL bytes or the field's end. Returns -1
 * for anything else (base-256, signs, other characters), which sends the header to Python. */
static long long octal_field(const unsigned char *f, int len, int need_digit)
{
    int i = 0;
    long long value = 0;
    int digits = 0;
    while (i < len && f[i] == ' ')
        i++;
    while (i < len && f[i] >= '0' && f[i] <= '7') {
        value = value * 8 + (f[i] - '0');
        digits++;
        i++;
    }
    while (i < len && f[i] == ' ')
        i++;
    if (i < len && f[i] != 0)
        return -1;
    if (need_digit && digits == 0)
        return -1;
    return value;
}

/* Whether the header's unsigned byte sum, with the checksum field read as spaces, is the
 * stored checksum. */
static int checksum_ok(const unsigned char *h)
{
    long long stored;
    unsigned long sum = 0;
    const unsigned char *chk = h + 148;
    int n = 0;
    int i;
    /* the stored value is the text before the field's first NUL */
    while (n < 8 && chk[n] != 0)
        n++;
    stored = octal_field(chk, n, 1);
    if (stored < 0)
        return 0;
    for (i = 0; i < 148; i++)
        sum += h[i];
    for (i = 156; i < BLOCK; i++)
        sum += h[i];
    sum += 8 * ' ';
    return (long long)sum == stored;
}

static size_t field_length(const unsigned char *f, size_t len)
{
    const unsigned char *nul = memchr(f, 0, len);
    return nul ? (size_t)(nul - f) : len;
}

/* The member name as tar.py builds it: the name field, behind a USTAR prefix if one is set. */
static PyObject *member_name(const unsigned char *h)
{
    char joined[156 + 1 + 100];
    size_t name_len = field_length(h, 100);
    size_t prefix_len;
    if (h[345] == 0 || memcmp(h + 257, "ustar\0", 6) != 0)
        return PyUnicode_DecodeUTF8((const char *)h, (Py_ssize_t)name_len, "surrogateescape");
    prefix_len = field_length(h + 345, 155);
    memcpy(joined, h + 345, prefix_len);
    joined[prefix_len] = '/';
    memcpy(joined + prefix_len + 1, h, name_len);
    return PyUnicode_DecodeUTF8(joined, (Py_ssize_t)(prefix_len + 1 + name_len), "surrogateescape");
}

static PyObject *scan(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t pos, end, max_count, max_bytes;
    long long base;
    int with_data;
    Py_buffer view;
    PyObject *members = NULL;
    PyObject *result = NULL;
    Py_ssize_t taken = 0;

    (void)self;
    if (!PyArg_ParseTuple(args, "OnnLpnn", &obj, &pos, &end, &base, &with_data, &max_count,
                          &max_bytes))
        return NULL;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (pos < 0 || end < pos || end > view.len) {
        PyErr_Format(PyExc_ValueError, "window [%zd, %zd) is outside a buffer of %zd bytes", pos,
                     end, view.len);
        goto done;
    }
    members = PyList_New(0);
    if (members == NULL)
        goto done;
    while (end - pos >= BLOCK && PyList_GET_SIZE(members) < max_count && taken < max_bytes) {
        const unsigned char *h = (const unsigned char *)view.buf + pos;
        unsigned char kind = h[156];
        long long size;
        Py_ssize_t data_at, next;
        PyObject *name, *item;
        if (kind != '0' && kind != 0 && kind != '7')
            break;
        if (!checksum_ok(h))
            break;
        /* (a base-256 size fails octal_field on its first byte) */
        size = octal_field(h + 124, (int)field_length(h + 124, 12), 0);
        if (size < 0 || size > (long long)(end - pos))
            break;
        data_at = pos + BLOCK;
        next = data_at + (Py_ssize_t)((size + 511) & ~511LL);
        if (next > end)
            break;
        name = member_name(h);
        if (name == NULL)
            goto fail;
        if (with_data) {
            PyObject *data = PyBytes_FromStringAndSize((const char *)view.buf + data_at,
                                                       (Py_ssize_t)size);
            if (data == NULL) {
                Py_DECREF(name);
                goto fail;
            }
            item = Py_BuildValue("(NNL)", name, data, base + pos);
        } else {
            item = Py_BuildValue("(NLL)", name, base + pos, base + next);
        }
        if (item == NULL)
            goto fail;
        if (PyList_Append(members, item) < 0) {
            Py_DECREF(item);
            goto fail;
        }
        Py_DECREF(item);
        taken += (Py_ssize_t)size;
        pos = next;
    }
    result = Py_BuildValue("(Nn)", members, pos);
    members = NULL;
    goto done;
fail:
    Py_CLEAR(members);
done:
    PyBuffer_Release(&view);
    return result;
}


/* ---- group_samples ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *members;  /* iterator of (name, data, offset) */
    PyObject *url;
    PyObject *error;    /* the FormatError type */
    PyObject *key;      /* key of the sample being filled, or NULL */
    PyObject *current;  /* the sample being filled (a dict), or NULL */
    PyObject *pending;  /* a member that started a new sample while the last one was returned */
    PyObject *lowered;  /* extension -> lower-case extension */
} Grouper;

static PyObject *str_key, *str_url, *str_lower, *str_dunder;

static void grouper_dealloc(Grouper *g)
{
    Py_XDECREF(g->members);
    Py_XDECREF(g->url);
    Py_XDECREF(g->error);
    Py_XDECREF(g->key);
    Py_XDECREF(g->current);
    Py_XDECREF(g->pending);
    Py_XDECREF(g->lowered);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyObject *grouper_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *members, *url, *error;
    Grouper *g;
    static char *names[] = {"members", "url", "error_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO", names, &members, &url, &error))
        return NULL;
    g = (Grouper *)type->tp_alloc(type, 0);
    if (g == NULL)
        return NULL;
    g->members = PyObject_GetIter(members);
    g->lowered = PyDict_New();
    if (g->members == NULL || g->lowered == NULL) {
        Py_DECREF(g);
        return NULL;
    }
    Py_INCREF(url);
    g->url = url;
    Py_INCREF(error);
    g->error = error;
    return (PyObject *)g;
}

/* Raise error_type(message, url, offset). */
static void format_error(Grouper *g, PyObject *message, PyObject *offset)
{
    PyObject *exc;
    if (message == NULL)
        return;
    exc = PyObject_CallFunctionObjArgs(g->error, message, g->url, offset, NULL);
    Py_DECREF(message);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
}

static PyObject *lower_extension(Grouper *g, PyObject *ext)
{
    PyObject *low = PyDict_GetItemWithError(g->lowered, ext);
    if (low != NULL) {
        Py_INCREF(low);
        return low;
    }
    if (PyErr_Occurred())
        return NULL;
    if (PyDict_GET_SIZE(g->lowered) >= 256)
        PyDict_Clear(g->lowered);
    low = PyObject_CallMethodObjArgs(ext, str_lower, NULL);
    if (low != NULL && PyDict_SetItem(g->lowered, ext, low) < 0)
        Py_CLEAR(low);
    return low;
}

/* format.is_metadata: a name without '/' that starts and ends with "__", or one whose first
 * path part is "__x__" (at least four characters). */
static int is_metadata(PyObject *name, Py_ssize_t len)
{
    Py_ssize_t first = PyUnicode_FindChar(name, '/', 0, len, 1);
    Py_ssize_t end = first < 0 ? len : first;
    if (first == -2) {
        PyErr_Clear();
        return 0;
    }
    if (len < 2 || PyUnicode_READ_CHAR(name, 1) != '_')
        return 0;
    if (first >= 0 && end < 4)
        return 0;
    return PyUnicode_READ_CHAR(name, end - 1) == '_' && PyUnicode_READ_CHAR(name, end - 2) == '_';
}

/* Whether a key has a ".." path part (found by searching for dots: most keys have none). */
static int has_dotdot_part(PyObject *key)
{
    Py_ssize_t len = PyUnicode_GET_LENGTH(key);
    Py_ssize_t i = PyUnicode_FindChar(key, '.', 0, len, 1);
    while (i >= 0 && i + 1 < len) {
        if (PyUnicode_READ_CHAR(key, i + 1) == '.' &&
            (i == 0 || PyUnicode_READ_CHAR(key, i - 1) == '/') &&
            (i + 2 == len || PyUnicode_READ_CHAR(key, i + 2) == '/'))
            return 1;
        i = PyUnicode_FindChar(key, '.', i + 1, len, 1);
    }
    if (i == -2)
        PyErr_Clear();
    return 0;
}

/* Put a member into the sample being filled; a member with a new key first moves the filled
 * sample to *done (it is returned before this member is taken in). Returns -1 on error. */
static int add_member(Grouper *g, PyObject *item, PyObject **done)
{
    PyObject *name, *data, *offset, *key, *ext, *low;
    Py_ssize_t len, slash, dot;
    int r;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_SetString(PyExc_TypeError, "group_samples expects (name, data, offset) members");
        return -1;
    }
    name = PyTuple_GET_ITEM(item, 0);
    data = PyTuple_GET_ITEM(item, 1);
    offset = PyTuple_GET_ITEM(item, 2);
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "group_samples expects member names to be str");
        return -1;
    }
    len = PyUnicode_GET_LENGTH(name);
    slash = PyUnicode_FindChar(name, '/', 0, len, -1);
    if (slash == -2)
        return -1;
    slash += 1;
    dot = PyUnicode_FindChar(name, '.', slash, len, 1);
    if (dot == -2)
        return -1;
    if (dot <= slash)
        return 0; /* no extension, or a hidden basename: not a sample member */
    if (PyUnicode_READ_CHAR(name, 0) == '_' && is_metadata(name, len))
        return 0; /* webdataset's metadata pattern: __meta__, __meta__/x.json */
    key = PyUnicode_Substring(name, 0, dot);
    if (key == NULL)
        return -1;
    r = g->key == NULL ? 0 : PyUnicode_Compare(key, g->key);
    if (r == -1 && PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    if (g->key == NULL || r != 0) {
        if (g->current != NULL) {
            /* return the filled sample first; this member is taken in on the next call */
            *done = g->current;
            g->current = NULL;
            Py_DECREF(key);
            Py_INCREF(item);
            g->pending = item;
            return 0;
        }
        if (PyUnicode_READ_CHAR(name, 0) == '/' || has_dotdot_part(key)) {
            /* a key holds its unsafe part: only the first member of a sample needs the check */
            Py_DECREF(key);
            format_error(g, PyUnicode_FromFormat("member name %R is unsafe (%s)", name,
                                                 PyUnicode_READ_CHAR(name, 0) == '/'
                                                     ? "an absolute path" : "a '..' part"),
                         offset);
            return -1;
        }
        g->current = PyDict_New();
        if (g->current == NULL || PyDict_SetItem(g->current, str_key, key) < 0 ||
            PyDict_SetItem(g->current, str_url, g->url) < 0) {
            Py_DECREF(key);
            return -1;
        }
        Py_XDECREF(g->key);
        g->key = key;
    } else {
        Py_DECREF(key);
    }
    ext = PyUnicode_Substring(name, dot + 1, len);
    if (ext == NULL)
        return -1;
    low = lower_extension(g, ext);
    Py_DECREF(ext);
    if (low == NULL)
        return -1;
    r = PyDict_Contains(g->current, low);
    if (r != 0) {
        if (r > 0) {
            if (PyUnicode_Compare(low, str_key) == 0 || PyUnicode_Compare(low, str_url) == 0)
                format_error(g, PyUnicode_FromFormat("member %R uses the reserved extension %R",
                                                     name, low), offset);
            else
                format_error(g, PyUnicode_FromFormat("duplicate file name %R in sample %R",
                                                     name, g->key), offset);
        }
        Py_DECREF(low);
        return -1;
    }
    r = PyDict_SetItem(g->current, low, data);
    Py_DECREF(low);
    return r;
}

/* After an error the iterator is finished, as a generator is once it has raised. */
static PyObject *grouper_fail(Grouper *g)
{
    Py_CLEAR(g->members);
    Py_CLEAR(g->current);
    Py_CLEAR(g->pending);
    return NULL;
}

static PyObject *grouper_next(Grouper *g)
{
    PyObject *done = NULL;
    if (g->pending != NULL) {
        PyObject *item = g->pending;
        int r;
        g->pending = NULL;
        r = add_member(g, item, &done);
        Py_DECREF(item);
        if (r < 0)
            return grouper_fail(g);
    }
    while (g->members != NULL) {
        PyObject *item = PyIter_Next(g->members);
        int r;
        if (item == NULL) {
            if (PyErr_Occurred())
                return grouper_fail(g); /* the sample being filled may be incomplete */
            Py_CLEAR(g->members);
            break;
        }
        r = add_member(g, item, &done);
        Py_DECREF(item);
        if (r < 0)
            return grouper_fail(g);
        if (done != NULL)
            return done;
    }
    /* the members ended normally: the last sample is complete */
    done = g->current;
    g->current = NULL;
    return done;
}

static PyTypeObject GrouperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ember.shards._speedups.group_samples",
    .tp_basicsize = sizeof(Grouper),
    .tp_dealloc = (destructor)grouper_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "group_samples(members, url, error_type): (name, data, offset) members -> sample "
              "dicts, as ember.shards.format._group_samples.",
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)grouper_next,
    .tp_new = grouper_new,
};

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(buf, pos, end, base, with_data, max_count, max_bytes) -> (members, pos): parse the "
     "plain regular-file headers of buf[pos:end] (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups",
    "The per-member steps of reading a shard, compiled (see ember.shards.tar and .format).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__speedups(void)
{
    PyObject *m;
    str_key = PyUnicode_InternFromString("__key__");
    str_url = PyUnicode_InternFromString("__url__");
    str_lower = PyUnicode_InternFromString("lower");
    str_dunder = PyUnicode_InternFromString("__");
    if (str_key == NULL || str_url == NULL || str_lower == NULL || str_dunder == NULL)
        return NULL;
    if (PyType_Ready(&GrouperType) < 0)
        return NULL;
    m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&GrouperType);
    if (PyModule_AddObject(m, "group_samples", (PyObject *)&GrouperType) < 0) {
        Py_DECREF(&GrouperType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
