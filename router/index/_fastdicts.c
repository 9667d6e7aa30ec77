/* The dict index's per-block loops in C (router/index/residency.py: ``KvIndex.store``, ``store_chain`` and
 * ``remove``, and the match walk of a GPU-only index, ``match_lengths``; and the walk of
 * ``SpeculativePrefixes.match``), for the
 * common blocks only: a hash new to the worker whose key it does not hold yet; a removal while the worker has
 * no extra copies and no shared keys. Each loop stops at the first block that needs more (a hash stored again,
 * a key two hashes share) and hands it back to the Python loop, which stays the reference for every case.
 *
 * Why C: ingest applies these for every block of every event, and the interpreter costs more per block than
 * the dict operations themselves; here a new block costs three dict lookups and a removal two (a set-default
 * and a pop each do in one lookup what takes the interpreter two). The dicts' contents and the order of each
 * worker's map are exactly what the Python loop leaves (tests/test_index.py runs both against the brute-force
 * model and compares their LRU order).
 *
 * Also the per-key loops of a request's dispatch and end, for the same reason: the load accounting's counts of
 * the prompt blocks in flight (``count_keys``) and the speculative prefixes' claims on them (``claim_keys``,
 * ``release_claims``): about a thousand dict operations for an 8K-token prompt, on the request's path; and the
 * accounting's binary searches of a prompt's keys in flight (``held_prefix``, ``shared_len``), which a decision
 * runs for every worker holding the prompt's first key. Their Python loops stay the reference
 * (tests/test_dispatch_loops.py holds the two to the same dicts, in order, and the same answers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_xxh3.h"

/* dict.pop(key) in one lookup: a new reference, or NULL with no error set when the key is absent. */
static PyObject *dict_pop(PyObject *dict, PyObject *key) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *value;
    return PyDict_Pop(dict, key, &value) > 0 ? value : NULL;
#else
    PyObject *value = _PyDict_Pop(dict, key, Py_None);
    if (value == Py_None) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
#endif
}

/* The store loop over fast sequences of hashes and keys, from block ``start``: held[h] = key and holders[key] |=
 * bit, while h is new to ``held`` and ``bit`` is not yet in holders[key]. Returns the first block it did not
 * take (n when it took them all), ``*added`` the blocks it took; -1 with an exception set on an error. */
static Py_ssize_t store_loop(PyObject *held, PyObject *holders, PyObject *hashes, PyObject *keys, PyObject *bit,
                             Py_ssize_t start, Py_ssize_t *added) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes), i = start;
    *added = 0;
    for (; i < n; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(hashes, i);
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *mask = PyDict_GetItemWithError(holders, key); /* borrowed */
        PyObject *new_mask;
        if (mask == NULL) {
            if (PyErr_Occurred())
                return -1;
            new_mask = Py_NewRef(bit);
        } else {
            PyObject *both = PyNumber_And(mask, bit);
            if (!both)
                return -1;
            int held_here = PyObject_IsTrue(both);
            Py_DECREF(both);
            if (held_here < 0)
                return -1;
            if (held_here)
                break; /* a second hash for a key this worker holds: the Python loop counts it */
            new_mask = PyNumber_Or(mask, bit);
            if (!new_mask)
                return -1;
        }
        Py_ssize_t before = PyDict_GET_SIZE(held);
        if (PyDict_SetDefault(held, h, key) == NULL) { /* one lookup: inserts h only if it is new */
            Py_DECREF(new_mask);
            return -1;
        }
        if (PyDict_GET_SIZE(held) == before) { /* stored again: the Python loop counts the copy */
            Py_DECREF(new_mask);
            break;
        }
        int rc = PyDict_SetItem(holders, key, new_mask);
        Py_DECREF(new_mask);
        if (rc < 0)
            return -1;
        ++*added;
    }
    return i;
}

/* store_new(held, holders, hashes, keys, bit, start) -> (added, stop)
 * ``store_loop`` on sequences: ``stop`` is the first block it did not take (len(hashes) when it took them all). */
