/* The routing objective's per-candidate arithmetic in C: ``price`` is ``latency_cost._inputs``,
 * ``_objective_columns`` and ``CostModel.terms`` (router/scheduling/plugins/scorers/latency_cost.py,
 * router/scheduling/cost.py), which stay the reference and the fallback, in one loop over the candidates. The
 * operations are the reference's, in its order, on the same IEEE doubles (built with -ffp-contract=off, so no
 * multiply-add is fused), with numpy's meaning where C's differs: maximum and minimum propagate NaN and return
 * the first on a tie, floor division is CPython's; so every term and score comes out the same to the last bit
 * (tests/test_vector_decisions.py runs every decision both ways; tests/test_fast_objective.py random inputs).
 *
 * Why C: the objective is some hundred elementwise operations. As numpy calls each costs about a microsecond
 * whatever the size of its arrays; on each candidate's Python floats each costs tens of nanoseconds, but that
 * is per candidate. A decision between two workers spent half its time there, and one over a thousand workers
 * a hundred array passes; here it is one pass over the candidates' columns, a few nanoseconds a candidate.
 *
 * What stays in Python: the memory wait, for the few candidates whose blocks do not fit beside the requests in
 * flight (``need``, a row of the output): a search of each one's release schedule. Up to ``max_calls`` of them
 * ``price`` asks ``wait_of`` for each one's and adds it to its queue, TTFT and score here (the formula's order);
 * more, it leaves them to the caller, which searches every schedule at once and hands the waits to
 * ``add_waits``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* the columns ``price`` reads, in the order it takes them (``latency_cost._candidate_columns``) */
enum { HAS_LOAD, REQUESTS, DECODING, ACTIVE, PENDING, CAPACITY, FRESH, WAITING, RUNNING, KV, GPU, CPU, STORAGE,
       OUTPUT_TOKENS, TTFT_SLOPE, DECODE_SLOPE, BATCH_LIMIT, N_COLUMNS };

/* the rows it writes, one value per candidate (``latency_cost.OBJECTIVE_ROWS``) */
enum { R_QUEUE, R_PREFILL, R_DECODE, R_TTFT, R_STALL, R_INTERFERENCE, R_EVICTION, R_STEP, R_MODEL_TTFT,
       R_MODEL_STEP, R_BEHIND, R_PREEMPT, R_SCORE, R_NEED, R_OVER, R_SLOWDOWN, R_BATCH_WAIT, N_ROWS };

typedef struct {
    Py_buffer view;
    char kind; /* 'd' double, 'b' bool, 'q' int64 */
    int held;
} Column;

static int column_open(Column *c, PyObject *obj, const char *what) {
    c->held = 0;
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    c->held = 1;
    const char *f = c->view.format ? c->view.format : "B";
    if (*f == '=' || *f == '<' || *f == '@')
        f++;
    if (c->view.ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s: a 1-d array expected", what);
        return -1;
    }
    if (f[0] == 'd' && f[1] == 0 && c->view.itemsize == 8)
        c->kind = 'd';
    else if (f[0] == '?' && f[1] == 0 && c->view.itemsize == 1)
        c->kind = 'b';
    else if ((f[0] == 'q' || f[0] == 'l') && f[1] == 0 && c->view.itemsize == 8)
        c->kind = 'q';
    else {
        PyErr_Format(PyExc_TypeError, "%s: float64, bool or int64 expected, got format '%s'", what, f);
        return -1;
    }
    return 0;
}

static void column_close(Column *c) {
    if (c->held)
        PyBuffer_Release(&c->view);
    c->held = 0;
}

static inline Py_ssize_t column_len(const Column *c) { return c->view.shape ? c->view.shape[0] : 0; }

static inline double column_get(const Column *c, Py_ssize_t i) {
    switch (c->kind) {
    case 'd':
        return ((const double *)c->view.buf)[i];
    case 'b':
        return ((const unsigned char *)c->view.buf)[i] ? 1.0 : 0.0;
    default:
        return (double)((const int64_t *)c->view.buf)[i];
    }
}

/* numpy's maximum and minimum: NaN propagates; on a tie (0.0 and -0.0 too) the first */
static inline double np_max(double a, double b) {
    if (isnan(a) || isnan(b))
        return NAN;
    return a >= b ? a : b;
}

static inline double np_min(double a, double b) {
    if (isnan(a) || isnan(b))
        return NAN;
    return a <= b ? a : b;
}

