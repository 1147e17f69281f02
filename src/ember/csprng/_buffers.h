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

#endif