static PyObject *store_new(PyObject *self, PyObject *args) {
    PyObject *held, *holders, *hashes_in, *keys_in, *bit;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!O!OOOn", &PyDict_Type, &held, &PyDict_Type, &holders, &hashes_in, &keys_in,
                          &bit, &start))
        return NULL;
    PyObject *hashes = PySequence_Fast(hashes_in, "engine hashes must be a sequence");
    if (!hashes)
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys) {
        Py_DECREF(hashes);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t added;
    if (PySequence_Fast_GET_SIZE(keys) != PySequence_Fast_GET_SIZE(hashes))
        PyErr_SetString(PyExc_ValueError, "as many keys as engine hashes");
    else {
        Py_ssize_t stop = store_loop(held, holders, hashes, keys, bit, start, &added);
        if (stop >= 0)
            result = Py_BuildValue("nn", added, stop);
    }
    Py_DECREF(hashes);
    Py_DECREF(keys);
    return result;
}

/* A worker's maps (engine hash -> key), one per medium: 0, or -1 with an exception set when they are not three
 * dicts. */
static int check_held(PyObject *held_by_medium) {
    if (PyTuple_GET_SIZE(held_by_medium) != 3) {
        PyErr_SetString(PyExc_ValueError, "three media");
        return -1;
    }
    for (Py_ssize_t m = 0; m < 3; m++)
        if (!PyDict_CheckExact(PyTuple_GET_ITEM(held_by_medium, m))) {
            PyErr_SetString(PyExc_TypeError, "the worker's maps must be dicts");
            return -1;
        }
    return 0;
}

/* ``key_of`` in the worker's maps (checked by ``check_held``), GPU first: a borrowed key, or NULL (with an
 * exception set on an error, none when no map holds the hash). */
static PyObject *held_key(PyObject *held_by_medium, PyObject *h) {
    for (Py_ssize_t m = 0; m < 3; m++) {
        PyObject *found = PyDict_GetItemWithError(PyTuple_GET_ITEM(held_by_medium, m), h);
        if (found != NULL || PyErr_Occurred())
            return found;
    }
    return NULL;
}

static PyObject *chain_and_store(PyObject *held_by_medium, Py_ssize_t medium, PyObject *holders, PyObject *hashes_in,
                                 PyObject *tokens, const uint8_t *data, Py_ssize_t count, Py_ssize_t block_size,
                                 PyObject *parent_hash, unsigned long long key, PyObject *bit);

/* store_chain(held_by_medium, medium, holders, hashes, tokens, block_size, parent_hash, root_key, bit)
 *   -> (added, stop, keys) | None
 * One BlockStored event of a worker in one call: the parent's key (``key_of``: the worker's maps GPU first;
 * ``root_key`` when ``parent_hash`` is None), the chained keys of the token blocks (``chain_keys`` without extra
 * keys, router/_xxh3.h), then ``store_loop`` on the medium's map. ``keys`` is None when the parent is unknown
 * (an orphan: nothing stored). None: a case this path does not cover (tokens neither a list nor a buffer of
 * uint32, a block size outside 5 to 60 tokens, a parent key that is not a uint64): the caller composes the
 * three in Python. TypeError or OverflowError for a token that is not a uint32, before anything is stored, as
 * ``chain_keys`` raises.
 *
 * Why one call: a vLLM engine publishes a BlockStored of one block for every 16 tokens each running request
 * decodes, so events of one or two blocks are the common ones, and for them the three Python calls this
 * replaces cost several times the blocks' own work. */