/* CPython's float floor division (Objects/floatobject.c, _float_div_mod), which numpy's floor_divide shares */
static double floor_div(double vx, double wx) {
    /* whole numbers both, the usual case (tokens over a block size): the integer quotient, which is the same */
    if (vx > 0.0 && vx < 4503599627370496.0 && wx >= 1.0 && wx < 4503599627370496.0 && vx == (double)(int64_t)vx &&
        wx == (double)(int64_t)wx)
        return (double)((int64_t)vx / (int64_t)wx);
    if (wx == 0.0)
        return NAN; /* (unreachable: the block size is positive) */
    double mod = fmod(vx, wx);
    double div = (vx - mod) / wx;
    if (mod) {
        if ((wx < 0) != (mod < 0))
            div -= 1.0;
    }
    double floordiv;
    if (div) {
        floordiv = floor(div);
        if (div - floordiv > 0.5)
            floordiv += 1.0;
    } else {
        floordiv = copysign(0.0, vx / wx);
    }
    return floordiv;
}

typedef struct {
    double prefill_a, prefill_b, prefill_c, decode_a, decode_b, decode_c, load_back_ms_per_token;
} Timing;

/* ``StepTiming.decode_s_array`` of one value */
static inline double decode_s(const Timing *t, double kv_usage) {
    double p = np_min(np_max(kv_usage, 0.0), 1.0);
    return np_max(0.0, t->decode_a * p * p + t->decode_b * p + t->decode_c) / 1000.0;
}

/* ``StepTiming.prefill_s_array`` of one value: its seconds, and its steps in ``*steps_out`` */
static inline double prefill_s(const Timing *t, double tokens, double budget, double floor_s, double *steps_out) {
    double steps = ceil(tokens / budget);
    double chunk = tokens / np_max(steps, 1.0);
    double per_step = (t->prefill_a * chunk * chunk + t->prefill_b * chunk + t->prefill_c) / 1000.0;
    if (steps_out)
        *steps_out = steps;
    return tokens > 0 ? steps * np_max(per_step, floor_s) : 0.0;
}

/* A memory wait into candidate ``k``'s rows: the reference adds what of it is beyond the batch wait to the
 * queue, then sums as ``price`` does */
static inline void add_wait(double *o, Py_ssize_t n, Py_ssize_t k, double wait, double w) {
    const double queue = o[R_QUEUE * n + k] + np_max(0.0, wait - o[R_BATCH_WAIT * n + k]);
    const double prefill = o[R_PREFILL * n + k];
    o[R_QUEUE * n + k] = queue;
    o[R_TTFT * n + k] = queue + prefill;
    o[R_SCORE * n + k] = queue + prefill + o[R_STALL * n + k] + o[R_EVICTION * n + k] + o[R_BEHIND * n + k] +
                         w * (o[R_DECODE * n + k] + o[R_SLOWDOWN * n + k] + o[R_PREEMPT * n + k]);
}

static const char *COLUMN_NAMES[N_COLUMNS] = {
    "has_load", "requests", "decoding", "active", "pending", "capacity", "fresh", "waiting", "running", "kv",
    "gpu", "cpu", "storage", "output_tokens", "ttft_slope", "decode_slope", "batch_limit"};

PyDoc_STRVAR(price_doc,
"price(columns, selection, shared, resident, request, params, out, wait_of, max_calls) -> int\n\n"
"Every candidate's objective terms into ``out`` (float64, rows x candidates, C order). ``columns``: the 17\n"
"fleet columns by slot; ``selection``: int64 slots of the candidates, or None for every slot in order;\n"
"``shared``, ``resident``: float64 by candidate; ``request``: (n_keys, tail, block_size, prompt_tokens,\n"
"max_tokens); ``params``: (waiting_prompt_tokens, remaining_fraction, step_token_budget,\n"
"storage_ms_per_token, prefill_a, prefill_b, prefill_c, decode_a, decode_b, decode_c,\n"
"load_back_ms_per_token, kv_watermark, reuse, kv_load_weight, held_share). Where a candidate's blocks do not fit (the ``need`` row) and\n"
"no more than ``max_calls`` do, ``wait_of(slot, over, active, capacity)`` gives its memory wait, added here;\n"
"else none is: returns how many candidates need one that was not added (0 or the count).");

