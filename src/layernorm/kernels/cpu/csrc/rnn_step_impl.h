/* The LN-LSTM and LN-GRU time-step kernels over one scalar type: included by rnn_step.c with
   scalar_t (float or double), SUF (f32 or f64), EXP and TANH defined; every external name ends in
   _SUF. Argument structs and prototypes come from layernorm_rnn_abi.h (from rnn_abi.py).

   One call does a step's work after the recurrent GEMM, for every row of the step, in one pass per
   row: the layer norm of hp = W_hh h_{t−1} (statistics in float64), the gates, the state update,
   the layer norm of c_t, and the stores backward needs. The backward call does the step's
   pointwise backward including the layer norms' dx. Rows are independent, so they are split
   across `threads` OpenMP threads.

   The optional masks (NULL = off; layernorm.recurrent._options) act inside the step: zoneout
   zh / zc mixes the previous state into the new one, h_t = zh·h_{t−1} + (1 − zh)·h̃_t (h̃_t, c̃_t
   the cell's own, which is what acts / tc / n keep for backward); recurrent dropout cm scales the
   candidate (row i of the state, as h). Backward splits the zoned state's gradient the same way:
   (1 − zh)·dh_t reaches the cell, zh·dh_t goes straight to h_{t−1}. Each row function is
   compiled once per set of masks given (`masks`, a constant bit set per instance): the branches
   on absent masks fold away and the loops vectorize, without masks as before they existed. */

#ifndef RNN_MASK_SWITCH_3
#define MASK_ZH 1
#define MASK_ZC 2
#define MASK_CM 4
/* Call body(A, i, masks) with masks the constant bit set of the masks A gives. */
#define RNN_MASK_SWITCH_2(body, A, i)                               \
    switch (((A)->zh ? MASK_ZH : 0) | ((A)->cm ? MASK_CM : 0)) {    \
    case 0: body(A, i, 0); break;                                   \
    case MASK_ZH: body(A, i, MASK_ZH); break;                       \
    case MASK_CM: body(A, i, MASK_CM); break;                       \
    default: body(A, i, MASK_ZH | MASK_CM); break;                  \
    }
#define RNN_MASK_SWITCH_3(body, A, i)                                                     \
    switch (((A)->zh ? MASK_ZH : 0) | ((A)->zc ? MASK_ZC : 0) | ((A)->cm ? MASK_CM : 0)) { \
    case 0: body(A, i, 0); break;                                                         \
    case 1: body(A, i, 1); break;                                                         \
    case 2: body(A, i, 2); break;                                                         \
    case 3: body(A, i, 3); break;                                                         \
    case 4: body(A, i, 4); break;                                                         \
    case 5: body(A, i, 5); break;                                                         \
    case 6: body(A, i, 6); break;                                                         \
    default: body(A, i, 7); break;                                                        \
    }
#endif

/*

   Per row, layer-norm dx with x̂ = (x − μ)·rstd and g = dy ⊙ w:
   dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂)). */

#define FN(name) RNN_CAT(name, SUF)

static inline void FN(moments)(const scalar_t* x, i64 N, double eps, acc_t* mu, acc_t* r) {
    acc_t s = 0;
    #pragma omp simd reduction(+ : s)
    for (i64 j = 0; j < N; ++j) s += x[j];
    const acc_t m = s / N;
    acc_t v = 0;
    #pragma omp simd reduction(+ : v)
    for (i64 j = 0; j < N; ++j) {
        const acc_t d = x[j] - m;
        v += d * d;
    }
    *mu = m;
    *r = 1.0 / sqrt(v / N + eps);
}

/* dx (+)= rstd·(g − mean(g) − x̂·mean(g⊙x̂)), g = dy⊙w. */
static inline void FN(ln_dx)(const scalar_t* dy, const scalar_t* x, acc_t m, acc_t r,
                             const scalar_t* w, scalar_t* dx, i64 N, int accumulate) {
    acc_t sg = 0, sgx = 0;
    #pragma omp simd reduction(+ : sg, sgx)
    for (i64 j = 0; j < N; ++j) {
        const acc_t g = (acc_t)dy[j] * w[j];
        sg += g;
        sgx += g * ((x[j] - m) * r);
    }
    sg /= N;
    sgx /= N;
    /* Without accumulate, dx is an uninitialized buffer: never read it (0·NaN garbage = NaN). */
    if (!accumulate) {
        #pragma omp simd
        for (i64 j = 0; j < N; ++j) dx[j] = 0;
    }
    #pragma omp simd
    for (i64 j = 0; j < N; ++j) {
        const acc_t g = (acc_t)dy[j] * w[j];
        dx[j] += (scalar_t)(r * (g - sg - ((x[j] - m) * r) * sgx));
    }
}