static PyObject *store_chain(PyObject *self, PyObject *args) {
    PyObject *held_by_medium, *holders, *hashes_in, *tokens, *parent_hash, *bit;
    Py_ssize_t medium, block_size;
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "O!nO!OOnOKO", &PyTuple_Type, &held_by_medium, &medium, &PyDict_Type, &holders,
                          &hashes_in, &tokens, &block_size, &parent_hash, &key, &bit))
        return NULL;
    if (check_held(held_by_medium) < 0)
        return NULL;
    if (medium < 0 || medium > 2)
        return PyErr_Format(PyExc_ValueError, "three media");
    size_t step = (size_t)block_size * 4;
    if (block_size <= 0 || step < MIN_BLOCK || step > MAX_BLOCK)
        Py_RETURN_NONE;
    Py_buffer view = {0};
    int listed = PyList_CheckExact(tokens);
    if (!listed && !open_uint32_tokens(tokens, &view))
        Py_RETURN_NONE;
    PyObject *result = chain_and_store(held_by_medium, medium, holders, hashes_in, listed ? tokens : NULL,
                                       listed ? NULL : (const uint8_t *)view.buf,
                                       listed ? PyList_GET_SIZE(tokens) : view.len / 4, block_size, parent_hash,
                                       key, bit);
    if (!listed)
        PyBuffer_Release(&view);
    return result;
}

/* ``store_chain``'s work, on a list of token ints or on native uint32s at ``data``: ``count`` tokens. */
static PyObject *chain_and_store(PyObject *held_by_medium, Py_ssize_t medium, PyObject *holders, PyObject *hashes_in,
                                 PyObject *tokens, const uint8_t *data, Py_ssize_t count, Py_ssize_t block_size,
                                 PyObject *parent_hash, unsigned long long key, PyObject *bit) {
    if (parent_hash != Py_None) {
        PyObject *found = held_key(held_by_medium, parent_hash);
        if (found == NULL && PyErr_Occurred())
            return NULL;
        if (found == NULL)
            return Py_BuildValue("nnO", (Py_ssize_t)0, (Py_ssize_t)0, Py_None);
        if (!PyLong_CheckExact(found))
            Py_RETURN_NONE;
        key = PyLong_AsUnsignedLongLong(found);
        if (key == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    PyObject *hashes = PySequence_Fast(hashes_in, "engine hashes must be a sequence");
    if (!hashes)
        return NULL;
    Py_ssize_t n = count / block_size;
    PyObject *result = NULL, *keys = NULL;
    keys = chained_block_keys(tokens, data, n, block_size, key);
    if (!keys)
        goto done;
    if (PySequence_Fast_GET_SIZE(hashes) != n) { /* (after the parent and the tokens, as store_chained fails) */
        PyErr_SetString(PyExc_ValueError, "as many token blocks as engine hashes");
        goto done;
    }
    Py_ssize_t added, stop = store_loop(PyTuple_GET_ITEM(held_by_medium, medium), holders, hashes, keys, bit, 0,
                                        &added);
    if (stop >= 0)
        result = Py_BuildValue("nnO", added, stop, keys);
done:
    Py_DECREF(hashes);
    Py_XDECREF(keys);
    return result;
}

/* remove_plain(held, holders, hashes, keep) -> (unknown, dropped)
 * For a worker with no extra copies and no shared keys: key = held.pop(h); holders[key] &= keep (the entry
 * goes when no holder is left). ``unknown``: hashes ``held`` did not have. */
static PyObject *remove_plain(PyObject *self, PyObject *args) {
    PyObject *held, *holders, *hashes_in, *keep;
    if (!PyArg_ParseTuple(args, "O!O!OO", &PyDict_Type, &held, &PyDict_Type, &holders, &hashes_in, &keep))
        return NULL;
    PyObject *hashes = PySequence_Fast(hashes_in, "engine hashes must be a sequence");
    if (!hashes)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes), unknown = 0, dropped = 0;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(hashes, i);
        PyObject *key = dict_pop(held, h); /* new reference; NULL: absent (or an error) */
        if (key == NULL) {
            if (PyErr_Occurred())
                goto done;
            unknown++;
            continue;
        }
        dropped++;
        PyObject *mask = dict_pop(holders, key);
        if (mask == NULL) {
            Py_DECREF(key);
            if (PyErr_Occurred())
                goto done;
            continue;
        }
        PyObject *left = PyNumber_And(mask, keep);
        Py_DECREF(mask);
        if (!left) {
            Py_DECREF(key);
            goto done;
        }
        int any = PyObject_IsTrue(left); /* others hold it too: back it goes, with this worker's bit cleared */
        int rc = any > 0 ? PyDict_SetItem(holders, key, left) : any;
        Py_DECREF(left);
        Py_DECREF(key);
        if (rc < 0)
            goto done;
    }
    result = Py_BuildValue("nn", unknown, dropped);
done:
    Py_DECREF(hashes);
    return result;
}