static PyObject *price(PyObject *self, PyObject *args) {
    PyObject *columns_o, *sel_o, *shared_o, *resident_o, *out_o, *wait_of;
    Py_ssize_t max_calls, needing = 0;
    long long n_keys, tail, bs, prompt, max_tokens;
    double wpt, remaining_fraction, budget_in, storage_ms, watermark;
    Timing t;
    double reuse, w, held;
    if (!PyArg_ParseTuple(args, "O!OOO(LLLLL)(ddddddddddddddd)OOn", &PyTuple_Type, &columns_o, &sel_o, &shared_o,
                          &resident_o, &n_keys, &tail, &bs, &prompt, &max_tokens, &wpt, &remaining_fraction,
                          &budget_in, &storage_ms, &t.prefill_a, &t.prefill_b, &t.prefill_c, &t.decode_a,
                          &t.decode_b, &t.decode_c, &t.load_back_ms_per_token, &watermark, &reuse, &w, &held, &out_o,
                          &wait_of, &max_calls))
        return NULL;
    if (PyTuple_GET_SIZE(columns_o) != N_COLUMNS) {
        PyErr_Format(PyExc_ValueError, "%d columns expected", N_COLUMNS);
        return NULL;
    }
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block size must be positive");
        return NULL;
    }
    Column cols[N_COLUMNS], shared, resident, sel;
    Py_buffer out;
    int out_held = 0, ok = 0;
    for (int i = 0; i < N_COLUMNS; i++)
        cols[i].held = 0;
    shared.held = resident.held = sel.held = 0;
    for (int i = 0; i < N_COLUMNS; i++)
        if (column_open(&cols[i], PyTuple_GET_ITEM(columns_o, i), COLUMN_NAMES[i]) < 0)
            goto done;
    if (column_open(&shared, shared_o, "shared") < 0 || column_open(&resident, resident_o, "resident") < 0)
        goto done;
    Py_ssize_t n = column_len(&shared), fleet = column_len(&cols[0]);
    for (int i = 1; i < N_COLUMNS; i++)
        if (column_len(&cols[i]) != fleet) {
            PyErr_Format(PyExc_ValueError, "column %s: %zd slots, not %zd", COLUMN_NAMES[i], column_len(&cols[i]),
                         fleet);
            goto done;
        }
    const int64_t *slots = NULL;
    if (sel_o != Py_None) {
        if (column_open(&sel, sel_o, "selection") < 0)
            goto done;
        if (sel.kind != 'q') {
            PyErr_SetString(PyExc_TypeError, "selection: int64 expected");
            goto done;
        }
        slots = (const int64_t *)sel.view.buf;
        if (column_len(&sel) != n) {
            PyErr_SetString(PyExc_ValueError, "selection and shared differ in length");
            goto done;
        }
        for (Py_ssize_t k = 0; k < n; k++)
            if (slots[k] < 0 || slots[k] >= fleet) {
                PyErr_SetString(PyExc_IndexError, "selection: a slot out of range");
                goto done;
            }
    } else if (n != fleet) {
        PyErr_SetString(PyExc_ValueError, "no selection: shared must have a value per slot");
        goto done;
    }
    if (column_len(&resident) != n) {
        PyErr_SetString(PyExc_ValueError, "resident and shared differ in length");
        goto done;
    }
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    out_held = 1;
    const char *of = out.format ? out.format : "B";
    if (*of == '=' || *of == '<' || *of == '@')
        of++;
    if (out.ndim != 2 || out.shape[0] != N_ROWS || out.shape[1] != n || out.itemsize != 8 || strcmp(of, "d") != 0) {
        PyErr_Format(PyExc_ValueError, "out: float64 of shape (%d, %zd) expected", N_ROWS, n);
        goto done;
    }
    double *o = (double *)out.buf;
    const double budget = (double)(budget_in >= 1.0 ? budget_in : 1.0); /* max(budget, 1) */
    const double b = (double)bs, dn_keys = (double)n_keys, dtail = (double)tail;
    const double dprompt = (double)prompt, dmax = (double)max_tokens;
    const double hit_cap = (double)(prompt - 1 > 0 ? prompt - 1 : 0);
    /* cost.prompt_blocks_to_admit: its partial last prompt block */
    const long long rest = prompt - n_keys * bs;
    const double dpartial = (double)(rest > 0 ? (rest + bs - 1) / bs : 0);

    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t j = slots ? (Py_ssize_t)slots[k] : k;