static inline scalar_t FN(sigm)(scalar_t v) { return (scalar_t)1 / ((scalar_t)1 + EXP(-v)); }

/* LN-LSTM forward of row i (gate order i, f, g, o, torch's). The gains and biases are always
   given (ones / zeros where the layer has none): unconditional loads keep the loops vectorized. */
static inline __attribute__((always_inline)) void FN(lstm_fwd_body)(
    const FN(lstm_fwd_step_args) * A, i64 i, const int masks) {
    const i64 H = A->H, G = 4 * H, row = A->off + i, k = kept_row(A->R, A->N, row, i);
    const int normalize = A->layer_norm;
    const scalar_t* hpr = A->hp + k * G;
    const scalar_t* gxr = A->gx + row * G;
    const scalar_t *w1 = A->w1, *b1 = A->b1, *w3 = A->w3, *b3 = A->b3;
    scalar_t* a = A->acts + k * G;
    acc_t m = 0, r = 1;
    if (normalize) {
        FN(moments)(hpr, G, A->eps, &m, &r);
        A->mh[k] = (scalar_t)m;
        A->rh[k] = (scalar_t)r;
        #pragma omp simd
        for (i64 j = 0; j < G; ++j)
            a[j] = (scalar_t)((hpr[j] - m) * r) * w1[j] + b1[j] + gxr[j];
    } else {
        for (i64 j = 0; j < G; ++j) a[j] = hpr[j] + gxr[j];
    }
    #pragma omp simd
    for (i64 j = 0; j < 2 * H; ++j) a[j] = FN(sigm)(a[j]);
    #pragma omp simd
    for (i64 j = 2 * H; j < 3 * H; ++j) a[j] = TANH(a[j]);
    #pragma omp simd
    for (i64 j = 3 * H; j < G; ++j) a[j] = FN(sigm)(a[j]);
    scalar_t* cs = A->c + i * H;
    scalar_t* cp = A->cprev ? A->cprev + k * H : NULL;
    scalar_t* cnr = A->cn + k * H;
    const scalar_t* cm = (masks & MASK_CM) ? A->cm + i * H : NULL;
    if (cp) memcpy(cp, cs, (size_t)H * sizeof(scalar_t)); /* NULL: c_{t−1} is not kept */
    for (i64 j = 0; j < H; ++j) {
        const scalar_t cand = (masks & MASK_CM) ? a[2 * H + j] * cm[j] : a[2 * H + j];
        cnr[j] = a[H + j] * cs[j] + a[j] * cand;
    }
    scalar_t* tcr = A->tc + k * H;
    scalar_t* hs = A->h + i * H;
    scalar_t* hpv = A->hprev ? A->hprev + k * H : NULL; /* NULL: h_{t-1} is not kept */
    scalar_t* o = A->out + row * H;
    /* LN(c_t) into tc first, then tanh in place: separate loops so each one vectorizes. */
    if (normalize) {
        FN(moments)(cnr, H, A->eps, &m, &r);
        A->mc[k] = (scalar_t)m;
        A->rc[k] = (scalar_t)r;
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) tcr[j] = (scalar_t)((cnr[j] - m) * r) * w3[j] + b3[j];
    } else {
        for (i64 j = 0; j < H; ++j) tcr[j] = cnr[j];
    }
    const scalar_t* cown = A->normalize_cell_state ? tcr : cnr;
    if (masks & MASK_ZC) {
        const scalar_t* zc = A->zc + row * H;
        for (i64 j = 0; j < H; ++j) cs[j] = zc[j] * cs[j] + ((scalar_t)1 - zc[j]) * cown[j];
    } else {
        for (i64 j = 0; j < H; ++j) cs[j] = cown[j];
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) tcr[j] = TANH(tcr[j]);
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    if (hpv) memcpy(hpv, hs, (size_t)H * sizeof(scalar_t));
    for (i64 j = 0; j < H; ++j) {
        const scalar_t hprev = hs[j], own = a[3 * H + j] * tcr[j];
        const scalar_t h = (masks & MASK_ZH) ? zh[j] * hprev + ((scalar_t)1 - zh[j]) * own : own;
        hs[j] = h;
        o[j] = h;
    }
}

