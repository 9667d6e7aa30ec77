/* The compact index's store and remove loops in C (router/index/compact.py: ``CompactKvIndex.store`` and
 * ``remove``), for the common blocks only: storing an int64 engine hash new to the worker's list, whose key (a
 * uint64) no entry holds yet on that medium; removing one whose key its entry alone holds. Each loop stops at
 * the first block that needs more (a hash stored again, a key others hold or a shared row, a hash or key of
 * another kind) and hands it back to the Python loop, which stays the reference for every case. Also: a
 * BlockStored's parent, keys and store in one call (``store_chain``), and the tables' deletions, which leave no
 * tombstones (``vacate``, as ``_Table.vacate``).
 *
 * Why C: the layout's point is memory (no Python object per block), so its per-block work is probing two
 * open-addressing tables held in numpy arrays; the interpreter spends about 2 us a block on it, which made
 * this layout's ingest a third of the dict layout's. The tables, rows and counters are exactly what the Python
 * loop leaves (tests/test_index.py and tests/test_index_compact.py run both against the brute-force model).
 * The arrays are the index's own (``_Table.slots``, the entry rows, the shared keys); ``CompactKvIndex.store``
 * reserves room for every block first, and a removal only empties rows and slots, so nothing here grows. Their
 * buffers stay open between calls (``cached_tables``) for as long as the index keeps the same arrays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_xxh3.h"

#define EMPTY (-1)
#define NO_LIST (-1)
#define M32 0xFFFFFFFFULL
#define MULT32 0x9E3779B1ULL
#define LIST_MULT 0x632BE59BD9B4E019ULL /* ``_LIST_MULT``: spreads the list id over the engine hash */

/* ``_home``: the two halves folded, then Fibonacci hashing in 32 bits, scaled to ``homes`` slots. */
static inline Py_ssize_t home(int64_t x, Py_ssize_t homes) {
    uint64_t folded = ((uint64_t)x ^ (uint64_t)(x >> 32)) & M32;
    return (Py_ssize_t)((((folded * MULT32) & M32) * (uint64_t)homes) >> 32);
}

typedef struct {
    Py_buffer view;
    Py_ssize_t len;
    int itemsize;
} Column;