#define C(name) column_get(&cols[name], j)
        const double requests = C(REQUESTS), decoding = C(DECODING), active = C(ACTIVE), capacity = C(CAPACITY);
        const int fresh = C(FRESH) != 0.0;
        const double waiting_raw = C(WAITING), running_raw = C(RUNNING), kv_raw = C(KV);
        const double sh = column_get(&shared, k);
        /* ---- _inputs */
        const int has_w = fresh && !isnan(waiting_raw), has_r = fresh && !isnan(running_raw);
        const int has_kv = fresh && !isnan(kv_raw);
        const double ours = requests - decoding, limit = C(BATCH_LIMIT);
        const double others = (has_w ? np_max(0.0, trunc(waiting_raw) - ours) : 0.0) * wpt;
        const double pending = C(PENDING) + others;
        const double running = has_r ? np_max(decoding, trunc(running_raw)) : decoding;
        const double kv = has_kv ? kv_raw : 0.0;
        const double cap = floor_div(capacity, b);
        /* cost.blocks_in_use */
        const double own_used = np_max(0.0, active - remaining_fraction * C(OUTPUT_TOKENS) / b);
        const double used = (cap > 0 && has_kv) ? kv * cap : own_used;
        const double new_blocks = dn_keys - sh + dtail;
        /* cost.admission_lack */
        const double admit = dn_keys - sh + dpartial;
        const double over = ceil(admit - (cap - used - ceil(others / b) - watermark * cap));
        const int need = capacity > 0 && C(HAS_LOAD) != 0.0 && requests > 0 && over > 0;
        /* ---- _objective_columns */
        double others_left = remaining_fraction * C(OUTPUT_TOKENS);
        const double inflight = np_max(np_max(requests, running), 1.0);
        const double gpu = C(GPU), cpu = C(CPU), storage = C(STORAGE);
        const double res = column_get(&resident, k);
        /* cost.slot_steps */
        const int limited = fresh && limit > 0 && !isnan(waiting_raw) && !isnan(running_raw);
        const double total = np_max(requests, trunc(limited ? waiting_raw : 0.0) + trunc(limited ? running_raw : 0.0));
        const double ahead = np_max(0.0, total - limit);
        const double per_request = requests > 0 ? C(OUTPUT_TOKENS) / np_max(requests, 1.0) : dmax;
        const double slot_steps = limited ? ahead / (limited ? limit : 1.0) * per_request : 0.0;
        const double behind_n = (has_w ? np_max(ours, trunc(waiting_raw)) : ours) + held;
        /* ---- CostModel.terms */
        const double hit = np_min((gpu + cpu + storage) * b, hit_cap);
        const double uncached = dprompt - hit;
        const double overlap = max_tokens ? np_min(1.0, others_left / inflight / dmax) : 1.0;
        const int known = cap > 0;
        const double safe_cap = known ? cap : 1.0;
        const double p0 = known ? used / safe_cap : kv;
        const double p1 = known ? (used + new_blocks) / safe_cap : kv;
        const double own_p = known ? (overlap * used + new_blocks) / safe_cap : kv;
        const double dk = C(DECODE_SLOPE), kk = C(TTFT_SLOPE);
        const double model_own_step = decode_s(&t, own_p);
        const double d0 = dk * decode_s(&t, p0), d1 = dk * decode_s(&t, p1), own_step = dk * model_own_step;
        const double floor_s = running > 0 ? d0 : 0.0;
        double steps;
        const double own = prefill_s(&t, uncached, budget, floor_s, &steps);
        const double queue = pending > 0 ? prefill_s(&t, pending + uncached, budget, floor_s, NULL) - own : 0.0;
        const double load_back = (cpu * b * t.load_back_ms_per_token + storage * b * storage_ms) / 1000.0;
        const double model_ttft = queue + own + load_back;
        const double ttft = kk * model_ttft;
        const double queue_s = kk * queue;
        const double prefill = ttft - queue_s;
        const double batch_wait = slot_steps * d0;
        const double stall = running * np_max(0.0, kk * own - steps * d0);
        const double final_blocks = used + others_left / b;
        if (max_tokens)
            others_left = np_min(others_left, running * dmax);
        const double slowdown = others_left * (d1 - d0);
        double overflow = uncached + dmax - np_max(0.0, cap * b - res);
        overflow = known ? np_max(overflow, 0.0) : 0.0;
        const double eviction = reuse * kk * prefill_s(&t, overflow, budget, 0.0, NULL);
        const double alone = pending > 0 ? prefill_s(&t, pending, budget, floor_s, NULL) : 0.0;
        const double behind = behind_n * (kk * (queue + own - alone + load_back));
        /* cost.preempt_fraction */
        const double pover = final_blocks + new_blocks - (cap - watermark * cap);
        const double chance = known ? np_min(np_max(pover / np_max(new_blocks, 1.0), 0.0), 1.0) : 0.0;
        const double redo = prefill_s(&t, uncached + remaining_fraction * dmax, budget, floor_s, NULL);
        const double preempt = chance * (kk * redo);
        /* (the memory wait beyond the batch wait: the caller's, where ``need``) */
        const double queue_total = queue_s + batch_wait + np_max(0.0, 0.0 - batch_wait);
        const double decode = dmax * own_step;