static inline void FN(lstm_fwd_row)(const FN(lstm_fwd_step_args) * A, i64 i) {
    RNN_MASK_SWITCH_3(FN(lstm_fwd_body), A, i)
}

int FN(lstm_fwd_step)(const FN(lstm_fwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B) || !kept_rows_valid(a->R, a->N, a->B))
        return RNN_ERR_ROWS;
    #pragma omp parallel for num_threads(a->threads) if (a->threads > 1) schedule(static)
    for (i64 i = 0; i < a->rows; ++i) FN(lstm_fwd_row)(a, i);
    return 0;
}

/* LN-LSTM backward of row i. In: dout (this step's output gradient), dh (gradient of h_t from
   later steps), dc (of the carried c_t). Out: dgates (of the gate pre-activations), dhp (of hp;
   with layer_norm = 0 not written: the caller passes dgates, which it then equals), dlc (of
   LN(c_t)), dc := gradient of c_{t−1}. Without zoneout of h, dh is left for the caller's GEMM to
   overwrite; with it, dh := zh·dh_t, the direct path of h_{t−1}, for the GEMM to add to. With
   zoneout of c, the direct path zc·dc_t waits in the i block of dgates (written last) until
   dc_{t−1} is formed. */
/* The carried c_{t−1} of a row when the forward kept no copy (cprev NULL; the caller asks for it
   only on steps of all B rows with the carried state c_t itself): c0 for the first step's rows,
   else c_t of the step before, B rows earlier forward in time and B rows later in reverse. */
static inline const scalar_t* FN(carried_before)(const FN(lstm_bwd_step_args) * A, i64 row, i64 i) {
    const i64 B = A->B, H = A->H;
    const int first = A->reverse ? row >= A->N - B : row < B;
    return first ? A->c0 + i * H : A->cn + (A->reverse ? row + B : row - B) * H;
}

static inline __attribute__((always_inline)) void FN(lstm_bwd_body)(
    const FN(lstm_bwd_step_args) * A, i64 i, const int masks) {
    const i64 H = A->H, G = 4 * H, row = A->off + i;
    const int normalize = A->layer_norm, carry_norm = A->normalize_cell_state;
    const scalar_t* dout = A->dout + row * H;
    scalar_t* dh = A->dh + i * H;
    scalar_t* dc = A->dc + i * H;
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    const scalar_t* zc = (masks & MASK_ZC) ? A->zc + row * H : NULL;
    const scalar_t* cm = (masks & MASK_CM) ? A->cm + i * H : NULL;
    const scalar_t* a = A->acts + row * G;
    const scalar_t* cp = A->cprev ? A->cprev + row * H : FN(carried_before)(A, row, i);
    const scalar_t* tc = A->tc + row * H;
    scalar_t* dg = A->dgates + row * G;
    scalar_t* dlc = A->dlc + row * H;
    if (masks & MASK_ZC) {
        for (i64 j = 0; j < H; ++j) {
            const scalar_t d = dc[j];
            dg[j] = zc[j] * d;
            dc[j] = ((scalar_t)1 - zc[j]) * d;
        }
    }
    if (masks & MASK_ZH) {
        for (i64 j = 0; j < H; ++j) {
            const scalar_t d = dh[j] + dout[j];
            dh[j] = zh[j] * d;
            dlc[j] = ((scalar_t)1 - zh[j]) * d; /* the cell's dh̃_t, read back just below */
        }
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dht = (masks & MASK_ZH) ? dlc[j] : dh[j] + dout[j];
        const scalar_t o = a[3 * H + j], t = tc[j];
        dg[3 * H + j] = dht * t * o * ((scalar_t)1 - o);
        scalar_t d = dht * o * ((scalar_t)1 - t * t);
        if (carry_norm) d += dc[j];
        dlc[j] = d;
    }
    if (normalize) {
        FN(ln_dx)(dlc, A->cn + row * H, A->mc[row], A->rc[row], A->w3, dc, H, !carry_norm);
    } else {
        for (i64 j = 0; j < H; ++j) dc[j] = dlc[j] + (carry_norm ? (scalar_t)0 : dc[j]);
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dcn = dc[j];
        const scalar_t ig = a[j], fg = a[H + j], gg = a[2 * H + j];
        const scalar_t m = (masks & MASK_CM) ? cm[j] : (scalar_t)1;
        const scalar_t direct = (masks & MASK_ZC) ? dg[j] : (scalar_t)0;
        dg[j] = dcn * (gg * m) * ig * ((scalar_t)1 - ig);
        dg[H + j] = dcn * cp[j] * fg * ((scalar_t)1 - fg);
        dg[2 * H + j] = dcn * (ig * m) * ((scalar_t)1 - gg * gg);
        dc[j] = dcn * fg + direct;
    }
    if (normalize)
        FN(ln_dx)(dg, A->hp + row * G, A->mh[row], A->rh[row], A->w1, A->dhp + row * G, G, 0);
}

