/* Shared by ember.csprng's C extensions: a C-contiguous buffer of whole items, or a Python
 * exception naming the argument. Include after Python.h. */
#ifndef EMBER_CSPRNG_BUFFERS_H
#define EMBER_CSPRNG_BUFFERS_H

/* Fills view with obj's buffer (writable if asked); 0 on success, -1 with an exception set (the
 * view released) when obj has no such buffer or its length is not a multiple of itemsize. */
static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize,
                      const char *what)
{
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes is not a whole number of "
                     "%zd-byte items", what, view->len, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* One buffer to get: the object, where its view goes, and get_buffer's other arguments. */
typedef struct {
    PyObject *obj;
    Py_buffer *view;
    int writable;
    Py_ssize_t itemsize;
    const char *what;
} buffer_spec;

/* Gets the n buffers of specs in order; 0 on success, -1 with an exception set and none of them
 * held when one cannot be had. */
static int get_buffers(const buffer_spec *specs, int n)
{
    for (int i = 0; i < n; i++) {
        if (get_buffer(specs[i].obj, specs[i].view, specs[i].writable, specs[i].itemsize,
                       specs[i].what) < 0) {
            while (--i >= 0)
                PyBuffer_Release(specs[i].view);
            return -1;
        }
    }
    return 0;
}

/* Releases the n buffers that get_buffers got. */
static void release_buffers(const buffer_spec *specs, int n)
{
    for (int i = 0; i < n; i++)
        PyBuffer_Release(specs[i].view);
}

#endif