static int open_column(PyObject *array, Column *c, int itemsize_a, int itemsize_b) {
    if (PyObject_GetBuffer(array, &c->view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    c->itemsize = (int)c->view.itemsize;
    if (c->itemsize != itemsize_a && c->itemsize != itemsize_b) {
        PyBuffer_Release(&c->view);
        c->view.obj = NULL;
        PyErr_SetString(PyExc_TypeError, "unexpected column width");
        return -1;
    }
    c->len = c->view.len / c->itemsize;
    return 0;
}

static inline int64_t get(const Column *c, Py_ssize_t i) {
    switch (c->itemsize) {
    case 2: return ((int16_t *)c->view.buf)[i];
    case 4: return ((int32_t *)c->view.buf)[i];
    default: return ((int64_t *)c->view.buf)[i];
    }
}

static inline void put(Column *c, Py_ssize_t i, int64_t v) {
    switch (c->itemsize) {
    case 2: ((int16_t *)c->view.buf)[i] = (int16_t)v; break;
    case 4: ((int32_t *)c->view.buf)[i] = (int32_t)v; break;
    default: ((int64_t *)c->view.buf)[i] = v; break;
    }
}

/* The index's arrays one call works on: the engine-hash table and the medium's key table (``_Table.slots``),
 * the entry rows (hash, key, list, count) and the medium's shared keys; with the tables' homes, the list's
 * probe spread and the list id. */
typedef struct {
    Column et, kt, mh, mk, ml, mc, sk;
    int opened;
    Py_ssize_t ehome, khome;
    int64_t spread, lst;
} Tables;

static void close_tables(Tables *t) {
    Column *cols[7] = {&t->et, &t->kt, &t->mh, &t->mk, &t->ml, &t->mc, &t->sk};
    for (int j = 0; j < t->opened; j++)
        PyBuffer_Release(&cols[j]->view);
    t->opened = 0;
}

static int open_tables(PyObject *const arrays[7], Tables *t) {
    static const int widths[7][2] = {{4, 4}, {4, 4}, {8, 8}, {8, 8}, {2, 4}, {2, 4}, {8, 8}};
    Column *cols[7] = {&t->et, &t->kt, &t->mh, &t->mk, &t->ml, &t->mc, &t->sk};
    for (t->opened = 0; t->opened < 7; t->opened++)
        if (open_column(arrays[t->opened], cols[t->opened], widths[t->opened][0], widths[t->opened][1]) < 0) {
            close_tables(t);
            return -1;
        }
    return 0;
}

/* The buffers of the last few sets of arrays the loops worked on, kept open: acquiring seven buffers costs more
 * than a one-block event's own work. An entry is reused only for the very same array objects (each open buffer
 * holds a reference to its array, so an address cannot be reused while cached); arrays the index replaced
 * (they grew, were compacted or widened, a table was rebuilt) miss, and their entry is the least recently used
 * one replaced next. ``forget()`` releases every entry (the index calls it when it replaces arrays, so that the
 * old ones are freed at once). One set per medium and a spare. */
#define CACHED 4
typedef struct {
    PyObject *arrays[7]; /* borrowed: each one's buffer holds a reference */
    Tables tables;
    unsigned long used_at;
} CachedTables;
static CachedTables cache[CACHED];
static unsigned long ticks;

static void forget_entry(CachedTables *c) {
    close_tables(&c->tables);
    memset(c->arrays, 0, sizeof c->arrays);
}

/* The open tables of ``arrays`` (a cached entry, or newly opened into the least recently used one); NULL with an
 * exception set when a buffer cannot be acquired. The caller sets the per-call fields (homes, spread, list). */
static Tables *cached_tables(PyObject *const arrays[7]) {
    CachedTables *victim = &cache[0];
    for (int i = 0; i < CACHED; i++) {
        CachedTables *c = &cache[i];
        if (c->tables.opened == 7 && memcmp(c->arrays, arrays, sizeof c->arrays) == 0) {
            c->used_at = ++ticks;
            return &c->tables;
        }
        if (c->used_at < victim->used_at)
            victim = c;
    }
    forget_entry(victim);
    if (open_tables(arrays, &victim->tables) < 0)
        return NULL;
    memcpy(victim->arrays, arrays, sizeof victim->arrays);
    victim->used_at = ++ticks;
    return &victim->tables;
}

/* ``*t``: the cached open tables of ``arrays`` with this call's homes (already in ``*t``), spread and list (a copy
 * of the cached entry: the cache keeps the buffers); 0 with an exception set on failure. */
static int set_tables(Tables *t, PyObject *const arrays[7], long long spread, long long lst) {
    Py_ssize_t ehome = t->ehome, khome = t->khome;
    Tables *open = cached_tables(arrays);
    if (open == NULL)
        return 0;
    *t = *open;
    t->ehome = ehome;
    t->khome = khome;
    t->spread = spread;
    t->lst = lst;
    return 1;
}

static PyObject *forget(PyObject *self, PyObject *unused) {
    for (int i = 0; i < CACHED; i++)
        forget_entry(&cache[i]);
    Py_RETURN_NONE;
}

/* An engine hash as the int64 the index keeps it as; 0 when it is of another kind or outside int64 (the Python
 * loop maps it, marking the worker unsigned for a uint64 above 2^63). */
static int plain_hash(PyObject *h, int64_t *v) {
    if (!PyLong_CheckExact(h))
        return 0;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(h, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *v = x;
    return 1;
}

/* ``_efind`` of hash ``v`` in the list: the entry row holding it, or EMPTY (``*pos``: that slot, or the first
 * empty one, where a new entry goes). */
static int64_t find_entry(const Tables *t, int64_t v, Py_ssize_t *pos) {
    Py_ssize_t p = home(v ^ t->spread, t->ehome);
    for (;;) {
        int64_t r = get(&t->et, p);
        if (r == EMPTY || (r >= 0 && get(&t->mh, r) == v && get(&t->ml, r) == t->lst)) {
            *pos = p;
            return r;
        }
        if (++p == t->et.len)
            p = 0;
    }
}

/* ``_kfind`` of key ``k``: the entry row holding it alone, -3 - its shared row, or EMPTY (``*pos``: that slot,
 * or the first empty one). */
static int64_t find_key(const Tables *t, int64_t k, Py_ssize_t *pos) {
    Py_ssize_t p = home(k, t->khome);
    for (;;) {
        int64_t val = get(&t->kt, p);
        if (val == EMPTY || (val >= 0 && get(&t->mk, val) == k) || (val <= -3 && get(&t->sk, -3 - val) == k)) {
            *pos = p;
            return val;
        }
        if (++p == t->kt.len)
            p = 0;
    }
}

/* The home of entry row ``r`` in the hash table (``_entry_home``: its list's spread over its engine hash). */
static inline Py_ssize_t entry_home(const Tables *t, int64_t r) {
    return home(get(&t->mh, r) ^ (int64_t)((uint64_t)get(&t->ml, r) * LIST_MULT), t->ehome);
}

/* The home of a key-table value (``_key_homes``): an entry row's key's, or a shared row's. */
static inline Py_ssize_t key_home(const Tables *t, int64_t val) {
    return home(val >= 0 ? get(&t->mk, val) : get(&t->sk, -3 - val), t->khome);
}

/* ``_Table.vacate`` of slot ``pos`` of the hash table (``keys`` 0) or the key table (1): emptied without a
 * tombstone, each later entry of its run moved back into the hole unless its home lies cyclically after it. */
static void vacate(const Tables *t, int keys, Py_ssize_t pos) {
    const Column *c = keys ? &t->kt : &t->et;
    Py_ssize_t size = c->len, hole = pos, j = pos;
    for (;;) {
        if (++j == size)
            j = 0;
        int64_t val = get(c, j);
        if (val == EMPTY)
            break;
        Py_ssize_t h = keys ? key_home(t, val) : entry_home(t, val);
        if ((j - h + size) % size >= (j - hole + size) % size) { /* its home is at or before the hole */
            put((Column *)c, hole, val);
            hole = j;
        }
    }
    put((Column *)c, hole, EMPTY);
}

/* The store loop of ``store_plain`` and ``store_chain``: from block ``i`` of ``hashes`` and ``keys`` (fast
 * sequences of ``n``), each block a new entry row (``*row`` on) in both tables. Returns the first block it did
 * not take (``n``: all), or -2 with an exception set. */
static Py_ssize_t store_entries(Tables *t, PyObject *hashes, PyObject *keys, Py_ssize_t i, Py_ssize_t n,
                                Py_ssize_t *row, Py_ssize_t *added, int *wide) {
    for (; i < n; i++) {
        int64_t v;
        if (!plain_hash(PySequence_Fast_GET_ITEM(hashes, i), &v))
            break;
        PyObject *k_obj = PySequence_Fast_GET_ITEM(keys, i);
        if (!PyLong_CheckExact(k_obj))
            break; /* (the first call checked every key: only a caller that changed them gets here) */
        unsigned long long ku = PyLong_AsUnsignedLongLong(k_obj);
        if (ku == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            break;
        }
        int64_t k = (int64_t)ku;
        Py_ssize_t pos, kpos;
        if (find_entry(t, v, &pos) != EMPTY)
            break; /* stored again: the Python loop counts the copy */
        if (find_key(t, k, &kpos) != EMPTY)
            break; /* others hold it: the Python loop makes or extends its shared row */
        if (*row >= t->mh.len) {
            PyErr_SetString(PyExc_RuntimeError, "no room reserved for the entry rows");
            return -2;
        }
        put(&t->mh, *row, v);
        put(&t->mk, *row, k);
        put(&t->ml, *row, t->lst);
        put(&t->mc, *row, 1);
        put(&t->et, pos, *row);
        put(&t->kt, kpos, *row);
        ++*row;
        ++*added;
        if (ku >> 63)
            *wide = 1;
    }
    return i;
}

/* store_plain(etab, ktab, e_hash, e_key, e_list, e_count, s_key, ehome, khome, spread, lst, hashes, keys,
 *             start, row) -> (stop, row, added, wide_keys)
 * From block ``start``: each block a new entry row (``row`` on), in the hash table and the medium's key table
 * at the empty slot its probe reaches (each table's use grows by ``added``).
 * ``stop``: the first block it did not take (len(hashes) if it took them all; -1, having taken none, when a key
 * is not a uint64); ``wide_keys``: a key above 2^63 was seen (the index then gives keys back unsigned). */
static PyObject *store_plain(PyObject *self, PyObject *args) {
    PyObject *arrays[7], *hashes_in, *keys_in;
    Tables t;
    Py_ssize_t start, row;
    long long spread, lst;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnLLOOnn", &arrays[0], &arrays[1], &arrays[2], &arrays[3], &arrays[4],
                          &arrays[5], &arrays[6], &t.ehome, &t.khome, &spread, &lst, &hashes_in, &keys_in, &start,
                          &row))
        return NULL;
    PyObject *hashes = NULL, *keys = NULL, *result = NULL;
    hashes = PySequence_Fast(hashes_in, "engine hashes must be a sequence"); /* (before the tables: it may run */
    if (!hashes)                                                              /* code that uses them too) */
        goto done;
    keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys)
        goto done;
    if (!set_tables(&t, arrays, spread, lst))
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    if (PySequence_Fast_GET_SIZE(keys) != n) {
        PyErr_SetString(PyExc_ValueError, "as many keys as engine hashes");
        goto done;
    }
    /* a key that is not a uint64: the Python loop takes the whole event, so that it fails before storing any of
     * it (checked on the event's first call; the later ones continue the same event) */
    for (Py_ssize_t j = start ? n : 0; j < n; j++) {
        PyObject *k_obj = PySequence_Fast_GET_ITEM(keys, j);
        if (!PyLong_CheckExact(k_obj) || (PyLong_AsUnsignedLongLong(k_obj) == (unsigned long long)-1 &&
                                          PyErr_Occurred())) {
            PyErr_Clear();
            result = Py_BuildValue("nnni", (Py_ssize_t)-1, row, (Py_ssize_t)0, 0);
            goto done;
        }
    }
    Py_ssize_t added = 0;
    int wide = 0;
    Py_ssize_t i = store_entries(&t, hashes, keys, start, n, &row, &added, &wide);
    if (i == -2)
        goto done;
    result = Py_BuildValue("nnni", i, row, added, wide);
done:
    Py_XDECREF(hashes);
    Py_XDECREF(keys);
    return result;
}