static inline void FN(lstm_bwd_row)(const FN(lstm_bwd_step_args) * A, i64 i) {
    RNN_MASK_SWITCH_3(FN(lstm_bwd_body), A, i)
}

int FN(lstm_bwd_step)(const FN(lstm_bwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B) ||
        !carried_before_valid(a->cprev, a->c0, a->off, a->rows, a->N, a->B))
        return RNN_ERR_ROWS;
    #pragma omp parallel for num_threads(a->threads) if (a->threads > 1) schedule(static)
    for (i64 i = 0; i < a->rows; ++i) FN(lstm_bwd_row)(a, i);
    return 0;
}

/* LN-GRU forward of row i (gates r, z, n; torch's layout). hp = W_hh h_{t−1} (raw), gx = LN(W_ih x)
   + b_ih + [b_hr, b_hz, 0]. The (r, z) block and the n block of hp get separate layer norms. b_hn
   and the gains and biases are always given (ones / zeros where the layer has none). */
static inline __attribute__((always_inline)) void FN(gru_fwd_body)(
    const FN(gru_fwd_step_args) * A, i64 i, const int masks) {
    const i64 H = A->H, G = 3 * H, row = A->off + i, k = kept_row(A->R, A->N, row, i);
    const scalar_t* hp = A->hp + k * G;
    const scalar_t* gx = A->gx + row * G;
    const scalar_t *w_rz = A->w_rz, *b_rz = A->b_rz, *w_n = A->w_n, *b_n = A->b_n;
    const scalar_t* b_hn = A->b_hn;
    scalar_t* rz = A->rz + k * 2 * H;
    scalar_t* ghn = A->ghn + k * H;
    scalar_t* n = A->n + k * H;
    scalar_t* hs = A->h + i * H;
    scalar_t* hpv = A->hprev ? A->hprev + k * H : NULL; /* NULL: h_{t-1} is not kept */
    scalar_t* o = A->out + row * H;
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    const scalar_t* cm = (masks & MASK_CM) ? A->cm + i * H : NULL;
    if (A->layer_norm) {
        acc_t m1, r1, m2, r2;
        FN(moments)(hp, 2 * H, A->eps, &m1, &r1);
        FN(moments)(hp + 2 * H, H, A->eps, &m2, &r2);
        A->mh[k] = (scalar_t)m1;
        A->rh[k] = (scalar_t)r1;
        A->mn[k] = (scalar_t)m2;
        A->rn[k] = (scalar_t)r2;
        #pragma omp simd
        for (i64 j = 0; j < 2 * H; ++j)
            rz[j] = FN(sigm)((scalar_t)((hp[j] - m1) * r1) * w_rz[j] + b_rz[j] + gx[j]);
        #pragma omp simd
        for (i64 j = 0; j < H; ++j)
            ghn[j] = (scalar_t)((hp[2 * H + j] - m2) * r2) * w_n[j] + b_n[j] + b_hn[j];
    } else {
        #pragma omp simd
        for (i64 j = 0; j < 2 * H; ++j) rz[j] = FN(sigm)(hp[j] + gx[j]);
        #pragma omp simd
        for (i64 j = 0; j < H; ++j) ghn[j] = hp[2 * H + j] + b_hn[j];
    }
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t v = ghn[j];
        const scalar_t nv = TANH(gx[2 * H + j] + rz[j] * v);
        n[j] = nv;
        const scalar_t hprev = hs[j];
        hpv[j] = hprev;
        const scalar_t nm = (masks & MASK_CM) ? nv * cm[j] : nv;
        const scalar_t own = nm + rz[H + j] * (hprev - nm);
        const scalar_t h = (masks & MASK_ZH) ? zh[j] * hprev + ((scalar_t)1 - zh[j]) * own : own;
        hs[j] = h;
        o[j] = h;
    }
}

