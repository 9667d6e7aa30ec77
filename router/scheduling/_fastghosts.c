/* The reuse statistics' ghost list in C (router/scheduling/reuse.py: ``PyGhostList`` is the reference, with the
 * same methods, the same order of its ghosts and the same floating-point updates of its decayed counts, so
 * either gives the same P(reuse) to the last bit; tests/test_reuse.py runs both on random operations).
 *
 * Why C: the feed tells the list the key of every block a GPU cache evicts, and the router's lifecycle every
 * key a request asks for. The reference's OrderedDict costs 300-500 ns a key (a node, a hash entry and an int
 * object each), a third of the router's event ingest; here a key costs a probe in a table of inline 64-bit keys.
 *
 * Layout: the ghosts in eviction order are the live entries of a ring of keys (``ring``, ``live``) between
 * ``head`` and ``tail`` (positions that only grow; a position's slot is ``pos & (rcap - 1)``). Re-evicting a
 * ghost (OrderedDict's move_to_end) or asking for one clears its entry's live flag and, for the former, appends
 * it again; the oldest live entry is the first one ``head`` meets. A table of inline keys (linear probing,
 * backward-shift deletion, no tombstones) maps each ghost to its live position. When the ring is full its live
 * entries are copied, in order, to a ring with room for as many again: amortised O(1) a key.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t key;
    uint64_t pos1; /* the key's live ring position + 1; 0 for an empty slot */
} Slot;            /* key and position side by side: a probe touches one cache line */

typedef struct {
    PyObject_HEAD
    Slot *table;
    size_t tcap; /* a power of two, at least twice the ghosts */
    uint64_t *ring;
    unsigned char *live;
    size_t rcap; /* a power of two */
    uint64_t head, tail;
    Py_ssize_t count;
    Py_ssize_t window;
    double decay, reused, expired;
} GhostList;

static inline size_t slot_of(uint64_t key, size_t cap) {
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> 32) & (cap - 1); /* Fibonacci hashing: any key spreads */
}

/* The table slot holding ``key``, or -1. */
static Py_ssize_t find(const GhostList *g, uint64_t key) {
    size_t mask = g->tcap - 1, i = slot_of(key, g->tcap);
    while (g->table[i].pos1) {
        if (g->table[i].key == key)
            return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
    return -1;
}

static void put(Slot *table, size_t cap, uint64_t key, uint64_t pos1) {
    size_t mask = cap - 1, i = slot_of(key, cap);
    while (table[i].pos1)
        i = (i + 1) & mask;
    table[i].key = key;
    table[i].pos1 = pos1;
}

/* Empty slot ``i`` and shift back the entries of its probe run that may move into it (Knuth's algorithm R). */
static void delete_slot(GhostList *g, size_t i) {
    size_t mask = g->tcap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!g->table[j].pos1)
            break;
        size_t home = slot_of(g->table[j].key, g->tcap);
        /* j's entry may fill i when its home is not cyclically within (i, j] */
        if ((i <= j) ? (home <= i || home > j) : (home <= i && home > j)) {
            g->table[i] = g->table[j];
            i = j;
        }
    }
    g->table[i].pos1 = 0;
}

static int grow_table(GhostList *g) {
    size_t cap = g->tcap * 2;
    Slot *table = PyMem_Calloc(cap, sizeof(Slot));
    if (!table) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < g->tcap; i++)
        if (g->table[i].pos1)
            put(table, cap, g->table[i].key, g->table[i].pos1);
    PyMem_Free(g->table);
    g->table = table;
    g->tcap = cap;
    return 0;
}

/* Copy the live entries, in order, to a ring with room for at least as many again; re-point the table. */
static int compact_ring(GhostList *g) {
    size_t cap = g->rcap;
    while ((size_t)g->count * 2 + 2 > cap)
        cap *= 2;
    uint64_t *ring = PyMem_Malloc(cap * sizeof(uint64_t));
    unsigned char *live = PyMem_Malloc(cap);
    if (!ring || !live) {
        PyMem_Free(ring);
        PyMem_Free(live);
        PyErr_NoMemory();
        return -1;
    }
    size_t old_mask = g->rcap - 1, n = 0;
    for (uint64_t p = g->head; p < g->tail; p++) {
        size_t s = (size_t)(p & old_mask);
        if (!g->live[s])
            continue;
        ring[n] = g->ring[s];
        live[n] = 1;
        g->table[find(g, ring[n])].pos1 = n + 1;
        n++;
    }
    PyMem_Free(g->ring);
    PyMem_Free(g->live);
    g->ring = ring;
    g->live = live;
    g->rcap = cap;
    g->head = 0;
    g->tail = n;
    return 0;
}

/* Append ``key`` at the tail; its position, or (uint64_t)-1 with an exception set. */
static uint64_t append(GhostList *g, uint64_t key) {
    if (g->tail - g->head == g->rcap && compact_ring(g) < 0)
        return (uint64_t)-1;
    size_t s = (size_t)(g->tail & (g->rcap - 1));
    g->ring[s] = key;
    g->live[s] = 1;
    return g->tail++;
}