/* remove_plain(etab, ktab, e_hash, e_key, e_list, e_count, s_key, ehome, khome, spread, lst, hashes, start,
 *              originals) -> (stop, unknown, dropped)
 * From block ``start``: a hash the list does not hold counts as unknown; one stored more than once loses a
 * copy; one whose key this entry alone holds (no shared row) leaves its row a hole and both table slots empty.
 * ``stop``: the first block it did not take (a hash of another kind, a key in a shared row, or any removal
 * while ``originals`` is set: non-int hashes are counted in a dict). */
static PyObject *remove_plain(PyObject *self, PyObject *args) {
    PyObject *arrays[7], *hashes_in;
    Tables t;
    Py_ssize_t start;
    long long spread, lst;
    int originals;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnLLOnp", &arrays[0], &arrays[1], &arrays[2], &arrays[3], &arrays[4],
                          &arrays[5], &arrays[6], &t.ehome, &t.khome, &spread, &lst, &hashes_in, &start,
                          &originals))
        return NULL;
    PyObject *result = NULL, *hashes = PySequence_Fast(hashes_in, "engine hashes must be a sequence");
    if (!hashes || !set_tables(&t, arrays, spread, lst))
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes), i = start, unknown = 0, dropped = 0;
    for (; i < n; i++) {
        int64_t v;
        if (!plain_hash(PySequence_Fast_GET_ITEM(hashes, i), &v))
            break;
        Py_ssize_t pos, kpos;
        int64_t r = find_entry(&t, v, &pos);
        if (r < 0) {
            unknown++;
            continue;
        }
        int64_t count = get(&t.mc, r);
        if (count > 1) {
            put(&t.mc, r, count - 1);
            continue;
        }
        if (find_key(&t, get(&t.mk, r), &kpos) < 0 || originals)
            break; /* a shared row (or a non-int hash's count): the Python loop */
        vacate(&t, 0, pos); /* (before the row's list is cleared: the moved entries' homes are read from theirs) */
        vacate(&t, 1, kpos);
        put(&t.ml, r, NO_LIST);
        dropped++;
    }
    result = Py_BuildValue("nnn", i, unknown, dropped);
