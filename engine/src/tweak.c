/*
 * tweak.c - the depth search: cut, tune, measure and select.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void tw_tweak_config_default(tw_tweak_config *cfg)
{
    if (cfg == NULL) {
        goto cleanup;
    }
    cfg->min_depth = 0;
    cfg->max_depth = 1;
    cfg->tie_tolerance = 0.02;
    cfg->time_budget_ns = 0;
    cfg->busy_budget_ns = TW_BUSY_BUDGET_NS;
    cfg->busy_round_ns = TW_BUSY_ROUND_NS;
    cfg->dry_run = 0;
    tw_measure_config_default(&cfg->measure);
cleanup:
    return;
}

/* The state of one depth search. */
typedef struct tw_search {
    const tw_host *host;
    const tw_tree *tree;
    const tw_tweak_config *cfg;
    const tw_tweak_ops *ops;
    tw_result *result;
    size_t *nodes;        /* the cut being worked on */
    int *tune;            /* per entry of nodes: tune it now */
    int *depths;          /* the distinct depths, one per row */
    size_t cut_size;
    int entered;          /* enter() was called and leave() not yet */
    int busy;             /* the untuned model was measured on a busy machine */
    uint64_t reserve_ns;  /* busy: the paired rounds' share of the budget in force */
    tw_measure_config measure; /* cfg->measure; once busy, rounds of cfg->busy_round_ns */
    uint64_t start;
} tw_search;

static tw_code tw_check_ops(const tw_tweak_ops *ops, tw_error *err)
{
    tw_code rc = TW_OK;
    const char *missing = NULL;

    if (ops == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "ops is NULL: a tweak needs its host's callbacks");
        goto cleanup;
    }
    missing = ops->enter == NULL ? "enter" : ops->modules.groups == NULL ? "modules.groups"
            : ops->modules.group == NULL ? "modules.group"
            : ops->modules.build == NULL ? "modules.build"
            : ops->modules.run == NULL ? "modules.run"
            : ops->modules.commit == NULL ? "modules.commit"
            : ops->activate == NULL ? "activate" : ops->leave == NULL ? "leave"
            : ops->model.run == NULL ? "model.run" : NULL;
    if (missing != NULL) {
        rc = tw_error_set(err, TW_EINVAL, "ops.%s is NULL: every callback is needed", missing);
    } else if (ops->model.n_samples == 0) {
        rc = tw_error_set(err, TW_EINVAL,
                          "the dataset is empty: give the tweak at least one sample");
    }
cleanup:
    return rc;
}

/* A double as Python's repr() writes it: the shortest text that reads back
 * the same, with ".0" when it would read as an int. */
/* "1e-05" for "1e-05", "1e+16" for "1e+16": %e already writes two exponent
 * digits at least, as Python does; only a mantissa's trailing zeros go. */
static void tw_trim_exponent(char *text)
{
    char *e = strchr(text, 'e');
    char *end;

    if (e == NULL || strchr(text, '.') == NULL || strchr(text, '.') > e) {
        goto cleanup;
    }
    end = e;
    while (end[-1] == '0') {
        end--;
    }
    if (end[-1] == '.') {
        end--;
    }
    memmove(end, e, strlen(e) + 1);
cleanup:
    return;
}

static void tw_format_number(char *out, size_t size, double v)
{
    int precision;
    int exponent;

    if (isnan(v) || isinf(v)) {
        snprintf(out, size, "%s", isnan(v) ? "nan" : v < 0 ? "-inf" : "inf");
        goto cleanup;
    }
    for (precision = 1; precision < 17; precision++) {
        snprintf(out, size, "%.*g", precision, v);
        if (strtod(out, NULL) == v) {
            break;
        }
    }
    /* positional from 1e-4 up to 1e16, as Python writes it; %g would switch sooner */
    exponent = v != 0.0 ? (int)floor(log10(fabs(v))) : 0;
    if (exponent >= -4 && exponent < 16) {
        snprintf(out, size, "%.*f", precision - 1 - exponent > 0 ? precision - 1 - exponent : 0, v);
    } else {
        snprintf(out, size, "%.*e", precision - 1, v);
        tw_trim_exponent(out);
    }
    if (strpbrk(out, ".e") == NULL && strlen(out) + 2 < size) {
        strcat(out, ".0");
    }
cleanup:
    return;
}

tw_code tw_tweak_config_check(const tw_tweak_config *cfg, tw_error *err)
{
    tw_code rc = TW_OK;
    char number[40];

    if (cfg == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "cfg is NULL: give a config (tw_tweak_config_default)");
    } else if (cfg->min_depth < 0) {
        rc = tw_error_set(err, TW_EINVAL, "min_depth must be an int >= 0, got %d",
                          cfg->min_depth);
    } else if (cfg->max_depth >= 0 && cfg->min_depth > cfg->max_depth) {
        rc = tw_error_set(err, TW_EINVAL,
                          "min_depth (%d) is greater than max_depth (%d): lower min_depth or "
                          "raise max_depth", cfg->min_depth, cfg->max_depth);
    } else if (!isfinite(cfg->tie_tolerance) || cfg->tie_tolerance < 0) {
        tw_format_number(number, sizeof number, cfg->tie_tolerance);
        rc = tw_error_set(err, TW_EINVAL,
                          "tie_tolerance must be a fraction >= 0 (0.02 is 2 %%), got %s", number);
    } else if (cfg->busy_round_ns > TW_ROUND_MIN_MAX_NS) {
        rc = tw_error_set(err, TW_EINVAL, "busy_round_ns (%.3g s) is longer than %.0f s",
                          cfg->busy_round_ns / 1e9, TW_ROUND_MIN_MAX_NS / 1e9);
    } else if (!cfg->dry_run) {
        rc = tw_measure_config_check(&cfg->measure, err);
    }
    return rc;
}

