/* XXH3-64 with a seed for 17 to 240 bytes, and the token-list reading the compiled key paths share:
 * router/_fastkeys.c (``chain_keys``), router/index/_fastdicts.c and router/index/_fastcompact.c (each index
 * layout's fused store of an event's chained blocks). Written from the XXH3 specification for the two length classes block keys use, since the
 * ``xxhash`` package exposes no C API; tests/test_keys.py holds it equal to the package over random blocks,
 * seeds and lengths. gcc or clang (it uses their 128-bit multiply). Everything is static: each module that
 * includes it gets its own copy, and no symbol is exported. */
#ifndef KVROUTER_XXH3_H
#define KVROUTER_XXH3_H
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
static inline uint64_t xxh3_mid(const uint8_t *in, size_t len, uint64_t seed) {
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

/* Block ``b`` of a list of token ints as native uint32s into ``out`` (``block_size`` of them, the caller checked
 * the list holds them): 0, or -1 with TypeError (not an int) or OverflowError (outside uint32, as
 * array('I')) set. */
static inline int read_block_tokens(PyObject *tokens, Py_ssize_t b, Py_ssize_t block_size, uint32_t *out) {
    for (Py_ssize_t t = 0; t < block_size; t++) {
        PyObject *item = PyList_GET_ITEM(tokens, b * block_size + t);
        if (!PyLong_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "token ids must be ints");
            return -1;
        }
        unsigned long v = PyLong_AsUnsignedLong(item);
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError, "token id out of the uint32 range");
            return -1;
        }
        out[t] = (uint32_t)v;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (Py_ssize_t t = 0; t < block_size; t++)
        out[t] = __builtin_bswap32(out[t]);
#endif
    return 0;
}

/* The chained keys of ``n`` token blocks (``chain_keys`` without extra keys) from ``key`` (the parent's): the
 * tokens a list of ints (``tokens``) or native uint32s at ``data`` (``tokens`` NULL). A new list of them as ints;
 * NULL with TypeError or OverflowError set for a token that is not a uint32 (or MemoryError). The fused stores
 * compute every key first, so a bad token fails before anything is stored. */
static inline PyObject *chained_block_keys(PyObject *tokens, const uint8_t *data, Py_ssize_t n,
                                           Py_ssize_t block_size, uint64_t key) {
    size_t step = (size_t)block_size * 4;
    PyObject *keys = PyList_New(n);
    if (!keys)
        return NULL;
    uint32_t block[MAX_BLOCK / 4];
    for (Py_ssize_t b = 0; b < n; b++) {
        if (tokens != NULL) {
            if (read_block_tokens(tokens, b, block_size, block) < 0) {
                Py_DECREF(keys);
                return NULL;
            }
            key = xxh3_mid((const uint8_t *)block, step, key);
        } else
            key = xxh3_mid(data + b * step, step, key);
        PyObject *k = PyLong_FromUnsignedLongLong(key);
        if (!k) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, b, k);
    }
    return keys;
}

/* ``tokens`` as a buffer of native uint32s into ``*view`` (the feed's array('I'), the simulated engine's, numpy
 * uint32): 1, the caller then releases it; 0, nothing held, when it is no such buffer (or on a big-endian host,
 * where keys hash little-endian token bytes that chain_keys converts): the caller takes the Python path. */
static inline int open_uint32_tokens(PyObject *tokens, Py_buffer *view) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return 0;
#endif
    if (PyObject_GetBuffer(tokens, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "I") != 0) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

#endif