#undef C
        o[R_QUEUE * n + k] = queue_total;
        o[R_PREFILL * n + k] = prefill;
        o[R_DECODE * n + k] = decode;
        o[R_TTFT * n + k] = queue_total + prefill;
        o[R_STALL * n + k] = stall;
        o[R_INTERFERENCE * n + k] = stall + slowdown;
        o[R_EVICTION * n + k] = eviction;
        o[R_STEP * n + k] = own_step;
        o[R_MODEL_TTFT * n + k] = pending > 0 ? 0.0 : (slot_steps > 0 ? 0.0 : model_ttft);
        o[R_MODEL_STEP * n + k] = model_own_step;
        o[R_BEHIND * n + k] = behind;
        o[R_PREEMPT * n + k] = preempt;
        o[R_SCORE * n + k] = queue_total + prefill + stall + eviction + behind + w * (decode + slowdown + preempt);
        o[R_NEED * n + k] = need ? 1.0 : 0.0;
        needing += need;
        o[R_OVER * n + k] = over;
        o[R_SLOWDOWN * n + k] = slowdown;
        o[R_BATCH_WAIT * n + k] = batch_wait;
    }
    if (needing && needing <= max_calls) {
        for (Py_ssize_t k = 0; k < n; k++) {
            if (o[R_NEED * n + k] == 0.0)
                continue;
            Py_ssize_t j = slots ? (Py_ssize_t)slots[k] : k;
            PyObject *got = PyObject_CallFunction(wait_of, "nddd", j, o[R_OVER * n + k], column_get(&cols[ACTIVE], j),
                                                  column_get(&cols[CAPACITY], j));
            if (!got)
                goto done;
            const double wait = PyFloat_AsDouble(got);
            Py_DECREF(got);
            if (wait == -1.0 && PyErr_Occurred())
                goto done;
            add_wait(o, n, k, wait, w);
        }
        needing = 0;
    }
    ok = 1;
done:
    for (int i = 0; i < N_COLUMNS; i++)
        column_close(&cols[i]);
    column_close(&shared);
    column_close(&resident);
    column_close(&sel);
    if (out_held)
        PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    return PyLong_FromSsize_t(needing);
}

PyDoc_STRVAR(add_waits_doc,
"add_waits(out, positions, waits, kv_load_weight)\n\n"
"The memory waits ``price`` left to the caller (int64 candidate positions, float64 waits) into ``out``'s rows.");

static PyObject *add_waits(PyObject *self, PyObject *args) {
    PyObject *out_o, *at_o, *waits_o;
    double w;
    if (!PyArg_ParseTuple(args, "OOOd", &out_o, &at_o, &waits_o, &w))
        return NULL;
    Column at, waits;
    Py_buffer out;
    int out_held = 0, ok = 0;
    at.held = waits.held = 0;
    if (column_open(&at, at_o, "positions") < 0 || column_open(&waits, waits_o, "waits") < 0)
        goto done;
    if (at.kind != 'q' || waits.kind != 'd' || column_len(&at) != column_len(&waits)) {
        PyErr_SetString(PyExc_ValueError, "positions (int64) and waits (float64) of one length expected");
        goto done;
    }
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    out_held = 1;
    if (out.ndim != 2 || out.shape[0] != N_ROWS || out.itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "out: float64 with %d rows expected", N_ROWS);
        goto done;
    }
    const Py_ssize_t n = out.shape[1], m = column_len(&at);
    const int64_t *pos = (const int64_t *)at.view.buf;
    const double *wait = (const double *)waits.view.buf;
    for (Py_ssize_t i = 0; i < m; i++)
        if (pos[i] < 0 || pos[i] >= n) {
            PyErr_SetString(PyExc_IndexError, "positions: a candidate out of range");
            goto done;
        }
    for (Py_ssize_t i = 0; i < m; i++)
        add_wait((double *)out.buf, n, (Py_ssize_t)pos[i], wait[i], w);
    ok = 1;