static tw_code tw_check_tweak(const tw_tree *tree, const tw_tweak_config *cfg,
                              const tw_tweak_ops *ops, tw_result **out, tw_error *err)
{
    tw_code rc = TW_OK;

    if (out == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "out is NULL: the tweak needs a place for its result");
    } else if (tree == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "tree is NULL: build it with tw_tree_create");
    } else if (!tw_tree_is_finished(tree)) {
        rc = tw_error_set(err, TW_ESTATE, "the tree is not finished: call tw_tree_finish first");
    } else {
        rc = tw_tweak_config_check(cfg, err);
        if (rc == TW_OK && !cfg->dry_run) {
            rc = tw_check_ops(ops, err);
        }
    }
    return rc;
}

/* Takes every allocation up front, so that no callback has run when memory
 * runs out here. */
static tw_code tw_prepare_search(tw_search *s, tw_error *err)
{
    tw_code rc;
    size_t size = tw_tree_size(s->tree);
    size_t count = 0;

    rc = tw_tree_distinct_depths(s->tree, s->cfg->min_depth, s->cfg->max_depth, NULL, 0,
                                 &count, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    s->depths = tw_host_alloc_array(s->host, count, sizeof *s->depths);
    s->nodes = tw_host_alloc_array(s->host, size, sizeof *s->nodes);
    s->tune = tw_host_alloc_array(s->host, size, sizeof *s->tune);
    s->result = tw_result_create(s->host, count, size);
    if (s->depths == NULL || s->nodes == NULL || s->tune == NULL || s->result == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory preparing a tweak of %zu modules",
                          size);
        goto cleanup;
    }
    rc = tw_tree_distinct_depths(s->tree, s->cfg->min_depth, s->cfg->max_depth, s->depths,
                                 count, &count, err);
    s->result->dry_run = s->cfg->dry_run != 0;
    s->result->time_budget_ns = s->cfg->time_budget_ns;
    s->result->busy_budget_ns = s->cfg->busy_budget_ns;
cleanup:
    return rc;
}

/* Loads the cut of row i into s->nodes and fills the row's module counts. */
static void tw_load_cut(tw_search *s, size_t i)
{
    tw_row *row = &s->result->rows[i].row;
    size_t k;

    row->depth = s->depths[i];
    tw_tree_cut(s->tree, row->depth, s->nodes, tw_tree_size(s->tree), &s->cut_size, NULL);
    row->modules = s->cut_size;
    row->failed = 0;
    for (k = 0; k < s->cut_size; k++) {
        /* failed modules are not retried, so they count at every depth */
        row->failed += tw_result_module(s->result, s->nodes[k], NULL) < 0;
        s->result->in_cut[i * s->result->module_count + s->nodes[k]] = 1;
    }
}

static tw_code tw_enter_cut(tw_search *s, tw_error *cb_err)
{
    tw_error_clear(cb_err);
    /* Entered even when enter fails: the host may have wrapped some modules
     * before failing, and leave() is where it unwraps them. */
    s->entered = 1;
    return s->ops->enter(s->ops->ctx, s->nodes, s->tune, s->cut_size, cb_err);
}

static tw_code tw_leave_cut(tw_search *s, int depth, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_error cb_err;

    if (!s->entered) {
        goto cleanup;
    }
    s->entered = 0;
    tw_error_clear(&cb_err);
    rc = s->ops->leave(s->ops->ctx, &cb_err);
    if (rc != TW_OK) {
        tw_error_forward(&cb_err, rc, &cb_err, "leave");
        tw_error_set(err, rc, "leaving the cut at depth %d failed: %s", depth, cb_err.msg);
    }
cleanup:
    return rc;
}

/* 1 when the budget in force is the busy budget: the machine was found busy,
 * and the busy budget is set and smaller than the time budget (if any). */
static int tw_busy_in_force(const tw_search *s)
{
    uint64_t time = s->cfg->time_budget_ns;

    return s->busy && s->cfg->busy_budget_ns != 0 &&
           (time == 0 || s->cfg->busy_budget_ns < time);
}

/* The budget in force: the time budget, and once the machine was found busy,
 * the busy budget too (the smaller of the two). */
static void tw_budget_in_force(const tw_search *s, tw_budget *budget)
{
    budget->start_ns = s->start;
    budget->ns = tw_busy_in_force(s) ? s->cfg->busy_budget_ns : s->cfg->time_budget_ns;
}

/* The search's share of the budget in force, which bounds its depths and
 * variants: all of it, less the paired rounds' share once the machine is busy. */
