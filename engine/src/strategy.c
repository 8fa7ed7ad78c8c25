/*
 * strategy.c - the strategies' decision rules: which backend a module keeps.
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

const char *tw_strategy_name(tw_strategy_kind kind)
{
    const char *name = NULL;

    switch (kind) {
    case TW_STRATEGY_FIRST_WINS: name = "first-wins"; break;
    case TW_STRATEGY_HIGHEST_THROUGHPUT: name = "highest-throughput"; break;
    case TW_STRATEGY_ONE_BACKEND: name = "one-backend"; break;
    }
    return name;
}

static const char *tw_candidate_label(const tw_candidate *cand)
{
    return cand->name != NULL ? cand->name : "(unnamed)";
}

/* The report keeps its own copy: the user reads it after every callback
 * error slot is gone. */
static void tw_mark_failed(tw_candidate_report *report, const tw_error *cause)
{
    report->state = TW_CAND_FAILED;
    snprintf(report->msg, sizeof report->msg, "%s", cause->msg);
}

/* Builds candidate i. A rejection marks it FAILED and is not an error of the
 * call; only TW_EINTERRUPT is returned. */
static tw_code tw_build_candidate(const tw_candidate *cand, tw_candidate_report *report,
                                  int *built, tw_error *err)
{
    tw_code rc;
    tw_error cb_err;
    tw_error cause;
    char what[TW_MSG_SIZE];

    *built = 0;
    tw_error_clear(&cb_err);
    rc = cand->build(cand->ctx, &cb_err);
    if (rc == TW_OK) {
        report->state = TW_CAND_BUILT;
        *built = 1;
        goto cleanup;
    }
    snprintf(what, sizeof what, "building backend %s", tw_candidate_label(cand));
    tw_error_forward(&cause, rc, &cb_err, what);
    tw_mark_failed(report, &cause);
    if (rc == TW_EINTERRUPT) {
        tw_error_set(err, rc, "%s", cause.msg);
        goto cleanup;
    }
    rc = TW_OK;
cleanup:
    return rc;
}

