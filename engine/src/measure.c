/*
 * measure.c - the measurement protocol: warm-up, rounds, stop rules and the
 * statistics of the rounds.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void tw_measure_config_default(tw_measure_config *cfg)
{
    if (cfg == NULL) {
        goto cleanup;
    }
    cfg->warmup_min = 2;
    cfg->warmup_max = 20;
    cfg->warmup_patience = 2;
    cfg->warmup_gain = 0.02;
    cfg->rounds_min = 5;
    cfg->rounds_max = 50;
    cfg->rel_spread = 0.05;
    cfg->time_cap_ns = 5000000000ull;
    cfg->stop_when_decided = 1;
    cfg->settle = 1;
    cfg->round_min_ns = 0;
cleanup:
    return;
}

tw_code tw_measure_config_check(const tw_measure_config *cfg, tw_error *err)
{
    tw_code rc = TW_OK;

    if (cfg->rounds_min == 0) {
        rc = tw_error_set(err, TW_EINVAL,
                          "rounds_min is 0: at least one measured round is needed");
    } else if (cfg->rounds_min > cfg->rounds_max) {
        rc = tw_error_set(err, TW_EINVAL,
                          "rounds_min (%u) is greater than rounds_max (%u): lower rounds_min "
                          "or raise rounds_max", (unsigned)cfg->rounds_min,
                          (unsigned)cfg->rounds_max);
    } else if (cfg->warmup_min > cfg->warmup_max) {
        rc = tw_error_set(err, TW_EINVAL,
                          "warmup_min (%u) is greater than warmup_max (%u): lower warmup_min "
                          "or raise warmup_max", (unsigned)cfg->warmup_min,
                          (unsigned)cfg->warmup_max);
    } else if (isnan(cfg->warmup_gain) || cfg->warmup_gain < 0) {
        rc = tw_error_set(err, TW_EINVAL,
                          "warmup_gain (%g) must be a fraction >= 0, such as 0.02",
                          cfg->warmup_gain);
    } else if (cfg->settle > TW_SETTLE_MAX) {
        rc = tw_error_set(err, TW_EINVAL,
                          "settle (%u) is more than %u untimed calls per round: the time cap "
                          "is checked between rounds only; use 0 to %u",
                          (unsigned)cfg->settle, (unsigned)TW_SETTLE_MAX, (unsigned)TW_SETTLE_MAX);
    } else if (cfg->round_min_ns > TW_ROUND_MIN_MAX_NS) {
        rc = tw_error_set(err, TW_EINVAL,
                          "round_min (%.3g s) is longer than %.0f s: the time cap is checked "
                          "between rounds only; use 0 to %.0f s", cfg->round_min_ns / 1e9,
                          TW_ROUND_MIN_MAX_NS / 1e9, TW_ROUND_MIN_MAX_NS / 1e9);
    } else if (isnan(cfg->rel_spread) || cfg->rel_spread < 0) {
        rc = tw_error_set(err, TW_EINVAL,
                          "rel_spread (%g) must be a fraction >= 0, such as 0.05",
                          cfg->rel_spread);
    }
    return rc;
}

/* ------------------------------------------------------------- statistics */

static int tw_compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a;
    double y = *(const double *)b;

    return (x > y) - (x < y);
}

/* Linear interpolation between the two sorted values around p * (n - 1). */
static double tw_quantile(const double *sorted, size_t n, double p)
{
    double h = p * (double)(n - 1);
    size_t lo = (size_t)floor(h);
    double value;

    TW_ASSERT(n > 0 && p >= 0.0 && p <= 1.0 && lo < n);
    value = sorted[lo];
    TW_ASSERT(lo + 1 >= n || sorted[lo] <= sorted[lo + 1]);

    if (lo + 1 < n) {
        value += (h - (double)lo) * (sorted[lo + 1] - sorted[lo]);
    }
    return value;
}