/* The little-endian bytes of a non-negative int (a holder mask) into buf[n]. */
static int mask_bytes(PyObject *v, unsigned char *buf, size_t n) {
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t r = PyLong_AsNativeBytes(v, buf, (Py_ssize_t)n,
                                        Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
    if (r > (Py_ssize_t)n) { /* (it says how many bytes it needed: a mask wider than the fleet) */
        PyErr_SetString(PyExc_OverflowError, "holder mask wider than the index's slots");
        return -1;
    }
    return r < 0 ? -1 : 0;
#else
    return _PyLong_AsByteArray((PyLongObject *)v, buf, n, 1, 0);
#endif
}

typedef struct {
    int64_t *slots, *lengths;
    Py_ssize_t len, cap;
    size_t nbytes;
} Drops;

/* CPython 3.11 to 3.13 with 30-bit digits: an int's digits read in place (the layout those versions'
 * cpython/longintrepr.h declares), which costs a few nanoseconds a word where the generic byte conversion
 * costs about half a microsecond for a thousand-slot mask; other builds take the generic path. */
#if PyLong_SHIFT == 30 && PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
#define DIGITS_IN_PLACE 1
/* The digits of a non-negative int, or 0 when it is negative (the generic path then raises). */
static inline int long_digits(PyObject *v, const digit **digits, Py_ssize_t *count) {
    PyLongObject *lv = (PyLongObject *)v;
#if PY_VERSION_HEX >= 0x030C0000
    uintptr_t tag = lv->long_value.lv_tag;
    if ((tag & 3) == 2)
        return 0;
    *count = (Py_ssize_t)(tag >> 3);
    *digits = lv->long_value.ob_digit;
#else
    Py_ssize_t size = Py_SIZE(lv);
    if (size < 0)
        return 0;
    *count = size;
    *digits = lv->ob_digit;
#endif
    return 1;
}

/* 30-bit digits into ``nwords`` 64-bit words (cleared first); -1 with OverflowError when a set bit lies beyond. */
static int digits_to_words(const digit *digits, Py_ssize_t count, uint64_t *words, size_t nwords) {
    memset(words, 0, nwords * sizeof(uint64_t));
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t d = digits[i];
        size_t bit = (size_t)i * 30, w = bit >> 6, off = bit & 63;
        uint64_t spill = off > 34 ? d >> (64 - off) : 0; /* the digit's bits that cross into word w + 1 */
        if (w >= nwords || (spill && w + 1 >= nwords)) {
            if (d == 0)
                continue;
            PyErr_SetString(PyExc_OverflowError, "holder mask wider than the index's slots");
            return -1;
        }
        words[w] |= d << off;
        if (spill)
            words[w + 1] |= spill;
    }
    return 0;
}
#endif

/* A holder mask as ``n / 8`` 64-bit words, word 0 holding slots 0-63. */
static int mask_words(PyObject *v, uint64_t *words, size_t n) {
    if (n == 8) { /* a fleet of up to 64 slots: one word, read directly */
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        words[0] = (uint64_t)u;
        return 0;
    }
#ifdef DIGITS_IN_PLACE
    const digit *digits;
    Py_ssize_t count;
    if (PyLong_CheckExact(v) && long_digits(v, &digits, &count))
        return digits_to_words(digits, count, words, n / 8);
#endif
    if (mask_bytes(v, (unsigned char *)words, n) < 0)
        return -1;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (size_t w = 0; w < n / 8; w++)
        words[w] = __builtin_bswap64(words[w]);
#endif
    return 0;
}