done:
    Py_XDECREF(hashes);
    return result;
}

/* The latest entry row holding hash ``v`` in any of the lists ``ids`` (a worker's, one per medium), -1 if none:
 * ``key_of``'s row. */
static int64_t latest_row(const Tables *t, const long long *ids, Py_ssize_t n_lists, int64_t v) {
    Tables one = *t;
    int64_t best = -1;
    for (Py_ssize_t j = 0; j < n_lists; j++) {
        one.lst = ids[j];
        one.spread = (int64_t)((uint64_t)ids[j] * LIST_MULT); /* ``_wrap64(lst * _LIST_MULT)`` */
        Py_ssize_t pos;
        int64_t r = find_entry(&one, v, &pos);
        if (r > best)
            best = r;
    }
    return best;
}

/* The lists of ``lst``'s worker (one per medium) that hold entries, by ``list_len`` (the index's entries per list),
 * into ``ids``: their count, or -1 with an exception set. */
static Py_ssize_t held_lists(PyObject *list_len, long long lst, long long *ids) {
    Py_ssize_t n_lists = 0;
    for (long long j = lst - lst % 3; j < lst - lst % 3 + 3; j++) {
        if (j < 0 || j >= PyList_GET_SIZE(list_len)) {
            PyErr_Format(PyExc_ValueError, "list %lld outside list_len", j);
            return -1;
        }
        int held = PyObject_IsTrue(PyList_GET_ITEM(list_len, j));
        if (held < 0)
            return -1;
        if (held)
            ids[n_lists++] = j;
    }
    return n_lists;
}

