/* The boundary between Python and qkv's C kernels: every call's arguments arrive as named
   fields (a dict, or keyword arguments), parsed by name, never by position. A field that is
   missing, unknown or misspelled is a TypeError naming it, so a change on one side that the
   other does not follow fails loudly instead of reading one pointer as another. */
#ifndef QKV_FIELDS_H
#define QKV_FIELDS_H

#include <Python.h>
#include <stdarg.h>
#include <string.h>

/* Parse the dict `fields` by `names` with `format` (keyword-only: it starts with "$"), into
   the pointers that follow; 0 with a Python error set where it does not parse. */
static int parse_fields(PyObject *fields, const char *what, const char *format, char **names, ...) {
    if (!PyDict_Check(fields)) {
        PyErr_Format(PyExc_TypeError, "%s: each call must be a dict of named fields", what);
        return 0;
    }
    PyObject *none = PyTuple_New(0);
    if (!none) return 0;
    va_list va;
    va_start(va, names);
    int ok = PyArg_VaParseTupleAndKeywords(none, fields, format, names, va);
    va_end(va);
    Py_DECREF(none);
    return ok;
}

/* The instruction sets a kernel can be pinned to where the CPU has a wider one too. */
enum { PIN_NONE = 0, PIN_AVX2 = 1, PIN_NEON = 2 };

/* use_isa(name)'s one argument, which every kernel module takes: "avx2" (PIN_AVX2: run the
   AVX2 code where the CPU has AVX-512 too), "neon" (PIN_NEON: the NEON code where it has
   SVE) or "" (PIN_NONE: the CPU's choice); -1 with a Python error set for anything else.
   A pin to the other architecture's set changes nothing (isa() then names another). */
static int pin_named(PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return -1;
    if (!strcmp(name, "")) return PIN_NONE;
    if (!strcmp(name, "avx2")) return PIN_AVX2;
    if (!strcmp(name, "neon")) return PIN_NEON;
    PyErr_Format(PyExc_ValueError, "use_isa: \"avx2\", \"neon\" or \"\" (the CPU's choice), not %R",
                 PyTuple_GET_ITEM(args, 0));
    return -1;
}

/* The name pin_named took for pin. */
static const char *pin_name(int pin) {
    return pin == PIN_AVX2 ? "avx2" : pin == PIN_NEON ? "neon" : "";
}

#endif