static tw_code tw_choose_first(const tw_candidate *cands, size_t n, long *chosen,
                               tw_candidate_report *reports, tw_error *err)
{
    tw_code rc = TW_OK;
    int built = 0;
    size_t i;

    for (i = 0; i < n && !built; i++) {
        rc = tw_build_candidate(&cands[i], &reports[i], &built, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        if (built) {
            *chosen = (long)i;
        }
    }
cleanup:
    return rc;
}

/* Measures the built candidates side by side; a candidate whose measurement
 * fails is marked FAILED and the rest are measured again without it. */
static tw_code tw_choose_fastest(const tw_host *host, const tw_candidate *cands, size_t n,
                                 const tw_measure_config *cfg, long *chosen,
                                 tw_candidate_report *reports, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_runner *runners = NULL;
    tw_stats *stats = NULL;
    size_t *which = NULL;
    size_t count = 0;
    size_t failed;
    size_t i;
    int built;
    tw_error cause;

    /* Allocated before any build, so running out of memory never strands
     * a built backend halfway through the rule. */
    runners = tw_host_alloc_array(host, n, sizeof *runners);
    stats = tw_host_alloc_array(host, n, sizeof *stats);
    which = tw_host_alloc_array(host, n, sizeof *which);
    if (runners == NULL || stats == NULL || which == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory choosing among %zu backends", n);
        goto cleanup;
    }
    for (i = 0; i < n; i++) {
        rc = tw_build_candidate(&cands[i], &reports[i], &built, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        if (built) {
            which[count++] = i;
        }
    }
    while (count > 0) {
        for (i = 0; i < count; i++) {
            runners[i] = cands[which[i]].runner;
        }
        rc = tw_measure_runners(host, runners, count, cfg, stats, &failed, &cause);
        if (rc == TW_OK) {
            break;
        }
        if (rc == TW_EINTERRUPT || failed == TW_NO_RUNNER) {
            tw_error_set(err, rc, "%s", cause.msg);
            goto cleanup;
        }
        tw_mark_failed(&reports[which[failed]], &cause);
        /* keep the order: ties go to the earlier candidate */
        memmove(which + failed, which + failed + 1, (count - failed - 1) * sizeof *which);
        count--;
        rc = TW_OK;
    }
    /* Strictly lower wins, so equal medians keep the earlier candidate. */
    for (i = 0; i < count; i++) {
        reports[which[i]].state = TW_CAND_MEASURED;
        reports[which[i]].stats = stats[i];
        if (*chosen < 0 || stats[i].median_ns < reports[*chosen].stats.median_ns) {
            *chosen = (long)which[i];
        }
    }
cleanup:
    tw_host_release(host, runners);
    tw_host_release(host, stats);
    tw_host_release(host, which);
    return rc;
}

static tw_code tw_check_candidates(tw_strategy_kind kind, const tw_candidate *cands,
                                   size_t n, const tw_measure_config *cfg,
                                   const long *chosen, const tw_candidate_report *reports,
                                   tw_error *err)
{
    tw_code rc = TW_OK;
    size_t i;

    if (tw_strategy_name(kind) == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "unknown strategy kind %d", (int)kind);
    } else if (n == 0) {
        rc = tw_error_set(err, TW_EINVAL,
                          "strategy %s got no backends: give it at least one",
                          tw_strategy_name(kind));
    } else if (kind == TW_STRATEGY_ONE_BACKEND && n != 1) {
        rc = tw_error_set(err, TW_EINVAL,
                          "strategy one-backend takes exactly one backend, not %zu", n);
    } else if (cands == NULL || chosen == NULL || reports == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "%s is NULL",
                          cands == NULL ? "candidates" : chosen == NULL ? "chosen" : "reports");
    } else if (kind == TW_STRATEGY_HIGHEST_THROUGHPUT) {
        rc = tw_measure_config_check(cfg, err);
    }
    for (i = 0; rc == TW_OK && i < n; i++) {
        if (cands[i].build == NULL) {
            rc = tw_error_set(err, TW_EINVAL, "backend %zu (%s) has no build function", i,
                              tw_candidate_label(&cands[i]));
        }
    }
    return rc;
}

tw_code tw_strategy_choose(const tw_host *host, tw_strategy_kind kind,
                           const tw_candidate *candidates, size_t n,
                           const tw_measure_config *cfg, long *chosen,
                           tw_candidate_report *reports, tw_error *err)
{
    tw_code rc;
    tw_host resolved;
    tw_measure_config defaults;
    int built;
    size_t i;

    tw_host_resolve(host, &resolved);
    if (cfg == NULL) {
        tw_measure_config_default(&defaults);
        cfg = &defaults;
    }
    /* Everything is checked before the first build: a bad argument must
     * not cost the user a compile. */
    rc = tw_check_candidates(kind, candidates, n, cfg, chosen, reports, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    *chosen = -1;
    for (i = 0; i < n; i++) {
        memset(&reports[i], 0, sizeof reports[i]);
        reports[i].state = TW_CAND_NOT_TRIED;
    }
    switch (kind) {
    case TW_STRATEGY_FIRST_WINS:
        rc = tw_choose_first(candidates, n, chosen, reports, err);
        break;
    case TW_STRATEGY_HIGHEST_THROUGHPUT:
        rc = tw_choose_fastest(&resolved, candidates, n, cfg, chosen, reports, err);
        break;
    case TW_STRATEGY_ONE_BACKEND:
        rc = tw_build_candidate(&candidates[0], &reports[0], &built, err);
        *chosen = (rc == TW_OK && built) ? 0 : -1;
        break;
    }
    /* An interrupted choice keeps no winner: the module stays as it was. */
    if (rc != TW_OK) {
        *chosen = -1;
    }
cleanup:
    return rc;
}