static void tw_search_budget(const tw_search *s, tw_budget *budget)
{
    tw_budget_in_force(s, budget);
    if (budget->ns != 0 && s->reserve_ns != 0) {
        budget->ns = budget->ns > s->reserve_ns ? budget->ns - s->reserve_ns : 1;
    }
}

/* The paired rounds' share of the budget in force on a busy machine: the time
 * of TW_BUSY_PAIRS pairs and both runners' warm-up at the untuned model's busy
 * latency `untuned` (its upper quartile: the load's bursts lengthen rounds; a
 * pair is two rounds of every sample, each at least round_min_ns, and the
 * settle calls), at most half the budget; 0 when no budget bounds them or
 * none can be taken (no deactivate callback). */
static uint64_t tw_paired_reserve(const tw_search *s, const tw_stats *untuned)
{
    const tw_measure_config *m = &s->measure;
    double samples = (double)s->ops->model.n_samples;
    double latency;
    double round_ns;
    double ns;
    tw_budget budget;

    tw_budget_in_force(s, &budget);
    if (!s->busy || budget.ns == 0 || s->ops->deactivate == NULL) {
        return 0;
    }
    latency = untuned->q75_ns > untuned->median_ns ? untuned->q75_ns : untuned->median_ns;
    round_ns = samples * latency > (double)m->round_min_ns ? samples * latency
                                                            : (double)m->round_min_ns;
    ns = (double)TW_BUSY_PAIRS * 2.0 * (round_ns + (double)m->settle * latency) +
         2.0 * (double)m->warmup_max * round_ns;
    return ns < (double)(budget.ns / 2) ? (uint64_t)ns : budget.ns / 2;
}

/* Searches the modules of the entered cut that were never tried. A module that
 * fails keeps its forward; only an interrupt or the engine's own failure (out
 * of memory) ends the search. */
static tw_code tw_tune_cut(tw_search *s, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_module_result *module = NULL;
    tw_error cause;
    size_t k;
    size_t node;
    const char *path;
    tw_budget budget;

    tw_search_budget(s, &budget);
    for (k = 0; k < s->cut_size; k++) {
        if (!s->tune[k]) {
            continue;
        }
        node = s->nodes[k];
        path = tw_tree_path(s->tree, node);
        tw_error_clear(&cause);
        rc = tw_tune_module_within(s->host, &s->ops->modules, node, path, &s->measure,
                                   &budget, &module, &cause);
        if (rc != TW_OK) {
            tw_error_forward(err, rc, &cause, "tuning a module");
            goto cleanup;
        }
        s->result->modules[node] = module;
        if (tw_module_result_state(module) < 0) {
            tw_host_logf(s->host, 1, "module \"%s\" keeps its forward: %s", path,
                         tw_module_result_error(module));
        }
        module = NULL;
    }
cleanup:
    return rc;
}

/* Measures the model. A failure of the model itself is *row_failed (the
 * row is skipped); an interrupt or the engine's own failure is returned. */
static tw_code tw_measure_model(tw_search *s, tw_stats *stats, int *row_failed,
                                tw_error *cause, tw_error *err)
{
    tw_code rc;
    size_t failed;

    *row_failed = 0;
    rc = tw_measure_runners(s->host, &s->ops->model, 1, &s->measure, stats, &failed,
                            cause);
    if (rc != TW_OK && rc != TW_EINTERRUPT && failed != TW_NO_RUNNER) {
        *row_failed = 1;
        rc = TW_OK;
    } else if (rc != TW_OK) {
        tw_error_set(err, rc, "%s", cause->msg);
    }
    return rc;
}

static void tw_skip_row(tw_search *s, size_t i, const char *msg)
{
    s->result->rows[i].row.state = TW_ROW_SKIPPED;
    tw_result_set_row_error(s->result, i, msg);
    tw_host_logf(s->host, 1, "depth %d skipped: %s", s->depths[i], msg);
}

/* What a step of a depth (enter, activate) that returned `step` means: an
 * interrupt ends the whole search (returned, with err); any other failure
 * skips the depth's row i with its error (*skipped set). */
static tw_code tw_depth_step(tw_search *s, size_t i, tw_code step, const char *what,
                             tw_error *cause, int *skipped, tw_error *err)
{
    *skipped = 0;
    if (step == TW_OK) {
        return TW_OK;
    }
    tw_error_forward(cause, step, cause, what);
    if (step == TW_EINTERRUPT) {
        return tw_error_set(err, step, "%s", cause->msg);
    }
    tw_skip_row(s, i, cause->msg);
    *skipped = 1;
    return TW_OK;
}

/* One depth: enter, tune, activate, measure, leave. Returns only what ends
 * the whole search (then the cut is not left here: tw_tweak_run leaves it); a
 * failing depth is recorded in its row. */