done:
    column_close(&at);
    column_close(&waits);
    if (out_held)
        PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(release_waits_doc,
"release_waits(freed, ends, slots, blocks, now, out)\n\n"
"``FleetColumns.release_waits``' search: for each of ``slots`` (int64 rows of the float64 (workers, width)\n"
"arrays ``freed`` and ``ends``, each row ending in +inf), the first position whose blocks freed reach the\n"
"``blocks`` it lacks (float64), and max(0, the finish time there - now) into ``out`` (float64).");

static PyObject *release_waits(PyObject *self, PyObject *args) {
    PyObject *freed_o, *ends_o, *slots_o, *blocks_o, *out_o;
    double now;
    if (!PyArg_ParseTuple(args, "OOOOdO", &freed_o, &ends_o, &slots_o, &blocks_o, &now, &out_o))
        return NULL;
    Py_buffer freed, ends;
    Column slots, blocks, out;
    int freed_held = 0, ends_held = 0, ok = 0;
    slots.held = blocks.held = out.held = 0;
    if (PyObject_GetBuffer(freed_o, &freed, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    freed_held = 1;
    if (PyObject_GetBuffer(ends_o, &ends, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    ends_held = 1;
    if (freed.ndim != 2 || ends.ndim != 2 || freed.itemsize != 8 || ends.itemsize != 8 ||
        freed.shape[0] != ends.shape[0] || freed.shape[1] != ends.shape[1] || freed.shape[1] < 1 ||
        !freed.format || !ends.format || strcmp(freed.format, "d") || strcmp(ends.format, "d")) {
        PyErr_SetString(PyExc_ValueError, "freed and ends: float64 arrays of one (workers, width) shape expected");
        goto done;
    }
    if (column_open(&slots, slots_o, "slots") < 0 || column_open(&blocks, blocks_o, "blocks") < 0 ||
        column_open(&out, out_o, "out") < 0)
        goto done;
    const Py_ssize_t m = column_len(&slots), rows = freed.shape[0], width = freed.shape[1];
    if (slots.kind != 'q' || blocks.kind != 'd' || out.kind != 'd' || out.view.readonly ||
        column_len(&blocks) != m || column_len(&out) != m) {
        PyErr_SetString(PyExc_ValueError, "slots (int64), blocks and a writable out (float64) of one length expected");
        goto done;
    }
    const int64_t *row_of = (const int64_t *)slots.view.buf;
    for (Py_ssize_t j = 0; j < m; j++)
        if (row_of[j] < 0 || row_of[j] >= rows) {
            PyErr_SetString(PyExc_IndexError, "slots: a row out of range");
            goto done;
        }
    /* the numpy search's steps: bit_length(width - 1) halvings of [0, width - 1], ``freed >= blocks`` moving
     * the top down; the last entry, +inf, is always enough, so the top stays on an entry that is (only a NaN,
     * never enough, would step past the last: it reads the last, the longest wait) */
    int steps = 0;
    for (Py_ssize_t v = width - 1; v; v >>= 1)
        steps++;
    const double *f = (const double *)freed.buf, *e = (const double *)ends.buf, *b = (const double *)blocks.view.buf;
    double *o = (double *)out.view.buf;
    for (Py_ssize_t j = 0; j < m; j++) {
        const double *row = f + row_of[j] * width;
        Py_ssize_t lo = 0, hi = width - 1;
        for (int s = 0; s < steps; s++) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (row[mid] >= b[j])
                hi = mid;
            else
                lo = mid + 1;
        }
        o[j] = np_max(0.0, e[row_of[j] * width + (lo < width ? lo : width - 1)] - now);
    }
    ok = 1;
done:
    column_close(&slots);
    column_close(&blocks);
    column_close(&out);
    if (freed_held)
        PyBuffer_Release(&freed);
    if (ends_held)
        PyBuffer_Release(&ends);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"price", price, METH_VARARGS, price_doc},
    {"add_waits", add_waits, METH_VARARGS, add_waits_doc},
    {"release_waits", release_waits, METH_VARARGS, release_waits_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastobjective",
    "The routing objective's per-candidate arithmetic (router/scheduling/cost.py is the reference).", -1, methods,
};

PyMODINIT_FUNC PyInit__fastobjective(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "ROWS", N_ROWS) < 0 || PyModule_AddIntConstant(m, "COLUMNS", N_COLUMNS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