/* latest_keys(etab, ktab, e_hash, e_key, e_list, e_count, s_key, ehome, khome, spread, lst, list_len, values,
 *             unsigned)
 *   -> list[int] | None
 * ``key_of`` of each of ``values`` (engine hashes as kept: int64s): the key of the latest entry row holding it in
 * any of the lists of ``lst``'s worker that hold entries (``list_len``: the index's entries per list), the values
 * no list holds left out; keys given back unsigned when ``unsigned`` (as ``_out_key``). ``spread`` is ignored
 * (each list's own is used). None: a value that is not an int64 (the caller maps the hashes first). */
static PyObject *latest_keys(PyObject *self, PyObject *args) {
    PyObject *arrays[7], *list_len, *values_in;
    Tables t;
    long long spread, lst;
    int unsigned_keys;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnLLO!Op", &arrays[0], &arrays[1], &arrays[2], &arrays[3], &arrays[4],
                          &arrays[5], &arrays[6], &t.ehome, &t.khome, &spread, &lst, &PyList_Type, &list_len,
                          &values_in, &unsigned_keys))
        return NULL;
    long long ids[3];
    Py_ssize_t n_lists = held_lists(list_len, lst, ids);
    if (n_lists < 0)
        return NULL;
    PyObject *values = PySequence_Fast(values_in, "values must be a sequence");
    if (!values)
        return NULL;
    PyObject *out = NULL;
    if (!set_tables(&t, arrays, spread, lst))
        goto done;
    out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < PySequence_Fast_GET_SIZE(values); i++) {
        int64_t v;
        if (!plain_hash(PySequence_Fast_GET_ITEM(values, i), &v)) {
            Py_DECREF(out);
            out = Py_NewRef(Py_None);
            break;
        }
        int64_t best = latest_row(&t, ids, n_lists, v);
        if (best < 0)
            continue;
        int64_t key = get(&t.mk, best);
        PyObject *k = unsigned_keys ? PyLong_FromUnsignedLongLong((uint64_t)key) : PyLong_FromLongLong(key);
        if (k == NULL || PyList_Append(out, k) < 0)
            Py_CLEAR(out);
        Py_XDECREF(k);
    }
done:
    Py_DECREF(values);
    return out;
}

/* compact_rows(e_hash, e_key, e_list, e_count, rows, tables) -> live
 * ``CompactKvIndex._compact`` in place, at the same size (its numpy code stays the reference and leaves the same
 * arrays): the live rows (``e_list >= 0``) of the first ``rows`` moved down in order, the rows after them
 * cleared (0; NO_LIST), and every slot of ``tables`` (int32 arrays) that holds a row pointed at its new place.
 *
 * Why C: under steady eviction the rows fill with holes and are compacted every few hundred events; numpy's
 * gathers and remaps over every row and slot cost about a third of the layout's ingest. */