#define LOOKAHEAD 32 /* blocks whose masks gpu_prefix looks up before reading them */

/* Room for one more (slot, length) pair. */
static int grow(Drops *d) {
    Py_ssize_t cap = d->cap ? 2 * d->cap : 64;
    int64_t *s = PyMem_Realloc(d->slots, cap * sizeof(int64_t));
    if (!s) {
        PyErr_NoMemory();
        return -1;
    }
    d->slots = s;
    int64_t *l = PyMem_Realloc(d->lengths, cap * sizeof(int64_t));
    if (!l) {
        PyErr_NoMemory();
        return -1;
    }
    d->lengths = l;
    d->cap = cap;
    return 0;
}

/* Record every slot whose bit is set in word ``w`` of a mask (bits ``w * 64`` on) with ``length``, ascending. */
static int record_word(Drops *d, size_t w, uint64_t bits, int64_t length) {
    while (bits) {
        int b = __builtin_ctzll(bits);
        bits &= bits - 1;
        if (d->len == d->cap && grow(d) < 0)
            return -1;
        d->slots[d->len] = (int64_t)(w * 64 + (size_t)b);
        d->lengths[d->len++] = length;
    }
    return 0;
}

/* gpu_prefix(holders, keys, width) -> (slots, lengths) as int64 bytes
 * The walk of ``KvIndex._walk_gpu_only`` and the reading of its drop masks (``_drop_lengths``) in one: the
 * workers still matching are kept as 64-bit words, each key's holder mask is read into words once, and a
 * worker drops out (with the length it reached) where its bit leaves; the rest matched up to where the walk
 * stopped. Slots come out by the length they reached, then ascending, as the Python reading gives them. */
static PyObject *gpu_prefix(PyObject *self, PyObject *args) {
    PyObject *holders, *keys_in;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "O!On", &PyDict_Type, &holders, &keys_in, &width))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys)
        return NULL;
    size_t words = (size_t)(width > 0 ? (width + 63) / 64 : 1);
    Drops d = {NULL, NULL, 0, 0, words * 8};
    PyObject *result = NULL, *ahead[LOOKAHEAD];
    Py_ssize_t got = 0;
    uint64_t *alive = PyMem_Calloc(words, sizeof(uint64_t)), *mask = PyMem_Calloc(words, sizeof(uint64_t));
    if (!alive || !mask) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), i = 1;
    int any = 0;
    if (n) {
        PyObject *first = PyDict_GetItemWithError(holders, PySequence_Fast_GET_ITEM(keys, 0)); /* borrowed */
        if (!first && PyErr_Occurred())
            goto done;
        if (first) {
            if (mask_words(first, alive, d.nbytes) < 0)
                goto done;
            for (size_t w = 0; w < words; w++)
                any |= alive[w] != 0;
        }
    }
    /* The masks of up to LOOKAHEAD blocks are looked up (and their memory prefetched) before any is read: in a
     * large index each lookup and each mask is a cache miss, and lookups with nothing between them overlap. */
    while (any && i < n) {
        Py_ssize_t stop = n - i < LOOKAHEAD ? n : i + LOOKAHEAD;
        int missing = 0;
        for (Py_ssize_t j = i; j < stop; j++) {
            PyObject *m = PyDict_GetItemWithError(holders, PySequence_Fast_GET_ITEM(keys, j));
            if (!m) {
                if (PyErr_Occurred())
                    goto done;
                missing = 1; /* nobody holds block j: every worker still in stops there */
                break;
            }
            for (size_t line = 0; line < d.nbytes + 32; line += 64)
                __builtin_prefetch((const char *)m + line);
            ahead[got++] = Py_NewRef(m); /* (owned: a key's __eq__ could change the dict before it is read) */
        }
        for (Py_ssize_t k = 0; k < got && any; k++, i++) {
            if (mask_words(ahead[k], mask, d.nbytes) < 0)
                goto done;
            any = 0;
            for (size_t w = 0; w < words; w++) {
                uint64_t still = alive[w] & mask[w], gone = alive[w] ^ still;
                if (gone && record_word(&d, w, gone, i) < 0)
                    goto done;
                alive[w] = still;
                any |= still != 0;
            }
        }
        while (got)
            Py_DECREF(ahead[--got]);
        if (missing)
            break;
    }
    if (any) { /* the rest matched up to where the walk stopped */
        for (size_t w = 0; w < words; w++)
            if (alive[w] && record_word(&d, w, alive[w], i) < 0)
                goto done;
    }
    PyObject *slots = PyByteArray_FromStringAndSize((const char *)d.slots, d.len * 8);
    PyObject *lengths = slots ? PyByteArray_FromStringAndSize((const char *)d.lengths, d.len * 8) : NULL;
    if (lengths)
        result = PyTuple_Pack(2, slots, lengths);
    Py_XDECREF(slots);
    Py_XDECREF(lengths);
