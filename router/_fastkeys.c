/* Chained block keys in C: the per-block part of router/keys.py's ``chain_keys``, for the common case (no
 * extra keys, blocks of 17 to 240 bytes: 5 to 60 tokens).
 *
 * Why C: event ingest and every request compute one key per block, each seeded by the one before, so the
 * chain cannot be batched in numpy; in Python each block costs a token conversion and a call into xxhash
 * (about 500 ns a 16-token block on the project's 2-core box), here about 130 ns, most of it reading the token
 * ints. gcc or clang (it uses their 128-bit multiply); elsewhere the build skips it (setup.py: optional).
 * The keys are XXH3-64 with a seed, as the ``xxhash`` package computes them (tests/test_keys.py holds the two
 * equal over random blocks, seeds and lengths); written here from the XXH3 specification for the two length
 * classes block keys use, since the package exposes no C API.
 * Anything else (other lengths, extra keys) stays on the Python path, which remains the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* XXH3's default secret: its first 136 bytes, all that inputs of up to 240 bytes read. */
static const uint8_t kSecret[136] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3,
};

#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME_MX1 0x165667919E3779F9ULL
#define MIN_BLOCK 17
#define MAX_BLOCK 240

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t fold64(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *sec, uint64_t seed) {
    return fold64(read64(in) ^ (read64(sec) + seed), read64(in + 8) ^ (read64(sec + 8) - seed));
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PRIME_MX1;
    return h ^ (h >> 32);
}

/* XXH3-64 with a seed, for 17 <= len <= 240 (the caller checks). */
static uint64_t xxh3_mid(const uint8_t *in, size_t len, uint64_t seed) {
    uint64_t acc = len * PRIME64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(in + 48, kSecret + 96, seed);
                    acc += mix16(in + len - 64, kSecret + 112, seed);
                }
                acc += mix16(in + 32, kSecret + 64, seed);
                acc += mix16(in + len - 48, kSecret + 80, seed);
            }
            acc += mix16(in + 16, kSecret + 32, seed);
            acc += mix16(in + len - 32, kSecret + 48, seed);
        }
        acc += mix16(in, kSecret, seed);
        acc += mix16(in + len - 16, kSecret + 16, seed);
        return avalanche(acc);
    }
    size_t rounds = len / 16;
    for (size_t i = 0; i < 8; i++)
        acc += mix16(in + 16 * i, kSecret + 16 * i, seed);
    acc = avalanche(acc);
    for (size_t i = 8; i < rounds; i++)
        acc += mix16(in + 16 * i, kSecret + 16 * (i - 8) + 3, seed);
    acc += mix16(in + len - 16, kSecret + 136 - 17, seed);
    return avalanche(acc);
}

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
    uint32_t block[MAX_BLOCK / 4];
    uint64_t key = parent;
    PyObject *out;
    if (PyList_CheckExact(tokens)) {
        Py_ssize_t n = PyList_GET_SIZE(tokens) / block_size;
        out = PyList_New(n);
        if (!out)
            return NULL;
        for (Py_ssize_t b = 0; b < n; b++) {
            for (Py_ssize_t t = 0; t < block_size; t++) {
                PyObject *item = PyList_GET_ITEM(tokens, b * block_size + t);
                if (!PyLong_Check(item)) {
                    Py_DECREF(out);
                    return PyErr_Format(PyExc_TypeError, "token ids must be ints");
                }
                unsigned long v = PyLong_AsUnsignedLong(item);
                if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
                    Py_DECREF(out);
                    PyErr_Clear();
                    return PyErr_Format(PyExc_OverflowError, "token id out of the uint32 range");
                }
                block[t] = (uint32_t)v;
            }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            for (Py_ssize_t t = 0; t < block_size; t++)
                block[t] = __builtin_bswap32(block[t]);
#endif
            key = xxh3_mid((const uint8_t *)block, step, key);
            PyObject *k = PyLong_FromUnsignedLongLong(key);
            if (!k) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(out, b, k);
        }
        return out;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n = view.len / (Py_ssize_t)step;
    out = PyList_New(n);
    if (out) {
        const uint8_t *data = view.buf;
        for (Py_ssize_t b = 0; b < n; b++) {
            key = xxh3_mid(data + b * step, step, key);
            PyObject *k = PyLong_FromUnsignedLongLong(key);
            if (!k) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, b, k);
        }
    }
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