static PyObject *compact_rows(PyObject *self, PyObject *args) {
    PyObject *arrays[4], *tables;
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "OOOOnO", &arrays[0], &arrays[1], &arrays[2], &arrays[3], &rows, &tables))
        return NULL;
    Column c[4] = {{{0}}};
    static const int widths[4][2] = {{8, 8}, {8, 8}, {2, 4}, {2, 4}};
    PyObject *result = NULL, *seq = NULL;
    int32_t *remap = NULL;
    int opened = 0;
    for (; opened < 4; opened++)
        if (open_column(arrays[opened], &c[opened], widths[opened][0], widths[opened][1]) < 0)
            goto done;
    if (rows < 0 || rows > c[0].len || rows > c[1].len || rows > c[2].len || rows > c[3].len || rows > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "rows beyond the columns");
        goto done;
    }
    remap = PyMem_Malloc(sizeof(int32_t) * (size_t)(rows ? rows : 1));
    if (!remap) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t live = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (get(&c[2], r) < 0) {
            remap[r] = EMPTY;
            continue;
        }
        remap[r] = (int32_t)live;
        if (live != r)
            for (int k = 0; k < 4; k++)
                put(&c[k], live, get(&c[k], r));
        live++;
    }
    for (Py_ssize_t r = live; r < rows; r++) {
        put(&c[0], r, 0);
        put(&c[1], r, 0);
        put(&c[2], r, NO_LIST);
        put(&c[3], r, 0);
    }
    seq = PySequence_Fast(tables, "tables must be a sequence");
    if (!seq)
        goto done;
    for (Py_ssize_t t = 0; t < PySequence_Fast_GET_SIZE(seq); t++) {
        Column slots;
        if (open_column(PySequence_Fast_GET_ITEM(seq, t), &slots, 4, 4) < 0)
            goto done;
        int32_t *v = slots.view.buf;
        for (Py_ssize_t i = 0; i < slots.len; i++)
            if (v[i] >= 0)
                v[i] = v[i] < rows ? remap[v[i]] : EMPTY;
        PyBuffer_Release(&slots.view);
    }
    result = PyLong_FromSsize_t(live);
done:
    for (int k = 0; k < opened; k++)
        PyBuffer_Release(&c[k].view);
    PyMem_Free(remap);
    Py_XDECREF(seq);
    return result;
}

/* One stable counting pass of a radix sort: ``out`` the rows of ``in`` (all rows, in order, if NULL) ordered by
 * the 16-bit digit of their homes at ``shift``, rows of equal digits in their ``in`` order; ``buckets`` bounds
 * the digits (``count`` holds buckets + 1). */
static void radix_pass(const uint32_t *homes, const uint32_t *in, uint32_t *out, Py_ssize_t n, int shift,
                       Py_ssize_t buckets, Py_ssize_t *count) {
    memset(count, 0, sizeof(Py_ssize_t) * (size_t)(buckets + 1));
    for (Py_ssize_t j = 0; j < n; j++)
        count[((in ? homes[in[j]] : homes[j]) >> shift & 0xFFFF) + 1]++;
    for (Py_ssize_t d = 0; d < buckets; d++)
        count[d + 1] += count[d];
    for (Py_ssize_t j = 0; j < n; j++) {
        uint32_t i = in ? in[j] : (uint32_t)j;
        out[count[homes[i] >> shift & 0xFFFF]++] = i;
    }
}

/* rebuild_slots(slots, probes, values, homes) -> bool
 * ``_Table.rebuild``'s placement (its numpy code stays the reference, and this writes exactly what it does):
 * ``values`` (int32) in the order of their probe keys' homes (``probes``, int64; stable), each in the slot
 * after the previous one's or at its home, whichever is later, into ``slots`` (int32, all EMPTY). False,
 * writing nothing, when a run would pass the end of ``slots`` (the caller then inserts in rounds).
 *
 * Why C: a rebuild is what a table pays to grow (0.4 of its entries' inserts apart while it grows; deletions
 * leave no tombstones to clear); numpy's stable argsort took 60-145 ns an entry (a 20M-block index: seconds
 * with the event loop held), two radix passes over the 32-bit homes take a few. */