done:
    while (got)
        Py_DECREF(ahead[--got]);
    Py_DECREF(keys);
    PyMem_Free(alive);
    PyMem_Free(mask);
    PyMem_Free(d.slots);
    PyMem_Free(d.lengths);
    return result;
}

/* speculative_prefixes(owner, keys, now) -> {worker: blocks} or None
 * ``SpeculativePrefixes.match``'s walk: each key's (worker, expiry) entry until the first key without a live
 * one; each worker's prefix is one past the last key it owns. None (the Python loop then answers) when an
 * entry is not the (str, float) pair that class writes. */
static PyObject *speculative_prefixes(PyObject *self, PyObject *args) {
    PyObject *owner, *keys_in;
    double now;
    if (!PyArg_ParseTuple(args, "O!Od", &PyDict_Type, &owner, &keys_in, &now))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys)
        return NULL;
    PyObject *out = PyDict_New();
    if (!out)
        goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyDict_GetItemWithError(owner, PySequence_Fast_GET_ITEM(keys, i)); /* borrowed */
        if (!entry) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
            !PyFloat_CheckExact(PyTuple_GET_ITEM(entry, 1))) {
            Py_DECREF(out);
            Py_DECREF(keys);
            Py_RETURN_NONE;
        }
        if (PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(entry, 1)) <= now)
            break;
        PyObject *blocks = PyLong_FromSsize_t(i + 1);
        if (!blocks)
            goto fail;
        int failed = PyDict_SetItem(out, PyTuple_GET_ITEM(entry, 0), blocks);
        Py_DECREF(blocks);
        if (failed < 0)
            goto fail;
    }
    Py_DECREF(keys);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(keys);
    return NULL;
}

/* keys_of(held_by_medium, hashes) -> list[int]
 * ``key_of`` of each hash (the worker's maps GPU first), the ones it holds on no medium left out: what the feed
 * tells the reuse statistics a GPU removal evicts, one call for an event's blocks. */
static PyObject *keys_of(PyObject *self, PyObject *args) {
    PyObject *held_by_medium, *hashes_in;
    if (!PyArg_ParseTuple(args, "O!O", &PyTuple_Type, &held_by_medium, &hashes_in) || check_held(held_by_medium) < 0)
        return NULL;
    PyObject *hashes = PySequence_Fast(hashes_in, "engine hashes must be a sequence");
    if (!hashes)
        return NULL;
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < PySequence_Fast_GET_SIZE(hashes); i++) {
        PyObject *found = held_key(held_by_medium, PySequence_Fast_GET_ITEM(hashes, i));
        if ((found == NULL && PyErr_Occurred()) || (found != NULL && PyList_Append(out, found) < 0))
            Py_CLEAR(out);
    }
    Py_DECREF(hashes);
    return out;
}