void tw_stats_fill(double *values, size_t n, tw_stats *out)
{
    double iqr;

    qsort(values, n, sizeof *values, tw_compare_doubles);
    out->min_ns = values[0];
    out->q25_ns = tw_quantile(values, n, 0.25);
    out->median_ns = tw_quantile(values, n, 0.5);
    out->q75_ns = tw_quantile(values, n, 0.75);
    iqr = out->q75_ns - out->q25_ns;
    /* A zero median (a clock too coarse to see the call) is only quiet when
     * every round read the same. */
    if (out->median_ns > 0) {
        out->spread = iqr / out->median_ns;
    } else {
        out->spread = iqr > 0 ? INFINITY : 0.0;
    }
}

/* ------------------------------------------------------------------ rounds */

static tw_code tw_sync_runner(const tw_runner *runner, size_t sample, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_error cb_err;
    char what[96];

    if (runner->sync == NULL) {
        goto cleanup;
    }
    tw_error_clear(&cb_err);
    rc = runner->sync(runner->ctx, &cb_err);
    if (rc != TW_OK) {
        snprintf(what, sizeof what, "synchronising the device around sample %zu", sample);
        tw_error_forward(err, rc, &cb_err, what);
    }
cleanup:
    return rc;
}

/* One pass over the samples, each timed as sync, clock, run, sync, clock;
 * their times added to *total. */