static tw_code tw_run_depth(tw_search *s, size_t i, int *measured, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_row *row = &s->result->rows[i].row;
    tw_error cause;
    size_t k;
    int failed = 0;

    *measured = 0;
    for (k = 0; k < s->cut_size; k++) {
        s->tune[k] = s->result->modules[s->nodes[k]] == NULL;
    }
    rc = tw_depth_step(s, i, tw_enter_cut(s, &cause), "enter", &cause, &failed, err);
    if (rc != TW_OK || failed) {
        goto leave;
    }
    rc = tw_tune_cut(s, err);
    if (rc != TW_OK) {
        goto leave;
    }
    tw_load_cut(s, i);
    if (row->modules > 0 && row->failed == row->modules) {
        tw_skip_row(s, i, tw_module_result_error(tw_result_module_search(s->result, s->nodes[0])));
        goto leave;
    }
    tw_error_clear(&cause);
    rc = tw_depth_step(s, i, s->ops->activate(s->ops->ctx, &cause), "activate", &cause, &failed,
                       err);
    if (rc != TW_OK || failed) {
        goto leave;
    }
    rc = tw_measure_model(s, &row->stats, &failed, &cause, err);
    if (rc == TW_OK && failed) {
        tw_skip_row(s, i, cause.msg);
    } else if (rc == TW_OK) {
        row->state = TW_ROW_MEASURED;
        *measured = 1;
        tw_host_logf(s->host, 0, "depth %d: %zu modules, %zu failed, %.3f ms", row->depth,
                     row->modules, row->failed, row->stats.median_ns / 1e6);
    }
leave:
    if (rc == TW_OK) {
        rc = tw_leave_cut(s, row->depth, err);
    }
    return rc;
}

/* The host's reading of the machine's load (see tw_load); out->known is 0 when
 * it cannot tell. Only an interrupt is returned: any other failure of the
 * callback counts as unknown. */
static tw_code tw_read_load(const tw_search *s, tw_load *out, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_error cause;

    memset(out, 0, sizeof *out);
    if (s->ops->load == NULL) {
        goto cleanup;
    }
    tw_error_clear(&cause);
    rc = s->ops->load(s->ops->ctx, out, &cause);
    if (rc == TW_EINTERRUPT) {
        tw_error_set(err, rc, "reading the machine's load: %s", cause.msg);
        goto cleanup;
    }
    if (rc != TW_OK || !out->known || !isfinite(out->others) || !isfinite(out->capacity)) {
        memset(out, 0, sizeof *out);
    }
    rc = TW_OK;
cleanup:
    return rc;
}

/* What other processes took between two readings, and the capacity that
 * elapsed: 1 when both are known and the capacity grew, else 0. */
static int tw_load_window(const tw_load *before, const tw_load *after, double *others,
                          double *capacity)
{
    if (!before->known || !after->known || !(after->capacity > before->capacity)) {
        return 0;
    }
    *capacity = after->capacity - before->capacity;
    *others = after->others - before->others;
    *others = *others < 0.0 ? 0.0 : *others > *capacity ? *capacity : *others;
    return 1;
}