static void pop_oldest(GhostList *g) {
    while (g->head < g->tail) {
        size_t s = (size_t)(g->head++ & (g->rcap - 1));
        if (g->live[s]) {
            g->live[s] = 0;
            delete_slot(g, (size_t)find(g, g->ring[s]));
            g->count--;
            return;
        }
    }
}

static int key_at(PyObject *seq, Py_ssize_t i, uint64_t *key) {
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "block keys are ints, not %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *key = (uint64_t)v;
    return 0;
}

/* evicted(keys): each key becomes the newest ghost (again, if it was one); past the window the oldest ages out. */
static PyObject *evicted(GhostList *g, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key, pos;
        if (key_at(seq, i, &key) < 0)
            goto fail;
        Py_ssize_t slot = find(g, key);
        if (slot >= 0) { /* move_to_end */
            g->live[(g->table[slot].pos1 - 1) & (g->rcap - 1)] = 0;
            if ((pos = append(g, key)) == (uint64_t)-1)
                goto fail;
            g->table[slot].pos1 = pos + 1;
            continue;
        }
        if ((size_t)(g->count + 1) * 2 > g->tcap && grow_table(g) < 0)
            goto fail;
        if ((pos = append(g, key)) == (uint64_t)-1)
            goto fail;
        put(g->table, g->tcap, key, pos + 1);
        g->count++;
        if (g->count > g->window) {
            pop_oldest(g);
            g->expired = g->expired * g->decay + 1.0;
            g->reused *= g->decay;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

/* requested(keys): each key that is a ghost counts a reuse and stops being one. */
static PyObject *requested(GhostList *g, PyObject *keys) {
    if (!g->count)
        Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key;
        if (key_at(seq, i, &key) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        Py_ssize_t slot = find(g, key);
        if (slot < 0)
            continue;
        g->live[(g->table[slot].pos1 - 1) & (g->rcap - 1)] = 0;
        delete_slot(g, (size_t)slot);
        g->count--;
        g->reused = g->reused * g->decay + 1.0;
        g->expired *= g->decay;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static int set_window_to(GhostList *g, Py_ssize_t blocks) {
    g->window = blocks < 1 ? 1 : blocks;
    g->decay = 1.0 - 1.0 / (double)g->window;
    return 0;
}

static PyObject *set_window(GhostList *g, PyObject *arg) {
    Py_ssize_t blocks = PyLong_AsSsize_t(arg);
    if (blocks == -1 && PyErr_Occurred())
        return NULL;
    set_window_to(g, blocks);
    Py_RETURN_NONE;
}

static int init(GhostList *g, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"window_blocks", NULL};
    Py_ssize_t window;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &window))
        return -1;
    PyMem_Free(g->table);
    PyMem_Free(g->ring);
    PyMem_Free(g->live);
    g->tcap = g->rcap = 64;
    g->table = PyMem_Calloc(g->tcap, sizeof(Slot));
    g->ring = PyMem_Malloc(g->rcap * sizeof(uint64_t));
    g->live = PyMem_Calloc(g->rcap, 1);
    if (!g->table || !g->ring || !g->live) {
        PyErr_NoMemory();
        return -1;
    }
    g->head = g->tail = 0;
    g->count = 0;
    g->reused = g->expired = 0.0;
    return set_window_to(g, window);
}

static void dealloc(GhostList *g) {
    PyMem_Free(g->table);
    PyMem_Free(g->ring);
    PyMem_Free(g->live);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static Py_ssize_t length(GhostList *g) { return g->count; }

static PyObject *get_window(GhostList *g, void *closure) { return PyLong_FromSsize_t(g->window); }
static PyObject *get_reused(GhostList *g, void *closure) { return PyFloat_FromDouble(g->reused); }
static PyObject *get_expired(GhostList *g, void *closure) { return PyFloat_FromDouble(g->expired); }

static PyMethodDef methods[] = {
    {"evicted", (PyCFunction)evicted, METH_O, "Each key becomes the newest ghost; past the window the oldest ages out."},
    {"requested", (PyCFunction)requested, METH_O, "Each key that is a ghost counts a reuse and stops being one."},
    {"set_window", (PyCFunction)set_window, METH_O, "The ghosts kept (at least 1) and the counts' decay."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef getset[] = {
    {"window_blocks", (getter)get_window, NULL, "ghosts kept", NULL},
    {"reused", (getter)get_reused, NULL, "decayed count of ghosts asked for again", NULL},
    {"expired", (getter)get_expired, NULL, "decayed count of ghosts that aged out unasked", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods as_sequence = {.sq_length = (lenfunc)length};

static PyTypeObject GhostListType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.scheduling._fastghosts.GhostList",
    .tp_basicsize = sizeof(GhostList),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The keys the fleet's GPU caches evicted lately, oldest first (reuse.py: PyGhostList).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)init,
    .tp_dealloc = (destructor)dealloc,
    .tp_methods = methods,
    .tp_getset = getset,
    .tp_as_sequence = &as_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "router.scheduling._fastghosts", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__fastghosts(void) {
    if (PyType_Ready(&GhostListType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (PyModule_AddObjectRef(m, "GhostList", (PyObject *)&GhostListType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