static tw_code tw_run_pass(const tw_host *host, const tw_runner *runner, double *total,
                           tw_error *err)
{
    tw_code rc = TW_OK;
    tw_error cb_err;
    uint64_t t0;
    uint64_t t1;
    char what[64];
    size_t i;

    for (i = 0; i < runner->n_samples; i++) {
        rc = tw_sync_runner(runner, i, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        t0 = tw_host_now(host);
        tw_error_clear(&cb_err);
        rc = runner->run(runner->ctx, i, &cb_err);
        if (rc != TW_OK) {
            snprintf(what, sizeof what, "run of sample %zu", i);
            tw_error_forward(err, rc, &cb_err, what);
            goto cleanup;
        }
        rc = tw_sync_runner(runner, i, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        t1 = tw_host_now(host);
        *total += t1 > t0 ? (double)(t1 - t0) : 0.0;
    }
cleanup:
    return rc;
}

/* One round: `settle` untimed calls of sample 0, then every sample once, and
 * again while the timed calls took less than `round_min_ns` together (see
 * tw_measure_config). *value gets the mean latency per timed call. */
static tw_code tw_run_round(const tw_host *host, const tw_runner *runner, uint32_t settle,
                            uint64_t round_min_ns, double *value, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_error cb_err;
    double total = 0.0;
    double before;
    uint32_t passes = 0;
    size_t i;

    if (runner->round != NULL) {
        tw_error_clear(&cb_err);
        rc = runner->round(runner->ctx, &cb_err);
        if (rc != TW_OK) {
            tw_error_forward(err, rc, &cb_err, "preparing a round");
            goto cleanup;
        }
    }
    for (i = 0; i < settle; i++) {
        tw_error_clear(&cb_err);
        rc = runner->run(runner->ctx, 0, &cb_err);
        if (rc != TW_OK) {
            tw_error_forward(err, rc, &cb_err, "untimed call opening a round");
            goto cleanup;
        }
    }
    do {
        before = total;
        rc = tw_run_pass(host, runner, &total, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        passes++;
    } while (total < (double)round_min_ns && total > before && passes < TW_ROUND_PASSES_MAX);
    *value = total / ((double)runner->n_samples * passes);
cleanup:
    return rc;
}

static uint64_t tw_elapsed(const tw_host *host, uint64_t start)
{
    uint64_t now = tw_host_now(host);

    return now > start ? now - start : 0;
}

/* Warm-up runs rounds until `patience` rounds in a row were not faster than
 * (1 - gain) times the best so far; the first round always counts as faster. */
static tw_code tw_warm_up(const tw_host *host, const tw_runner *runner,
                          const tw_measure_config *cfg, uint32_t *rounds, tw_error *err)
{
    tw_code rc = TW_OK;
    uint64_t start = tw_host_now(host);
    double best = 0.0;
    double value = 0.0;
    uint32_t calm = 0;
    uint32_t w = 0;

    while (w < cfg->warmup_max) {
        if (w >= cfg->warmup_min && calm >= cfg->warmup_patience) {
            break;
        }
        if (cfg->time_cap_ns != 0 && tw_elapsed(host, start) >= cfg->time_cap_ns) {
            break;
        }
        rc = tw_run_round(host, runner, 0, cfg->round_min_ns, &value, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        w++;
        if (w == 1 || value < best * (1.0 - cfg->warmup_gain)) {
            calm = 0;
        } else {
            calm++;
        }
        if (w == 1 || value < best) {
            best = value;
        }
    }
cleanup:
    *rounds = w;
    return rc;
}

/* The round values of n runners, one row of `cap` values per runner. */
typedef struct tw_series {
    double *values;
    double *scratch;
    size_t cap;
} tw_series;

static tw_code tw_grow_series(const tw_host *host, tw_series *s, size_t n, size_t need,
                              uint32_t rounds_max, tw_error *err)
{
    tw_code rc = TW_OK;
    double *values = NULL;
    double *scratch = NULL;
    size_t cap;
    size_t i;

    if (need <= s->cap) {
        goto cleanup;
    }
    /* Grow by doubling, never past rounds_max: a huge rounds_max that the
     * stop rule never reaches must not cost its memory up front. */
    cap = s->cap == 0 ? 16 : s->cap * 2;
    cap = cap > rounds_max ? rounds_max : cap;
    cap = cap < need ? need : cap;
    if (n <= (size_t)-1 / cap) {
        values = tw_host_alloc_array(host, n * cap, sizeof *values);
        scratch = tw_host_alloc_array(host, cap, sizeof *scratch);
    }
    if (values == NULL || scratch == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory keeping %zu measured rounds", cap);
        goto error;
    }
    for (i = 0; i < n && s->values != NULL; i++) {
        memcpy(values + i * cap, s->values + i * s->cap, s->cap * sizeof *values);
    }
    tw_host_release(host, s->values);
    tw_host_release(host, s->scratch);
    s->values = values;
    s->scratch = scratch;
    s->cap = cap;
    goto cleanup;
error:
    tw_host_release(host, values);
    tw_host_release(host, scratch);
cleanup:
    return rc;
}

/* Statistics of runner i's first `rounds` values, without touching them. */
static void tw_series_stats(tw_series *s, size_t i, size_t rounds, tw_stats *out)
{
    memcpy(s->scratch, s->values + i * s->cap, rounds * sizeof *s->scratch);
    tw_stats_fill(s->scratch, rounds, out);
}

/* 1 when one runner is clearly the fastest: the one with the lowest median
 * has its q75 below every other runner's q25. */
static int tw_decided(const tw_stats *stats, size_t n)
{
    size_t best = 0;
    size_t i;

    for (i = 1; i < n; i++) {
        if (stats[i].median_ns < stats[best].median_ns) {
            best = i;
        }
    }
    for (i = 0; i < n; i++) {
        if (i != best && !(stats[best].q75_ns < stats[i].q25_ns)) {
            return 0;
        }
    }
    return 1;
}

static tw_code tw_check_runners(const tw_runner *runners, size_t n, size_t *failed,
                                tw_error *err)
{
    tw_code rc = TW_OK;
    size_t i;

    for (i = 0; i < n; i++) {
        if (runners[i].run == NULL) {
            rc = tw_error_set(err, TW_EINVAL, "runner %zu has no run function", i);
        } else if (runners[i].n_samples == 0) {
            rc = tw_error_set(err, TW_EINVAL,
                              "runner %zu has no samples: the dataset is empty, give it "
                              "at least one sample", i);
        }
        if (rc != TW_OK) {
            *failed = i;
            break;
        }
    }
    return rc;
}

/* Whether the measurement stops after `rounds` rounds of `series`, and why
 * (*stop): every runner's spread within the config's (out[] holds their
 * figures so far), a comparison decided, the rounds' cap, the time cap
 * (cap_ns from start, 0 for none). 0: another round. */
static int tw_stop_after(const tw_host *host, tw_series *series, size_t n,
                         uint32_t rounds, const tw_measure_config *cfg, uint64_t start,
                         uint64_t cap_ns, tw_stats *out, tw_stop *stop)
{
    int quiet, done = 1;
    size_t i;

    if (rounds >= cfg->rounds_min) {
        quiet = 1;
        for (i = 0; i < n; i++) {
            tw_series_stats(series, i, rounds, &out[i]);
            quiet = quiet && out[i].spread <= cfg->rel_spread;
        }
        if (quiet) {
            *stop = TW_STOP_SPREAD;
            goto done;
        }
        if (n >= 2 && cfg->stop_when_decided && tw_decided(out, n)) {
            *stop = TW_STOP_DECIDED;
            goto done;
        }
    }
    if (rounds >= cfg->rounds_max) {
        *stop = TW_STOP_ROUNDS;
        goto done;
    }
    if (cap_ns != 0 && tw_elapsed(host, start) >= cap_ns) {
        *stop = TW_STOP_TIME;
        goto done;
    }
    done = 0;
done:
    return done;
}

tw_code tw_measure_runners(const tw_host *host, const tw_runner *runners, size_t n,
                           const tw_measure_config *cfg, tw_stats *out,
                           size_t *failed, tw_error *err)
{
    tw_code rc;
    tw_series series = {NULL, NULL, 0};
    uint64_t start = tw_host_now(host);
    uint64_t cap_ns = cfg->time_cap_ns;
    uint32_t rounds = 0;
    tw_stop stop = TW_STOP_ROUNDS;
    size_t i;

    *failed = TW_NO_RUNNER;
    rc = tw_measure_config_check(cfg, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    rc = tw_check_runners(runners, n, failed, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    /* n runners share n caps; saturate rather than wrap. */
    cap_ns = (cap_ns != 0 && n > UINT64_MAX / cap_ns) ? UINT64_MAX : cap_ns * n;
    memset(out, 0, n * sizeof *out);
    for (i = 0; i < n; i++) {
        rc = tw_warm_up(host, &runners[i], cfg, &out[i].warmup_rounds, err);
        if (rc != TW_OK) {
            *failed = i;
            goto cleanup;
        }
    }
    for (;;) {
        rc = tw_grow_series(host, &series, n, (size_t)rounds + 1, cfg->rounds_max, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        /* Interleaved: drift in the clock falls on every runner alike; each
         * round opened by untimed calls, so none is timed in another's wake. */
        for (i = 0; i < n; i++) {
            rc = tw_run_round(host, &runners[i], n >= 2 ? cfg->settle : 0, cfg->round_min_ns,
                              &series.values[i * series.cap + rounds], err);
            if (rc != TW_OK) {
                *failed = i;
                goto cleanup;
            }
        }
        rounds++;
        if (tw_stop_after(host, &series, n, rounds, cfg, start, cap_ns, out, &stop)) {
            break;
        }
    }
    for (i = 0; i < n; i++) {
        tw_series_stats(&series, i, rounds, &out[i]);
        out[i].rounds = rounds;
        out[i].stopped_by = stop;
    }
cleanup:
    tw_host_release(host, series.values);
    tw_host_release(host, series.scratch);
    return rc;
}

tw_code tw_measure(const tw_host *host, const tw_runner *runner,
                   const tw_measure_config *cfg, tw_stats *out, tw_error *err)
{
    return tw_measure_compare(host, runner, 1, cfg, out, err);
}

tw_code tw_measure_compare(const tw_host *host, const tw_runner *runners, size_t n,
                           const tw_measure_config *cfg, tw_stats *out, tw_error *err)
{
    tw_code rc;
    tw_host resolved;
    tw_measure_config defaults;
    size_t failed;

    tw_host_resolve(host, &resolved);
    if (runners == NULL || out == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "%s is NULL", runners == NULL ? "runner" : "out");
        goto cleanup;
    }
    if (n == 0) {
        rc = tw_error_set(err, TW_EINVAL, "no runners to measure: pass at least one");
        goto cleanup;
    }
    if (cfg == NULL) {
        tw_measure_config_default(&defaults);
        cfg = &defaults;
    }
    rc = tw_measure_runners(&resolved, runners, n, cfg, out, &failed, err);
cleanup:
    return rc;
}

/* ------------------------------------------------------------ paired rounds */

void tw_paired_config_default(tw_paired_config *cfg)
{
    if (cfg == NULL) {
        goto cleanup;
    }
    cfg->rounds_min = 10;
    cfg->rounds_max = 400;
    cfg->width = 0.10;
    cfg->time_cap_ns = 0;
cleanup:
    return;
}

tw_code tw_paired_config_check(const tw_paired_config *cfg, tw_error *err)
{
    tw_code rc = TW_OK;

    if (cfg->rounds_min < TW_PAIRED_ROUNDS_MIN) {
        rc = tw_error_set(err, TW_EINVAL,
                          "paired rounds_min (%u) is under %u: a 99 %% interval needs %u pairs "
                          "at least", (unsigned)cfg->rounds_min, (unsigned)TW_PAIRED_ROUNDS_MIN,
                          (unsigned)TW_PAIRED_ROUNDS_MIN);
    } else if (cfg->rounds_max < cfg->rounds_min || cfg->rounds_max > TW_PAIRED_ROUNDS_MAX) {
        rc = tw_error_set(err, TW_EINVAL,
                          "paired rounds_max (%u) must lie from rounds_min (%u) to %u",
                          (unsigned)cfg->rounds_max, (unsigned)cfg->rounds_min,
                          (unsigned)TW_PAIRED_ROUNDS_MAX);
    } else if (isnan(cfg->width) || cfg->width <= 0) {
        rc = tw_error_set(err, TW_EINVAL, "paired width (%g) must be a fraction > 0, such as 0.1",
                          cfg->width);
    }
    return rc;
}

size_t tw_sign_rank(size_t n)
{
    double pmf = ldexp(1.0, -(int)n);
    double cdf = 0.0;
    size_t k = 0;
    size_t j;

    for (j = 0; j < n; j++) {
        cdf += pmf;
        if (cdf > 0.005) {
            break;
        }
        k = j + 1;
        pmf = pmf * (double)(n - j) / (double)(j + 1);
    }
    return k;
}

double tw_paired_ratio(double first, double second)
{
    if (second > 0.0) {
        return first / second;
    }
    return first > 0.0 ? INFINITY : 1.0;
}

void tw_paired_fill(double *ratios, size_t n, tw_paired *out)
{
    size_t k;

    qsort(ratios, n, sizeof *ratios, tw_compare_doubles);
    out->ratio = tw_quantile(ratios, n, 0.5);
    k = tw_sign_rank(n);
    out->low = k > 0 ? ratios[k - 1] : 0.0;
    out->high = k > 0 ? ratios[n - k] : INFINITY;
}

/* One pair: both runners' rounds, in the order `flip` says, each opened by
 * cfg->settle untimed calls and as long as cfg->round_min_ns. */
static tw_code tw_run_pair(const tw_host *host, const tw_runner *runners,
                           const tw_measure_config *cfg, int flip, double value[2],
                           size_t *failed, tw_error *err)
{
    tw_code rc = TW_OK;
    size_t k;
    size_t i;

    for (k = 0; k < 2; k++) {
        i = flip ? 1 - k : k;
        rc = tw_run_round(host, &runners[i], cfg->settle, cfg->round_min_ns, &value[i], err);
        if (rc != TW_OK) {
            *failed = i;
            break;
        }
    }
    return rc;
}

static tw_stop tw_paired_stop(const tw_paired *p, const tw_paired_config *pcfg, uint32_t pairs,
                              uint64_t elapsed, int *stop)
{
    *stop = 1;
    if (p->low > 1.0 || p->high < 1.0) {
        return TW_STOP_DECIDED;
    }
    if (p->high <= p->low * (1.0 + pcfg->width)) {
        return TW_STOP_SPREAD;
    }
    if (pairs >= pcfg->rounds_max) {
        return TW_STOP_ROUNDS;
    }
    if (pcfg->time_cap_ns != 0 && elapsed >= pcfg->time_cap_ns) {
        return TW_STOP_TIME;
    }
    *stop = 0;
    return TW_STOP_ROUNDS;
}

tw_code tw_measure_pairs(const tw_host *host, const tw_runner *runners,
                         const tw_measure_config *cfg, const tw_paired_config *pcfg,
                         tw_paired *out, size_t *failed, tw_error *err)
{
    tw_code rc;
    tw_series series = {NULL, NULL, 0};
    double *ratios = NULL;
    uint64_t start = tw_host_now(host);
    uint32_t pairs = 0;
    double value[2];
    size_t i;
    int stop = 0;

    *failed = TW_NO_RUNNER;
    memset(out, 0, sizeof *out);
    rc = tw_measure_config_check(cfg, err);
    if (rc == TW_OK) {
        rc = tw_paired_config_check(pcfg, err);
    }
    if (rc == TW_OK) {
        rc = tw_check_runners(runners, 2, failed, err);
    }
    if (rc != TW_OK) {
        goto cleanup;
    }
    ratios = tw_host_alloc_array(host, pcfg->rounds_max, sizeof *ratios);
    rc = tw_grow_series(host, &series, 3, pcfg->rounds_max, pcfg->rounds_max, err);
    if (rc != TW_OK || ratios == NULL) {
        rc = rc != TW_OK ? rc : tw_error_set(err, TW_ENOMEM, "out of memory keeping %u paired "
                                             "rounds", (unsigned)pcfg->rounds_max);
        goto cleanup;
    }
    for (i = 0; i < 2; i++) {
        rc = tw_warm_up(host, &runners[i], cfg, &out->stats[i].warmup_rounds, err);
        if (rc != TW_OK) {
            *failed = i;
            goto cleanup;
        }
    }
    while (!stop) {
        /* the order alternates, so that neither runner always follows the other */
        rc = tw_run_pair(host, runners, cfg, (int)(pairs & 1u), value, failed, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        series.values[pairs] = value[0];
        series.values[series.cap + pairs] = value[1];
        series.values[2 * series.cap + pairs] = tw_paired_ratio(value[0], value[1]);
        out->wins += value[1] < value[0];
        pairs++;
        if (pairs >= pcfg->rounds_min) {
            memcpy(ratios, series.values + 2 * series.cap, pairs * sizeof *ratios);
            tw_paired_fill(ratios, pairs, out);
            out->stopped_by = tw_paired_stop(out, pcfg, pairs, tw_elapsed(host, start), &stop);
        }
    }
    for (i = 0; i < 2; i++) {
        tw_series_stats(&series, i, pairs, &out->stats[i]);
        out->stats[i].rounds = pairs;
        out->stats[i].stopped_by = out->stopped_by;
    }
    out->rounds = pairs;
cleanup:
    tw_host_release(host, ratios);
    tw_host_release(host, series.values);
    tw_host_release(host, series.scratch);
    return rc;
}

tw_code tw_measure_paired(const tw_host *host, const tw_runner *runners,
                          const tw_measure_config *cfg, const tw_paired_config *pcfg,
                          tw_paired *out, tw_error *err)
{
    tw_code rc;
    tw_host resolved;
    tw_measure_config defaults;
    tw_paired_config paired_defaults;
    size_t failed;

    tw_host_resolve(host, &resolved);
    if (runners == NULL || out == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "%s is NULL", runners == NULL ? "runners" : "out");
        goto cleanup;
    }
    if (cfg == NULL) {
        tw_measure_config_default(&defaults);
        cfg = &defaults;
    }
    if (pcfg == NULL) {
        tw_paired_config_default(&paired_defaults);
        pcfg = &paired_defaults;
    }
    rc = tw_measure_pairs(&resolved, runners, cfg, pcfg, out, &failed, err);
cleanup:
    return rc;
}