static tw_code tw_measure_baseline(tw_search *s, tw_stats *stats, tw_error *err)
{
    tw_code rc;
    int was_busy;
    tw_error cause;
    tw_load before;
    tw_load after;
    double others;
    double capacity;
    size_t failed;

    rc = tw_read_load(s, &before, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    rc = tw_measure_runners(s->host, &s->ops->model, 1, &s->measure, stats, &failed,
                            &cause);
    if (rc != TW_OK) {
        tw_error_set(err, rc, "measuring the untuned model failed: %s", cause.msg);
        goto cleanup;
    }
    rc = tw_read_load(s, &after, err);
    if (rc == TW_OK && tw_load_window(&before, &after, &others, &capacity)) {
        s->result->baseline_others += others;
        s->result->baseline_capacity += capacity;
    }
    was_busy = s->busy;
    s->busy = tw_result_busy(s->result);
    if (!was_busy && s->busy && s->cfg->busy_round_ns > s->measure.round_min_ns) {
        /* from now on rounds hold the load's stalls at their rate (tw_measure_config), the
         * untuned model's too: its figure is measured again so */
        s->measure.round_min_ns = s->cfg->busy_round_ns;
        rc = tw_measure_runners(s->host, &s->ops->model, 1, &s->measure, stats, &failed, &cause);
        if (rc != TW_OK) {
            tw_error_set(err, rc, "measuring the untuned model failed: %s", cause.msg);
            goto cleanup;
        }
    }
    s->reserve_ns = tw_paired_reserve(s, stats);
    if (!was_busy && s->busy && s->cfg->busy_budget_ns != 0) {
        tw_host_logf(s->host, 1, "the machine is busy (other processes took %.0f%% of the CPUs "
                     "while the untuned model was measured): figures are measured in paired "
                     "rounds, each of at least %.0f ms, and tuning stops at the busy budget "
                     "(%.0f s), %.1f s of it kept for them",
                     tw_result_others_share(s->result) * 100.0, s->measure.round_min_ns / 1e6,
                     s->cfg->busy_budget_ns / 1e9, s->reserve_ns / 1e9);
    }
cleanup:
    return rc;
}

/* Among depths faster than untuned, the shallowest within tie_tolerance of
 * the fastest; rows are in increasing depth, so the first match wins. */
static void tw_select_depth(tw_search *s)
{
    tw_result *r = s->result;
    /* busy: the search's figures were taken at different moments of the load,
     * so the fastest depth goes to the paired rounds (which need deactivate)
     * even when the untuned model's own measurement fell on a quieter moment */
    double base = s->busy && s->ops->deactivate != NULL ? INFINITY : r->baseline.median_ns;
    double limit;
    long fastest = -1;
    size_t i;

    for (i = 0; i < r->row_count; i++) {
        const tw_row *row = &r->rows[i].row;

        if (row->state == TW_ROW_MEASURED && row->stats.median_ns < base &&
            (fastest < 0 || row->stats.median_ns < r->rows[fastest].row.stats.median_ns)) {
            fastest = (long)i;
        }
    }
    if (fastest < 0) {
        goto cleanup;
    }
    limit = r->rows[fastest].row.stats.median_ns * (1.0 + s->cfg->tie_tolerance);
    for (i = 0; i < r->row_count; i++) {
        const tw_row *row = &r->rows[i].row;

        if (row->state == TW_ROW_MEASURED && row->stats.median_ns < base &&
            row->stats.median_ns <= limit) {
            r->selected = (long)i;
            break;
        }
    }
cleanup:
    return;
}

/* Enters and activates the selected cut again, tuning nothing, and stays. */
static tw_code tw_apply_selected(tw_search *s, tw_error *err)
{
    tw_code rc;
    tw_error cause;
    size_t i = (size_t)s->result->selected;
    size_t k;

    tw_load_cut(s, i);
    for (k = 0; k < s->cut_size; k++) {
        s->tune[k] = 0;
    }
    rc = tw_enter_cut(s, &cause);
    if (rc == TW_OK) {
        tw_error_clear(&cause);
        rc = s->ops->activate(s->ops->ctx, &cause);
    }
    if (rc != TW_OK) {
        tw_error_forward(&cause, rc, &cause, "applying the selected cut");
        tw_error_set(err, rc, "applying the selected depth %d failed: %s", s->depths[i],
                     cause.msg);
        goto cleanup;
    }
    /* The model keeps the selected cut: nothing may leave it now. */
    s->entered = 0;
cleanup:
    return rc;
}

static tw_code tw_round_active(void *ctx, tw_error *err)
{
    const tw_tweak_ops *ops = ctx;

    return ops->activate(ops->ctx, err);
}

static tw_code tw_round_inactive(void *ctx, tw_error *err)
{
    const tw_tweak_ops *ops = ctx;

    return ops->deactivate(ops->ctx, err);
}

static tw_code tw_run_model(void *ctx, size_t sample, tw_error *err)
{
    const tw_tweak_ops *ops = ctx;

    return ops->model.run(ops->model.ctx, sample, err);
}

static tw_code tw_sync_model(void *ctx, tw_error *err)
{
    const tw_tweak_ops *ops = ctx;

    return ops->model.sync(ops->model.ctx, err);
}

static int tw_budget_used(const tw_search *s)
{
    tw_budget budget;

    tw_search_budget(s, &budget);
    return tw_budget_spent(s->host, &budget);
}

/* 1 when the busy budget, not the time budget, is what is used up. */
static int tw_busy_budget_used(const tw_search *s)
{
    return tw_budget_used(s) && tw_busy_in_force(s);
}

/* The two runners of a measurement side by side: the applied cut active and
 * deactivated, the active one first when `active_first`. */
static void tw_side_runners(tw_search *s, tw_runner *runners, int active_first)
{
    int k;

    for (k = 0; k < 2; k++) {
        runners[k].ctx = (void *)s->ops;
        runners[k].n_samples = s->ops->model.n_samples;
        runners[k].run = tw_run_model;
        runners[k].sync = s->ops->model.sync != NULL ? tw_sync_model : NULL;
        runners[k].round = (k == 0) == (active_first != 0) ? tw_round_active : tw_round_inactive;
    }
}

/* What follows a measurement side by side: an interrupt, or no runner that
 * could run, is returned as an error; another failure is logged and sets
 * *failed_measure; else the load read after it is kept with the result. */
static tw_code tw_after_side(tw_search *s, tw_code rc, size_t failed, const tw_error *cause,
                             const char *how, int depth, const tw_load *before,
                             int *failed_measure, tw_error *err)
{
    tw_load after;
    double others;
    double capacity;

    if (rc != TW_OK && (rc == TW_EINTERRUPT || failed == TW_NO_RUNNER)) {
        tw_error_set(err, rc, "confirming depth %d%s: %s", depth, how, cause->msg);
        return rc;
    }
    if (rc != TW_OK) {
        tw_host_logf(s->host, 1, "depth %d could not be confirmed: %s", depth, cause->msg);
        *failed_measure = 1;
        return TW_OK;
    }
    rc = tw_read_load(s, &after, err);
    if (rc == TW_OK && tw_load_window(before, &after, &others, &capacity)) {
        s->result->side_others = others;
        s->result->side_capacity = capacity;
    }
    return rc;
}

/* The applied cut measured against itself deactivated, reading the load
 * around it: side by side when pcfg is NULL (stats[0] active, stats[1]
 * deactivated), else in paired rounds (*paired: runner 0 deactivated, runner 1
 * active). *failed_measure is set (and the error logged) when the model
 * failed; an interrupt or the engine's own failure is returned. */
static tw_code tw_measure_side(tw_search *s, int depth, const tw_paired_config *pcfg,
                               tw_stats *stats, tw_paired *paired, int *failed_measure,
                               tw_error *err)
{
    tw_code rc;
    tw_runner runners[2];
    tw_error cause;
    tw_load before;
    size_t failed;

    *failed_measure = 0;
    if (pcfg == NULL) {
        s->result->side_others = 0.0;
        s->result->side_capacity = 0.0;
    }
    rc = tw_read_load(s, &before, err);
    if (rc != TW_OK) {
        return rc;
    }
    tw_side_runners(s, runners, pcfg == NULL);
    tw_error_clear(&cause);
    rc = pcfg == NULL
             ? tw_measure_runners(s->host, runners, 2, &s->measure, stats, &failed, &cause)
             : tw_measure_pairs(s->host, runners, &s->measure, pcfg, paired, &failed,
                                &cause);
    return tw_after_side(s, rc, failed, &cause, pcfg == NULL ? "" : " in paired rounds", depth,
                         &before, failed_measure, err);
}

/* The budget that would buy paired rounds `p` the pairs their interval needs:
 * at the share of pairs the depth won, the fewest pairs (up to rounds_max)
 * whose losses, expected and one standard deviation more, stay under the sign
 * test's rank, at the pace of these (took_ns, warm-up included), started once
 * the search used `used_ns` of the budget, budget_ns; in whole seconds, rounded
 * up (to tens from 10 s: it is an estimate, and a user sets it). 0 when they
 * did not stop for time, leaned no faster (median at most 1), or no number of
 * pairs would do. */
static uint64_t tw_budget_wanted(const tw_paired *p, const tw_paired_config *pcfg,
                                 uint64_t took_ns, uint64_t used_ns, uint64_t budget_ns)
{
    double won = p->rounds > 0 ? (double)p->wins / (double)p->rounds : 0.0;
    double losses;
    double pace;
    double seconds;
    uint32_t n;

    if (p->stopped_by != TW_STOP_TIME || !(p->ratio > 1.0) || p->low > 1.0 || budget_ns == 0) {
        return 0;
    }
    pace = (double)took_ns / (double)p->rounds;
    for (n = p->rounds + 1; n <= pcfg->rounds_max; n++) {
        losses = (double)n * (1.0 - won) + sqrt((double)n * won * (1.0 - won));
        if (losses < (double)tw_sign_rank(n)) {
            seconds = ceil(((double)(used_ns > budget_ns ? used_ns : budget_ns) + pace * n) / 1e9);
            seconds = seconds >= 10.0 ? ceil(seconds / 10.0) * 10.0 : seconds;
            return (uint64_t)(seconds * 1e9);
        }
    }
    return 0;
}

/* Paired rounds of the applied cut deactivated (runner 0) and active (runner
 * 1), within what is left of the budget in force or their own share of it
 * (s->reserve_ns), whichever is longer; *failed_measure as for
 * tw_measure_side. *wanted: the budget in force that would buy the rounds
 * (tw_budget_wanted). */
static tw_code tw_measure_paired_side(tw_search *s, int depth, tw_paired *paired,
                                      uint64_t *wanted, int *failed_measure, tw_error *err)
{
    tw_code rc;
    tw_paired_config pcfg;
    tw_budget budget;
    uint64_t start = tw_host_now(s->host);
    uint64_t used = start - s->start;

    *wanted = 0;
    tw_paired_config_default(&pcfg);
    tw_budget_in_force(s, &budget);
    if (budget.ns != 0) {
        pcfg.time_cap_ns = used < budget.ns ? budget.ns - used : 1;
        pcfg.time_cap_ns = pcfg.time_cap_ns > s->reserve_ns ? pcfg.time_cap_ns : s->reserve_ns;
    }
    rc = tw_measure_side(s, depth, &pcfg, NULL, paired, failed_measure, err);
    if (rc == TW_OK && !*failed_measure) {
        *wanted = tw_budget_wanted(paired, &pcfg, tw_host_now(s->host) - start, used, budget.ns);
    }
    return rc;
}

/* Fills the confirmation from the last side-by-side measurement and the
 * search's figures: the reported figure, and whether the cut is kept. */
static void tw_settle_confirmation(tw_result *r, const tw_stats *stats, uint32_t tries)
{
    tw_confirmation *c = &r->confirmation;

    c->measured = 1;
    c->depth = r->rows[r->selected].row.depth;
    c->tuned = stats[0];
    c->untuned = stats[1];
    c->tries = tries;
    c->others_share = r->side_capacity >= TW_LOAD_MIN_CAPACITY
                          ? r->side_others / r->side_capacity : -1.0;
    c->quality = TW_QUALITY_CONSISTENT; /* not busy: tw_confirmation_derive says which */
    tw_confirmation_derive(c, &r->baseline, &r->rows[r->selected].row.stats);
}

/* The confirmation from paired rounds on a busy machine: their median ratio
 * and its 99 % interval are the figure; kept when the interval lies above 1. */
static void tw_settle_paired(tw_result *r, const tw_paired *p, uint32_t tries)
{
    tw_confirmation *c = &r->confirmation;

    c->measured = 1;
    c->depth = r->rows[r->selected].row.depth;
    c->untuned = p->stats[0];
    c->tuned = p->stats[1];
    c->tries = tries;
    c->quality = TW_QUALITY_BUSY;
    c->speedup = p->ratio;
    c->speedup_low = p->low;
    c->speedup_high = p->high;
    c->paired_rounds = p->rounds;
    c->paired_wins = p->wins;
    c->others_share = r->side_capacity >= TW_LOAD_MIN_CAPACITY
                          ? r->side_others / r->side_capacity : -1.0;
    tw_confirmation_derive(c, &r->baseline, &r->rows[r->selected].row.stats);
}

/* Settles the confirmation: on a busy machine (the untuned model's
 * measurements or the side-by-side one read busy) from paired rounds, robust to
 * the load's bursts; else from the side-by-side figures. */
static tw_code tw_settle(tw_search *s, int depth, tw_stats *stats, uint32_t tries,
                         int *failed, tw_error *err)
{
    tw_result *r = s->result;
    tw_paired paired;
    uint64_t wanted;
    tw_code rc;

    if (!s->busy && !tw_result_busy(r)) {
        tw_settle_confirmation(r, stats, tries);
        return TW_OK;
    }
    rc = tw_measure_paired_side(s, depth, &paired, &wanted, failed, err);
    if (rc == TW_OK && !*failed) {
        tw_settle_paired(r, &paired, tries + 1);
        r->confirmation.rounds_ran_out = !r->confirmation.confirmed &&
                                         paired.stopped_by == TW_STOP_TIME;
        /* the setting that buys the rounds: the budget that stopped them */
        *(tw_busy_in_force(s) ? &r->confirmation.busy_budget_wanted_ns
                              : &r->confirmation.time_budget_wanted_ns) = wanted;
    }
    return rc;
}

/* Keeps the confirmed depth: the cut activated again (the last round may
 * have been the untuned one) and the verdict logged, a busy machine's with no
 * speedup claimed. */
static tw_code tw_keep_confirmed(tw_search *s, int depth, tw_error *err)
{
    const tw_result *r = s->result;
    const tw_confirmation *c = &r->confirmation;
    tw_error cause;
    tw_code rc;

    tw_error_clear(&cause);
    rc = s->ops->activate(s->ops->ctx, &cause);
    if (rc != TW_OK) {
        tw_error_forward(&cause, rc, &cause, "activate");
        tw_error_set(err, rc, "activating the kept depth %d failed: %s", depth, cause.msg);
        goto cleanup;
    }
    s->entered = 0;
    if (c->quality == TW_QUALITY_BUSY) {
        tw_host_logf(s->host, 1, "depth %d kept on a busy machine (other processes took "
                     "%.0f%% of the CPUs): %.2fx faster in %u paired rounds (99%% "
                     "interval %.2fx to %.2fx), measured busy", depth,
                     tw_result_others_share(r) * 100.0, c->speedup, c->paired_rounds,
                     c->speedup_low, c->speedup_high);
    } else {
        tw_host_logf(s->host, 0, "depth %d kept: %.2fx faster %s (%.2fx to %.2fx)", depth,
                     c->speedup, c->from_search ? "in the search" : "side by side",
                     c->speedup_low, c->speedup_high);
    }
cleanup:
    return rc;
}

/* Logs why the confirmed depth is not kept: its paired rounds on a busy
 * machine, else its side-by-side (or the search's) figure. */
static void tw_log_not_kept(const tw_search *s, int depth)
{
    const tw_confirmation *c = &s->result->confirmation;

    if (c->quality == TW_QUALITY_BUSY) {
        tw_host_logf(s->host, 1, "depth %d not kept: on a busy machine (other processes took "
                     "%.0f%% of the CPUs) its %u paired rounds put it at %.2fx, 99%% interval "
                     "%.2fx to %.2fx, %s; the model stays untuned%s", depth,
                     tw_result_others_share(s->result) * 100.0, c->paired_rounds, c->speedup,
                     c->speedup_low, c->speedup_high,
                     c->speedup_high < 1.0 ? "slower" : "which holds 1",
                     c->busy_budget_wanted_ns != 0 || c->time_budget_wanted_ns != 0
                         ? " (its budget ran out first: the result's last line says which "
                           "setting buys the rounds)"
                         : "");
        return;
    }
    tw_host_logf(s->host, 1, "depth %d is %s the untuned model %s (%.2fx, %.2fx to %.2fx): the "
                 "model stays untuned", depth,
                 c->speedup_high < 1.0 ? "slower than" : "within noise of",
                 c->from_search ? "in the search" : "side by side", c->speedup,
                 c->speedup_low, c->speedup_high);
}

/* Measures the applied cut active and deactivated side by side, holds the
 * figures against the search's (measuring again while they disagree, a
 * bounded number of times), and keeps the cut only when the reported speedup's
 * interval lies above 1. A failure to measure is not fatal: the cut is left
 * and the error logged, as for a depth that failed. */
static tw_code tw_confirm_selected(tw_search *s, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_result *r = s->result;
    tw_confirmation *c = &r->confirmation;
    const tw_stats *row = &r->rows[r->selected].row.stats;
    tw_stats stats[2];
    int depth = r->rows[r->selected].row.depth;
    int failed = 0;
    int agree = 0;
    uint32_t tries = 0;

    s->entered = 1; /* until it is confirmed, any failure leaves the cut */
    while (!s->busy && tries < TW_CONFIRM_TRIES) {
        if (tries > 0) {
            if (tw_budget_used(s)) {
                break;
            }
            tw_host_logf(s->host, 0, "depth %d side by side (%.3f ms against %.3f ms untuned) "
                         "disagrees with the search (%.3f ms against %.3f ms): the machine's "
                         "load changed; measuring again (%u of %u)", depth,
                         stats[0].median_ns / 1e6, stats[1].median_ns / 1e6,
                         row->median_ns / 1e6, r->baseline.median_ns / 1e6, tries + 1,
                         TW_CONFIRM_TRIES);
        }
        rc = tw_measure_side(s, depth, NULL, stats, NULL, &failed, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        if (failed) {
            r->selected = -1;
            goto leave;
        }
        tries++;
        agree = tw_side_agrees(&stats[1], &stats[0], &r->baseline, row);
        if (agree || tw_result_busy(r)) {
            break;
        }
    }
    rc = tw_settle(s, depth, stats, tries, &failed, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    if (failed) {
        r->selected = -1;
        goto leave;
    }
    if (!agree && c->quality != TW_QUALITY_BUSY) {
        tw_host_logf(s->host, 1, "depth %d: the side-by-side figures (%.2fx) disagree with the "
                     "search's (%.2fx) after %u measurements: the machine's load changed; the "
                     "smaller figure counts", depth, c->side_speedup, c->search_speedup,
                     c->tries);
    }
    if (c->confirmed) {
        rc = tw_keep_confirmed(s, depth, err);
        goto cleanup;
    }
    tw_log_not_kept(s, depth);
    r->selected = -1;
leave:
    rc = tw_leave_cut(s, depth, err);
cleanup:
    return rc;
}

static void tw_fill_dry_rows(tw_search *s)
{
    size_t i;

    for (i = 0; i < s->result->row_count; i++) {
        tw_load_cut(s, i);
        s->result->rows[i].row.state = TW_ROW_DRY;
    }
}

static tw_code tw_run_search(tw_search *s, tw_error *err)
{
    tw_code rc;
    tw_stats again;
    tw_result *r = s->result;
    size_t i;
    int measured;
    int any_measured = 0;

    rc = tw_measure_baseline(s, &r->baseline, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    r->baseline_measured = 1;
    for (i = 0; i < r->row_count; i++) {
        /* The budget is checked before a depth, never in the middle of one. */
        if (tw_budget_used(s)) {
            tw_load_cut(s, i);
            r->rows[i].row.state = TW_ROW_BUDGET;
            if (tw_busy_budget_used(s)) {
                if (!r->busy_stopped) {
                    tw_host_logf(s->host, 1, "the machine is busy and the busy budget (%.0f s) "
                                 "is used up: depth %d and deeper are not tried",
                                 s->cfg->busy_budget_ns / 1e9, s->depths[i]);
                }
                r->busy_stopped = 1;
                tw_result_set_row_error(r, i, "busy budget used up");
            } else {
                tw_result_set_row_error(r, i, "time budget used up");
            }
            continue;
        }
        tw_load_cut(s, i);
        rc = tw_run_depth(s, i, &measured, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        any_measured = any_measured || measured;
    }
    /* The first baseline may have run before the device reached full clock. */
    if (any_measured) {
        rc = tw_measure_baseline(s, &again, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        if (again.median_ns < r->baseline.median_ns) {
            r->baseline = again;
        }
    }
    tw_select_depth(s);
    if (r->selected >= 0) {
        rc = tw_apply_selected(s, err);
        if (rc == TW_OK && s->ops->deactivate != NULL) {
            rc = tw_confirm_selected(s, err);
        }
    }
cleanup:
    return rc;
}

tw_code tw_tweak_run(const tw_host *host, const tw_tree *tree,
                     const tw_tweak_config *cfg, const tw_tweak_ops *ops,
                     tw_result **out, tw_error *err)
{
    tw_code rc;
    tw_host resolved;
    tw_tweak_config defaults;
    tw_search s;

    memset(&s, 0, sizeof s);
    tw_host_resolve(host, &resolved);
    if (cfg == NULL) {
        tw_tweak_config_default(&defaults);
        cfg = &defaults;
    }
    s.host = &resolved;
    s.tree = tree;
    s.cfg = cfg;
    s.measure = cfg->measure;
    s.ops = ops;
    s.start = tw_host_now(&resolved);
    if (out != NULL) {
        *out = NULL;
    }
    rc = tw_check_tweak(tree, cfg, ops, out, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    rc = tw_prepare_search(&s, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    if (cfg->dry_run) {
        tw_fill_dry_rows(&s);
    } else {
        rc = tw_run_search(&s, err);
    }
cleanup:
    /* On any failure the model is left as it was: unwrap what is entered.
     * The first error is the one reported. */
    if (s.entered) {
        tw_leave_cut(&s, -1, NULL);
    }
    if (rc == TW_OK) {
        *out = s.result;
        s.result = NULL;
    }
    tw_result_destroy(s.result);
    tw_host_release(&resolved, s.depths);
    tw_host_release(&resolved, s.nodes);
    tw_host_release(&resolved, s.tune);
    return rc;
}