/* count_keys(counts, keys, delta) -> None
 * ``counts[k] += delta`` for each of ``keys`` (delta +1 or -1), a count reaching 0 deleted: what the load
 * accounting does for every prompt block of a request it dispatches or ends (router/load/accounting.py's loops
 * are the reference). A decrement of a key with no count raises KeyError, as ``counts[k]`` does there; the
 * counts are ints, as that class writes them. */
static PyObject *count_keys(PyObject *self, PyObject *args) {
    PyObject *counts, *keys_in;
    int delta;
    if (!PyArg_ParseTuple(args, "O!Oi", &PyDict_Type, &counts, &keys_in, &delta))
        return NULL;
    if (delta != 1 && delta != -1) {
        PyErr_SetString(PyExc_ValueError, "delta must be 1 or -1");
        return NULL;
    }
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject *one = PyLong_FromLong(1);
    if (!one)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *count; /* borrowed */
        if (delta > 0) { /* a key new here (the usual case) costs one lookup: inserted with its count, 1 */
            Py_ssize_t before = PyDict_GET_SIZE(counts);
            count = PyDict_SetDefault(counts, k, one);
            if (!count)
                goto fail_one;
            if (PyDict_GET_SIZE(counts) != before)
                continue;
        } else {
            count = PyDict_GetItemWithError(counts, k);
            if (!count) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, k);
                goto fail_one;
            }
        }
        long long was = PyLong_AsLongLong(count);
        if (was == -1 && PyErr_Occurred())
            goto fail_one;
        long long left = was + delta;
        if (left == 0) {
            if (PyDict_DelItem(counts, k) < 0)
                goto fail_one;
            continue;
        }
        PyObject *value = PyLong_FromLongLong(left);
        if (!value)
            goto fail_one;
        int rc = PyDict_SetItem(counts, k, value);
        Py_DECREF(value);
        if (rc < 0)
            goto fail_one;
    }
    Py_DECREF(one);
    Py_DECREF(keys);
    Py_RETURN_NONE;
fail_one:
    Py_DECREF(one);
fail:
    Py_DECREF(keys);
    return NULL;
}

/* claim_keys(owner, keys, entry) -> list
 * ``SpeculativePrefixes.record``: each key's entry before (None where it had none), read for all of them first,
 * then ``owner[k] = entry`` for each. */
static PyObject *claim_keys(PyObject *self, PyObject *args) {
    PyObject *owner, *keys_in, *entry;
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &owner, &keys_in, &entry))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject *previous = PyList_New(n);
    if (!previous)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *was = PyDict_GetItemWithError(owner, PySequence_Fast_GET_ITEM(keys, i)); /* borrowed */
        if (!was && PyErr_Occurred())
            goto fail;
        PyList_SET_ITEM(previous, i, Py_NewRef(was ? was : Py_None));
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyDict_SetItem(owner, PySequence_Fast_GET_ITEM(keys, i), entry) < 0)
            goto fail;
    Py_DECREF(keys);
    return previous;
fail:
    Py_XDECREF(previous);
    Py_DECREF(keys);
    return NULL;
}

/* release_claims(owner, keys, previous, entry) -> None
 * ``claim_keys`` taken back: each key still owned by ``entry`` (the same object: not claimed again since)
 * returns to its previous entry, or leaves ``owner`` where it had none. */
static PyObject *release_claims(PyObject *self, PyObject *args) {
    PyObject *owner, *keys_in, *previous, *entry;
    if (!PyArg_ParseTuple(args, "O!OO!O", &PyDict_Type, &owner, &keys_in, &PyList_Type, &previous, &entry))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (PyList_GET_SIZE(previous) != n) {
        PyErr_SetString(PyExc_ValueError, "as many previous entries as keys");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *now_there = PyDict_GetItemWithError(owner, k); /* borrowed */
        if (!now_there) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        if (now_there != entry)
            continue;
        PyObject *was = PyList_GET_ITEM(previous, i);
        if ((was == Py_None ? PyDict_DelItem(owner, k) : PyDict_SetItem(owner, k, was)) < 0)
            goto fail;
    }
    Py_DECREF(keys);
    Py_RETURN_NONE;
fail:
    Py_DECREF(keys);
    return NULL;
}