static PyObject *rebuild_slots(PyObject *self, PyObject *args) {
    PyObject *slots_o, *probes_o, *values_o;
    Py_ssize_t homes;
    if (!PyArg_ParseTuple(args, "OOOn", &slots_o, &probes_o, &values_o, &homes))
        return NULL;
    Py_buffer slots, probes, values;
    if (PyObject_GetBuffer(slots_o, &slots, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(probes_o, &probes, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&slots);
        return NULL;
    }
    if (PyObject_GetBuffer(values_o, &values, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&slots);
        PyBuffer_Release(&probes);
        return NULL;
    }
    PyObject *result = NULL;
    uint32_t *home_of = NULL, *order = NULL, *spare = NULL;
    Py_ssize_t *count = NULL;
    Py_ssize_t n = probes.len / 8, nslots = slots.len / 4;
    if (slots.itemsize != 4 || probes.itemsize != 8 || values.itemsize != 4 || values.len / 4 != n ||
        homes <= 0 || homes > ((Py_ssize_t)1 << 32) || n >= ((Py_ssize_t)1 << 32)) {
        PyErr_SetString(PyExc_ValueError, "int32 slots and values, as many int64 probes, 1 to 2**32 homes");
        goto done;
    }
    home_of = PyMem_Malloc(sizeof(uint32_t) * (n ? n : 1));
    order = PyMem_Malloc(sizeof(uint32_t) * (n ? n : 1));
    spare = PyMem_Malloc(sizeof(uint32_t) * (n ? n : 1));
    Py_ssize_t low = homes < 65536 ? homes : 65536, high = ((homes - 1) >> 16) + 1; /* digits' ranges */
    count = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)((low > high ? low : high) + 1));
    if (!home_of || !order || !spare || !count) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *pv = probes.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        home_of[i] = (uint32_t)home(pv[i], homes);
    if (homes <= 65536) {
        radix_pass(home_of, NULL, order, n, 0, low, count);
    } else {
        radix_pass(home_of, NULL, spare, n, 0, low, count);
        radix_pass(home_of, spare, order, n, 16, high, count);
    }
    Py_ssize_t pos = -1;
    for (Py_ssize_t j = 0; j < n; j++) { /* positions only rise: the last is checked before anything is written */
        Py_ssize_t h = home_of[order[j]];
        pos = h > pos + 1 ? h : pos + 1;
        spare[j] = (uint32_t)pos;
    }
    if (pos >= nslots) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    int32_t *out = slots.buf;
    const int32_t *vv = values.buf;
    for (Py_ssize_t j = 0; j < n; j++)
        out[spare[j]] = vv[order[j]];
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(home_of);
    PyMem_Free(order);
    PyMem_Free(spare);
    PyMem_Free(count);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&probes);
    PyBuffer_Release(&values);
    return result;
}

/* store_chain(etab, ktab, e_hash, e_key, e_list, e_count, s_key, ehome, khome, spread, lst, list_len, hashes,
 *             tokens, block_size, parent_hash, root_key, row, unsigned_keys) -> (stop, row, added, wide, keys) | None
 * One BlockStored event of a worker in one call (``CompactKvIndex.store_chain``): the parent's key (the latest
 * entry holding ``parent_hash`` in the worker's lists that hold any, ``list_len`` being the index's entries
 * per list, as ``key_of``; ``root_key`` when it is None), the chained keys of the token blocks (``chain_keys``
 * without extra keys, router/_xxh3.h), then the store loop of ``store_plain`` from block 0. ``keys`` (the chained keys, a list) is None for an orphan (a parent the worker
 * does not hold: nothing stored). None: a case this path does not cover (tokens neither a list nor a buffer
 * of uint32, a block size outside 5 to 60 tokens, a parent hash that is not an int64, a parent key kept
 * negative): the caller composes the three in Python. TypeError or OverflowError for a token that is not a
 * uint32, before anything is stored, as ``chain_keys`` raises.
 *
 * Why one call: a decoding engine publishes a BlockStored of one block per request every 16 tokens, and for
 * such an event the three Python calls this replaces (with their conversions) cost several times its work. */
