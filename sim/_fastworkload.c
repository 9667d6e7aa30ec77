/* A trace row's prompt tokens in one pass (sim/workload.py: ``tokens_for_hash_ids``, whose numpy passes stay
 * the reference and the fallback).
 *
 * Why C: the simulator synthesises every Mooncake request's prompt from its hash ids when it arrives (a whole
 * trace of prompts would not fit in memory), about 10K tokens a request; numpy makes six passes over a
 * (blocks, 512) array of 64-bit words for it and that was a tenth of a 108K-request replay. The mixing here is
 * the same splitmix-style arithmetic on unsigned 64-bit words, so every token is the same
 * (tests/test_simulator.py compares the two on rows with and without padding).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define TRACE_BLOCK 512
#define VOCAB 32000u
#define M1 0x9E3779B97F4A7C15ull
#define M2 0xBF58476D1CE4E5B9ull

/* Token ``lane`` of the block ``block_id`` (the two's complement of a negative id, as numpy casts it). */
static inline uint32_t token(uint64_t block_id, uint64_t salt, uint64_t lane) {
    uint64_t seed = (block_id * 2u + (1u + salt * 0x1000003u)) * M1;
    uint64_t x = seed ^ (lane * M2);
    x ^= x >> 31;
    x *= M2;
    x ^= x >> 29;
    return (uint32_t)(x % VOCAB);
}

/* hash_id_tokens(ids, length) -> bytearray
 * ``tokens_for_hash_ids``: ``ids`` a buffer of int64 hash ids; ``length`` uint32 tokens, native order: each id's
 * TRACE_BLOCK tokens in turn, cut to ``length``; past the blocks, the last id's tokens with salt 7; no ids at all,
 * the tokens of block -1. */
static PyObject *hash_id_tokens(PyObject *self, PyObject *args) {
    Py_buffer ids;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "y*n", &ids, &length))
        return NULL;
    if (length < 0 || ids.len % 8 != 0) {
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "int64 ids and a length >= 0");
        return NULL;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, length * 4);
    if (!out) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    uint32_t *tokens = (uint32_t *)PyByteArray_AS_STRING(out);
    const int64_t *id = (const int64_t *)ids.buf;
    Py_ssize_t n_ids = ids.len / 8;
    Py_ssize_t covered = n_ids * TRACE_BLOCK;
    if (n_ids == 0) {
        for (Py_ssize_t i = 0; i < length; i++)
            tokens[i] = token((uint64_t)(int64_t)-1, 0, (uint64_t)i);
    } else {
        Py_ssize_t i = 0;
        for (Py_ssize_t b = 0; b < n_ids && i < length; b++)
            for (Py_ssize_t lane = 0; lane < TRACE_BLOCK && i < length; lane++, i++)
                tokens[i] = token((uint64_t)id[b], 0, (uint64_t)lane);
        for (; i < length; i++)
            tokens[i] = token((uint64_t)id[n_ids - 1], 7, (uint64_t)(i - covered));
    }
    PyBuffer_Release(&ids);
    return out;
}

static PyMethodDef methods[] = {
    {"hash_id_tokens", hash_id_tokens, METH_VARARGS, "tokens_for_hash_ids: a trace row's prompt tokens."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "sim._fastworkload", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastworkload(void) { return PyModule_Create(&module); }