/* held_prefix(active, keys) -> int
 * ``WorkerLoad.shared_prefix_blocks``: how many leading ``keys`` are in ``active`` (a binary search, as keys are
 * prefix-closed), the Python search step for step: a decision asks it of every worker that holds the prompt's
 * first key. */
static PyObject *held_prefix(PyObject *self, PyObject *args) {
    PyObject *active, *keys_in;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &active, &keys_in))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), lo = 0;
    int in = n ? PyDict_Contains(active, PySequence_Fast_GET_ITEM(keys, 0)) : 0;
    if (in > 0) {
        Py_ssize_t hi = n;
        lo = 1;
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi + 1) / 2;
            in = PyDict_Contains(active, PySequence_Fast_GET_ITEM(keys, mid - 1));
            if (in < 0)
                break;
            if (in)
                lo = mid;
            else
                hi = mid - 1;
        }
    }
    Py_DECREF(keys);
    return in < 0 ? NULL : PyLong_FromSsize_t(lo);
}

/* shared_len(keys, active) -> int
 * ``accounting.py_shared_len``: how many leading ``keys`` (a request's in flight, each counted in ``active``)
 * another request in flight holds too, the Python search step for step. */
static PyObject *shared_len(PyObject *self, PyObject *args) {
    PyObject *keys_in, *active;
    if (!PyArg_ParseTuple(args, "OO!", &keys_in, &PyDict_Type, &active))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (!keys)
        return NULL;
    Py_ssize_t lo = 0, hi = PySequence_Fast_GET_SIZE(keys);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        PyObject *k = PySequence_Fast_GET_ITEM(keys, mid);
        PyObject *count = PyDict_GetItemWithError(active, k); /* borrowed */
        if (!count) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, k);
            goto fail;
        }
        long long c = PyLong_AsLongLong(count);
        if (c == -1 && PyErr_Occurred())
            goto fail;
        if (c > 1)
            lo = mid + 1;
        else
            hi = mid;
    }
    Py_DECREF(keys);
    return PyLong_FromSsize_t(lo);
fail:
    Py_DECREF(keys);
    return NULL;
}

static PyMethodDef methods[] = {
    {"keys_of", keys_of, METH_VARARGS, "KvIndex.keys_of: key_of of each hash, those held nowhere left out."},
    {"store_new", store_new, METH_VARARGS, "KvIndex.store's loop for blocks new to the worker."},
    {"store_chain", store_chain, METH_VARARGS, "KvIndex.store_chain: a BlockStored's parent, keys and store."},
    {"gpu_prefix", gpu_prefix, METH_VARARGS, "KvIndex.match_lengths of a GPU-only index: (slots, lengths)."},
    {"remove_plain", remove_plain, METH_VARARGS, "KvIndex.remove's loop for a worker without copies or shared keys."},
    {"speculative_prefixes", speculative_prefixes, METH_VARARGS, "SpeculativePrefixes.match's walk."},
    {"count_keys", count_keys, METH_VARARGS, "counts[k] += delta (1 or -1) for each key; a count at 0 deleted."},
    {"claim_keys", claim_keys, METH_VARARGS, "SpeculativePrefixes.record: the previous entries, then owner[k] = entry."},
    {"release_claims", release_claims, METH_VARARGS, "claim_keys taken back where entry still owns a key."},
    {"held_prefix", held_prefix, METH_VARARGS, "WorkerLoad.shared_prefix_blocks: leading keys in active."},
    {"shared_len", shared_len, METH_VARARGS, "accounting.py_shared_len: leading keys counted more than once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "router.index._fastdicts", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastdicts(void) { return PyModule_Create(&module); }