static PyObject *store_chain(PyObject *self, PyObject *args) {
    PyObject *arrays[7], *list_len, *hashes_in, *tokens, *parent_hash;
    Tables t;
    Py_ssize_t block_size, row;
    long long spread, lst;
    unsigned long long key;
    int unsigned_keys;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnLLO!OOnOKnp", &arrays[0], &arrays[1], &arrays[2], &arrays[3], &arrays[4],
                          &arrays[5], &arrays[6], &t.ehome, &t.khome, &spread, &lst, &PyList_Type, &list_len,
                          &hashes_in, &tokens, &block_size, &parent_hash, &key, &row, &unsigned_keys))
        return NULL;
    long long ids[3];
    Py_ssize_t n_lists = held_lists(list_len, lst, ids);
    if (n_lists < 0)
        return NULL;
    size_t step = (size_t)block_size * 4;
    if (block_size <= 0 || step < MIN_BLOCK || step > MAX_BLOCK)
        Py_RETURN_NONE;
    int64_t parent = 0;
    if (parent_hash != Py_None && !plain_hash(parent_hash, &parent))
        Py_RETURN_NONE;
    Py_buffer view = {0};
    const uint8_t *data = NULL;
    Py_ssize_t count;
    int listed = PyList_CheckExact(tokens);
    if (listed)
        count = PyList_GET_SIZE(tokens);
    else {
        if (!open_uint32_tokens(tokens, &view))
            Py_RETURN_NONE;
        data = (const uint8_t *)view.buf;
        count = view.len / 4;
    }
    PyObject *hashes = NULL, *keys = NULL, *result = NULL;
    Py_ssize_t n = count / block_size;
    hashes = PySequence_Fast(hashes_in, "engine hashes must be a sequence"); /* (before the tables, as above) */
    if (!hashes || !set_tables(&t, arrays, spread, lst))
        goto done;
    if (parent_hash != Py_None) {
        int64_t r = latest_row(&t, ids, n_lists, parent);
        if (r < 0) {
            result = Py_BuildValue("nnniO", (Py_ssize_t)0, row, (Py_ssize_t)0, 0, Py_None);
            goto done;
        }
        int64_t k = get(&t.mk, r);
        if (k < 0 && !unsigned_keys) { /* (a negative key stored as such: key_of gives it back negative) */
            result = Py_NewRef(Py_None);
            goto done;
        }
        key = (uint64_t)k;
    }
    keys = chained_block_keys(listed ? tokens : NULL, data, n, block_size, key);
    if (!keys)
        goto done;
    if (PySequence_Fast_GET_SIZE(hashes) != n) { /* (after the parent and the tokens, as store_chained fails) */
        PyErr_SetString(PyExc_ValueError, "as many token blocks as engine hashes");
        goto done;
    }
    Py_ssize_t added = 0;
    int wide = 0;
    Py_ssize_t stop = store_entries(&t, hashes, keys, 0, n, &row, &added, &wide);
    if (stop != -2)
        result = Py_BuildValue("nnniO", stop, row, added, wide, keys);
done:
    if (!listed && view.obj != NULL)
        PyBuffer_Release(&view);
    Py_XDECREF(hashes);
    Py_XDECREF(keys);
    return result;
}

static PyMethodDef methods[] = {
    {"latest_keys", latest_keys, METH_VARARGS, "CompactKvIndex.key_of / keys_of: the latest entries' keys."},
    {"store_plain", store_plain, METH_VARARGS, "CompactKvIndex.store's loop for new blocks with new keys."},
    {"store_chain", store_chain, METH_VARARGS, "CompactKvIndex.store_chain: a BlockStored's parent, keys and store."},
    {"compact_rows", compact_rows, METH_VARARGS, "CompactKvIndex._compact in place: live rows down, slots remapped."},
    {"rebuild_slots", rebuild_slots, METH_VARARGS, "_Table.rebuild's placement of its values in home order."},
    {"forget", forget, METH_NOARGS, "Release the buffers kept open for the arrays the loops last worked on."},
    {"remove_plain", remove_plain, METH_VARARGS, "CompactKvIndex.remove's loop for entries that hold their key alone."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "router.index._fastcompact", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastcompact(void) { return PyModule_Create(&module); }