static inline void FN(gru_fwd_row)(const FN(gru_fwd_step_args) * A, i64 i) {
    RNN_MASK_SWITCH_2(FN(gru_fwd_body), A, i)
}

int FN(gru_fwd_step)(const FN(gru_fwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B) || !kept_rows_valid(a->R, a->N, a->B))
        return RNN_ERR_ROWS;
    #pragma omp parallel for num_threads(a->threads) if (a->threads > 1) schedule(static)
    for (i64 i = 0; i < a->rows; ++i) FN(gru_fwd_row)(a, i);
    return 0;
}

/* LN-GRU backward of row i. Out: dgx (of the input-side pre-activations), dgh (of LN(hp_rz) and of
   LN(hp_n) + b_hn), dhp (of hp; with layer_norm = 0 not written: the caller passes dgh, which it
   then equals), and dh := the part of the gradient of h_{t−1} that bypasses W_hh (the caller adds
   dhp·W_hh). */
static inline __attribute__((always_inline)) void FN(gru_bwd_body)(
    const FN(gru_bwd_step_args) * A, i64 i, const int masks) {
    const i64 H = A->H, G = 3 * H, row = A->off + i;
    const scalar_t* dout = A->dout + row * H;
    scalar_t* dh = A->dh + i * H;
    const scalar_t* hpv = A->hprev + row * H;
    const scalar_t* rz = A->rz + row * 2 * H;
    const scalar_t* n = A->n + row * H;
    const scalar_t* ghn = A->ghn + row * H;
    scalar_t* dgx = A->dgx + row * G;
    scalar_t* dgh = A->dgh + row * G;
    const scalar_t* zh = (masks & MASK_ZH) ? A->zh + row * H : NULL;
    const scalar_t* cm = (masks & MASK_CM) ? A->cm + i * H : NULL;
    #pragma omp simd
    for (i64 j = 0; j < H; ++j) {
        const scalar_t dzoned = dh[j] + dout[j];
        const scalar_t dht = (masks & MASK_ZH) ? ((scalar_t)1 - zh[j]) * dzoned : dzoned;
        const scalar_t r = rz[j], z = rz[H + j], nv = n[j];
        const scalar_t m = (masks & MASK_CM) ? cm[j] : (scalar_t)1;
        const scalar_t dn = dht * ((scalar_t)1 - z) * ((scalar_t)1 - nv * nv) * m;
        const scalar_t dr = dn * ghn[j] * r * ((scalar_t)1 - r);
        const scalar_t dz = dht * (hpv[j] - nv * m) * z * ((scalar_t)1 - z);
        dgx[j] = dr;
        dgx[H + j] = dz;
        dgx[2 * H + j] = dn;
        dgh[j] = dr;
        dgh[H + j] = dz;
        dgh[2 * H + j] = dn * r;
        dh[j] = (masks & MASK_ZH) ? dht * z + zh[j] * dzoned : dht * z;
    }
    if (A->layer_norm) {
        const scalar_t* hp = A->hp + row * G;
        scalar_t* dhp = A->dhp + row * G;
        FN(ln_dx)(dgh, hp, A->mh[row], A->rh[row], A->w_rz, dhp, 2 * H, 0);
        FN(ln_dx)(dgh + 2 * H, hp + 2 * H, A->mn[row], A->rn[row], A->w_n, dhp + 2 * H, H, 0);
    }
}

static inline void FN(gru_bwd_row)(const FN(gru_bwd_step_args) * A, i64 i) {
    RNN_MASK_SWITCH_2(FN(gru_bwd_body), A, i)
}

int FN(gru_bwd_step)(const FN(gru_bwd_step_args) * a) {
    if (!rows_in_range(a->off, a->rows, a->N, a->B)) return RNN_ERR_ROWS;
    #pragma omp parallel for num_threads(a->threads) if (a->threads > 1) schedule(static)
    for (i64 i = 0; i < a->rows; ++i) FN(gru_bwd_row)(a, i);
    return 0;
}

#undef FN
