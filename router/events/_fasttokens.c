/* A BlockStored's token ids from their msgpack bytes to native uint32s (router/events/codec.py:
 * ``token_ids_of``, whose msgspec decode stays the reference and takes every case this does not).
 *
 * Why C: the router's ingest decodes an event's token ids only to hash them into block keys, and decoding them
 * to a list makes an int object of each, most of the cost of decoding a vLLM batch (a 16-block event carries
 * 256 ids). ``uint32_array`` reads the msgpack array in place into an array('I'), which the index's compiled
 * key paths read as they read the simulated engine's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

_Static_assert(sizeof(unsigned int) == 4, "array('I') holds 4-byte items");

static PyObject *array_type; /* array.array */
static PyObject *typecode;   /* "I" */

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* uint32_array(buffer) -> array('I') | None
 * The msgpack array of ints in ``buffer`` (exactly: nothing after it) when every element is an int in
 * [0, 2**32); None for anything else (another type, a negative or wider id, bytes that are not one array),
 * which the caller decodes with msgspec to raise or keep exactly what a decoded list would. */
static PyObject *uint32_array(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *p = view.buf, *end = p + view.len;
    PyObject *bytes = NULL, *out = NULL;
    uint64_t n;
    if (p == end)
        goto none;
    uint8_t tag = *p++;
    if ((tag & 0xf0) == 0x90)
        n = tag & 0x0f;
    else if (tag == 0xdc && end - p >= 2)
        n = be(p, 2), p += 2;
    else if (tag == 0xdd && end - p >= 4)
        n = be(p, 4), p += 4;
    else
        goto none;
    if (n > (uint64_t)(end - p)) /* each element takes a byte at least */
        goto none;
    bytes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 4));
    if (!bytes)
        goto done;
    uint8_t *o = (uint8_t *)PyBytes_AS_STRING(bytes);
    for (uint64_t i = 0; i < n; i++, o += 4) {
        if (p == end)
            goto none;
        uint8_t b = *p;
        uint32_t t;
        /* the encodings of ids below 2**32 that msgpack writers use, unrolled (vocabularies fit uint16) */
        if (b < 0x80) {
            t = b, p += 1;
        } else if (b == 0xcd && end - p >= 3) {
            t = (uint32_t)p[1] << 8 | p[2], p += 3;
        } else if (b == 0xcc && end - p >= 2) {
            t = p[1], p += 2;
        } else if (b == 0xce && end - p >= 5) {
            t = (uint32_t)p[1] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 8 | p[4], p += 5;
        } else { /* the rest: wider or signed encodings of a uint32 (any writer may use them), or not one */
            int width, is_signed = b >= 0xd0;
            switch (b) {
            case 0xcf: width = 8; break;
            case 0xd0: width = 1; break;
            case 0xd1: width = 2; break;
            case 0xd2: width = 4; break;
            case 0xd3: width = 8; break;
            default: goto none; /* a negative fixint, a truncated id, or not an int */
            }
            if (end - p < 1 + width)
                goto none;
            uint64_t v = be(p + 1, width);
            p += 1 + width;
            if ((is_signed && (v >> (8 * width - 1)) & 1) || v > 0xffffffffULL)
                goto none; /* negative, or wider than a uint32 */
            t = (uint32_t)v;
        }
        memcpy(o, &t, 4);
    }
    if (p != end)
        goto none;
    out = PyObject_CallFunctionObjArgs(array_type, typecode, bytes, NULL);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(bytes);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"uint32_array", uint32_array, METH_O, "A msgpack array of uint32 ints as an array('I'); None otherwise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "router.events._fasttokens", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fasttokens(void) {
    PyObject *array_module = PyImport_ImportModule("array");
    if (!array_module)
        return NULL;
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    typecode = PyUnicode_FromString("I");
    if (!array_type || !typecode)
        return NULL;
    return PyModule_Create(&module);
}
