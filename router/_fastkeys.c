/* Chained block keys in C: the per-block part of router/keys.py's ``chain_keys``, for the common case (no
 * extra keys, blocks of 17 to 240 bytes: 5 to 60 tokens).
 *
 * Why C: event ingest and every request compute one key per block, each seeded by the one before, so the
 * chain cannot be batched in numpy; in Python each block costs a token conversion and a call into xxhash
 * (about 500 ns a 16-token block on the project's 2-core box), here about 130 ns, most of it reading the token
 * ints. gcc or clang (it uses their 128-bit multiply); elsewhere the build skips it (setup.py: optional).
 * The keys are XXH3-64 with a seed, as the ``xxhash`` package computes them (router/_xxh3.h, shared with the
 * dict index's fused store in router/index/_fastdicts.c).
 * Anything else (other lengths, extra keys) stays on the Python path, which remains the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_xxh3.h"

/* chain(tokens, block_size, parent_key) -> list[int] | None
 * tokens: a list of ints (what the event decoder and the tokenizer give) or a buffer of uint32 (native
 * order, as array('I') and numpy '<u4' on little-endian machines). None: a block size this path does not
 * cover (the caller takes the Python path). OverflowError for a token outside uint32, as array('I'). */
static PyObject *chain(PyObject *self, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t block_size;
    unsigned long long parent;
    if (!PyArg_ParseTuple(args, "OnK", &tokens, &block_size, &parent))
        return NULL;
    if (block_size <= 0)
        return PyErr_Format(PyExc_ValueError, "block_size must be positive");
    size_t step = (size_t)block_size * 4;
    if (step < MIN_BLOCK || step > MAX_BLOCK)
        Py_RETURN_NONE;
    if (PyList_CheckExact(tokens))
        return chained_block_keys(tokens, NULL, PyList_GET_SIZE(tokens) / block_size, block_size, parent);
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = chained_block_keys(NULL, view.buf, view.len / (Py_ssize_t)step, block_size, parent);
    PyBuffer_Release(&view);
    return out;
}

/* xxh3(data, seed) -> int: one XXH3-64 of 17..240 bytes (for the equality tests against the xxhash
 * package); ValueError for other lengths. */
static PyObject *xxh3(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*K", &view, &seed))
        return NULL;
    if (view.len < MIN_BLOCK || view.len > MAX_BLOCK) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "only 17 to 240 bytes");
    }
    uint64_t h = xxh3_mid(view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "Chained XXH3 keys of the full blocks of tokens (None: not this path)."},
    {"xxh3", xxh3, METH_VARARGS, "XXH3-64 of 17 to 240 bytes with a seed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "router._fastkeys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastkeys(void) { return PyModule_Create(&module); }
