/*
 * result.c - the result of a tweak: rows per depth, the untuned baseline,
 * each module's outcome, and the table a user reads.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

tw_result *tw_result_create(const tw_host *host, size_t rows, size_t modules)
{
    tw_result *result = NULL;
    size_t i;

    result = tw_host_alloc(host, sizeof *result);
    if (result == NULL) {
        goto error;
    }
    /* zeroed first, so that destroy can run on a half-built result */
    memset(result, 0, sizeof *result);
    result->host = *host;
    result->selected = -1;
    result->confirmation.others_share = -1.0;
    result->rows = tw_host_alloc_array(host, rows, sizeof *result->rows);
    result->modules = tw_host_alloc_array(host, modules, sizeof *result->modules);
    result->in_cut = rows != 0 && modules > SIZE_MAX / rows
                         ? NULL : tw_host_alloc_array(host, rows * modules, 1);
    if (result->rows == NULL || result->modules == NULL || result->in_cut == NULL) {
        goto error;
    }
    result->row_count = rows;
    result->module_count = modules;
    /* row.error points into its own entry: rows never move after this */
    for (i = 0; i < rows; i++) {
        memset(&result->rows[i], 0, sizeof result->rows[i]);
        result->rows[i].row.error = result->rows[i].error;
    }
    for (i = 0; i < modules; i++) {
        result->modules[i] = NULL;
    }
    if (rows * modules > 0) {
        memset(result->in_cut, 0, rows * modules);
    }
    goto cleanup;
error:
    tw_result_destroy(result);
    result = NULL;
cleanup:
    return result;
}

void tw_result_destroy(tw_result *result)
{
    size_t i;

    if (result == NULL) {
        goto cleanup;
    }
    /* module_count is only set once modules exists and is cleared. */
    for (i = 0; i < result->module_count; i++) {
        tw_module_result_destroy(result->modules[i]);
    }
    tw_host_release(&result->host, result->rows);
    tw_host_release(&result->host, result->modules);
    tw_host_release(&result->host, result->in_cut);
    tw_host_release(&result->host, result);
cleanup:
    return;
}

void tw_result_set_row_error(tw_result *result, size_t i, const char *msg)
{
    snprintf(result->rows[i].error, sizeof result->rows[i].error, "%s", msg);
    tw_utf8_trim(result->rows[i].error);
}

size_t tw_result_row_count(const tw_result *result)
{
    return result != NULL ? result->row_count : 0;
}

tw_code tw_result_row(const tw_result *result, size_t i, tw_row *row, tw_error *err)
{
    tw_code rc = TW_OK;

    if (result == NULL || row == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "%s is NULL", result == NULL ? "result" : "row");
        goto cleanup;
    }
    if (i >= result->row_count) {
        rc = tw_error_set(err, TW_EINVAL, "row %zu is out of range: the result has %zu rows",
                          i, result->row_count);
        goto cleanup;
    }
    *row = result->rows[i].row;
cleanup:
    return rc;
}

long tw_result_selected(const tw_result *result)
{
    return result != NULL ? result->selected : -1;
}

void tw_result_baseline(const tw_result *result, tw_stats *stats, int *measured)
{
    if (stats != NULL) {
        if (result != NULL) {
            *stats = result->baseline;
        } else {
            memset(stats, 0, sizeof *stats);
        }
    }
    if (measured != NULL) {
        *measured = result != NULL ? result->baseline_measured : 0;
    }
}

void tw_result_confirmation(const tw_result *result, tw_confirmation *out)
{
    if (out == NULL) {
        goto cleanup;
    }
    if (result != NULL) {
        *out = result->confirmation;
    } else {
        memset(out, 0, sizeof *out);
    }
cleanup:
    return;
}

tw_quality tw_result_quality(const tw_result *result)
{
    return result != NULL && result->confirmation.measured ? result->confirmation.quality
                                                           : TW_QUALITY_UNCHECKED;
}

const char *tw_quality_name(tw_quality quality)
{
    switch (quality) {
    case TW_QUALITY_UNCHECKED:
        return "unchecked";
    case TW_QUALITY_CONSISTENT:
        return "consistent";
    case TW_QUALITY_REMEASURED:
        return "remeasured";
    case TW_QUALITY_INCONSISTENT:
        return "inconsistent";
    case TW_QUALITY_BUSY:
        return "busy";
    }
    return "unknown";
}

int tw_stats_agree(const tw_stats *a, const tw_stats *b)
{
    double low;
    double high;
    double allowed;

    if (a == NULL || b == NULL) {
        return 0;
    }
    low = a->median_ns < b->median_ns ? a->median_ns : b->median_ns;
    high = a->median_ns < b->median_ns ? b->median_ns : a->median_ns;
    allowed = TW_AGREE_MARGIN + a->spread + b->spread; /* inf agrees with anything */
    if (low <= 0.0) {
        return high <= 0.0 || isinf(allowed);
    }
    return (high - low) / low <= allowed;
}

void tw_speedup_of(const tw_stats *untuned, const tw_stats *tuned, double *speedup,
                   double *low, double *high)
{
    *speedup = tuned->median_ns > 0 ? untuned->median_ns / tuned->median_ns : 0.0;
    *low = tuned->q75_ns > 0 ? untuned->q25_ns / tuned->q75_ns : 0.0;
    *high = tuned->q25_ns > 0 ? untuned->q75_ns / tuned->q25_ns : 0.0;
}

/* Whether the speedups two pairs of measurements give agree as two latencies
 * do (tw_stats_agree), within the four measurements' spreads: each latency
 * may move within the margin, but not the two apart so far that the speedup
 * moves beyond it. */
static int tw_speedups_agree(const tw_stats *untuned_a, const tw_stats *tuned_a,
                             const tw_stats *untuned_b, const tw_stats *tuned_b)
{
    tw_stats a;
    tw_stats b;

    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    a.median_ns = tuned_a->median_ns > 0 ? untuned_a->median_ns / tuned_a->median_ns : 0.0;
    b.median_ns = tuned_b->median_ns > 0 ? untuned_b->median_ns / tuned_b->median_ns : 0.0;
    a.spread = untuned_a->spread + tuned_a->spread;
    b.spread = untuned_b->spread + tuned_b->spread;
    return tw_stats_agree(&a, &b);
}

int tw_side_agrees(const tw_stats *untuned, const tw_stats *tuned, const tw_stats *baseline,
                   const tw_stats *row)
{
    return tw_stats_agree(untuned, baseline) && tw_stats_agree(tuned, row) &&
           tw_speedups_agree(untuned, tuned, baseline, row);
}

void tw_confirmation_derive(tw_confirmation *c, const tw_stats *baseline, const tw_stats *row)
{
    double search;
    double search_low;
    double search_high;

    tw_speedup_of(baseline, row, &search, &search_low, &search_high);
    c->search_speedup = search;
    c->from_search = 0;
    if (c->quality == TW_QUALITY_BUSY) {
        /* the paired rounds' figure stands: the search's fell on other moments */
        c->agreed = 1;
        c->side_speedup = c->speedup;
    } else {
        c->agreed = tw_side_agrees(&c->untuned, &c->tuned, baseline, row);
        c->quality = c->agreed ? (c->tries == 1 ? TW_QUALITY_CONSISTENT : TW_QUALITY_REMEASURED)
                               : TW_QUALITY_INCONSISTENT;
        tw_speedup_of(&c->untuned, &c->tuned, &c->speedup, &c->speedup_low, &c->speedup_high);
        c->side_speedup = c->speedup;
        if (!c->agreed && search < c->speedup) {
            /* the conservative figure: what the search measured for the same cut */
            c->from_search = 1;
            c->speedup = search;
            c->speedup_low = search_low;
            c->speedup_high = search_high;
        }
    }
    c->confirmed = c->speedup_low > 1.0;
}

/* The widest spread of any measurement of the result. */
static double tw_result_max_spread(const tw_result *result)
{
    double widest = 0.0;
    size_t i;

    if (result->baseline_measured) {
        widest = result->baseline.spread;
    }
    for (i = 0; i < result->row_count; i++) {
        if (result->rows[i].row.state == TW_ROW_MEASURED && result->rows[i].row.stats.spread > widest) {
            widest = result->rows[i].row.stats.spread;
        }
    }
    if (result->confirmation.measured) {
        widest = result->confirmation.tuned.spread > widest ? result->confirmation.tuned.spread : widest;
        widest = result->confirmation.untuned.spread > widest ? result->confirmation.untuned.spread : widest;
    }
    return widest;
}

/* others / capacity within 0..1, or -1 when the capacity is too small to tell. */
static double tw_share_of(double others, double capacity)
{
    double share;

    if (!(capacity >= TW_LOAD_MIN_CAPACITY)) {
        return -1.0;
    }
    share = others / capacity;
    return share < 0.0 ? 0.0 : share > 1.0 ? 1.0 : share;
}

double tw_result_others_share(const tw_result *result)
{
    double base;
    double side;

    if (result == NULL || result->dry_run) {
        return -1.0;
    }
    base = tw_share_of(result->baseline_others, result->baseline_capacity);
    side = tw_share_of(result->side_others, result->side_capacity);
    if (base < 0.0 && side < 0.0) {
        return tw_share_of(result->baseline_others + result->side_others,
                           result->baseline_capacity + result->side_capacity);
    }
    return base > side ? base : side;
}

int tw_result_busy_stopped(const tw_result *result)
{
    return result != NULL && result->busy_stopped;
}

void tw_result_budgets(const tw_result *result, uint64_t *time_budget_ns,
                       uint64_t *busy_budget_ns)
{
    if (time_budget_ns != NULL) {
        *time_budget_ns = result != NULL ? result->time_budget_ns : 0;
    }
    if (busy_budget_ns != NULL) {
        *busy_budget_ns = result != NULL ? result->busy_budget_ns : 0;
    }
}

int tw_result_busy(const tw_result *result)
{
    return tw_result_others_share(result) > TW_BUSY_SHARE;
}

int tw_result_noisy(const tw_result *result)
{
    /* a speedup confirmed in spite of the spread needs no excuse */
    if (result == NULL || (result->confirmation.measured && result->confirmation.confirmed)) {
        return 0;
    }
    return tw_result_max_spread(result) > TW_NOISY_SPREAD;
}

int tw_result_module(const tw_result *result, size_t node, const char **error)
{
    const tw_module_result *module = tw_result_module_search(result, node);

    if (error != NULL) {
        *error = tw_module_result_error(module);
    }
    return tw_module_result_state(module);
}

const tw_module_result *tw_result_module_search(const tw_result *result, size_t node)
{
    return result != NULL && node < result->module_count ? result->modules[node] : NULL;
}

int tw_result_row_has(const tw_result *result, size_t i, size_t node)
{
    if (result == NULL || i >= result->row_count || node >= result->module_count) {
        return 0;
    }
    return result->in_cut[i * result->module_count + node];
}

/* ---------------------------------------------------------- module search */

void tw_module_result_destroy(tw_module_result *module)
{
    size_t g;
    size_t c;
    tw_group_entry *group;

    if (module == NULL) {
        goto cleanup;
    }
    /* group_count is only set once groups exists and is zeroed */
    for (g = 0; g < module->group_count; g++) {
        group = &module->groups[g];
        for (c = 0; group->names != NULL && c < group->n_candidates; c++) {
            tw_host_release(&module->host, group->names[c]);
        }
        tw_host_release(&module->host, group->names);
        tw_host_release(&module->host, group->reports);
        tw_host_release(&module->host, group->text);
        tw_host_release(&module->host, group->error);
    }
    tw_host_release(&module->host, module->groups);
    tw_host_release(&module->host, module->path);
    tw_host_release(&module->host, module->error);
    tw_host_release(&module->host, module);
cleanup:
    return;
}

int tw_module_result_state(const tw_module_result *module)
{
    return module != NULL ? module->state : 0;
}

const char *tw_module_result_error(const tw_module_result *module)
{
    return module != NULL && module->error != NULL ? module->error : "";
}

const char *tw_module_result_path(const tw_module_result *module)
{
    return module != NULL ? module->path : "";
}

size_t tw_module_result_group_count(const tw_module_result *module)
{
    return module != NULL ? module->group_count : 0;
}

tw_code tw_module_result_group(const tw_module_result *module, size_t g,
                               tw_group_report *out, tw_error *err)
{
    tw_code rc = TW_OK;
    const tw_group_entry *group;

    if (module == NULL || out == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "%s is NULL", module == NULL ? "module" : "out");
        goto cleanup;
    }
    if (g >= module->group_count) {
        rc = tw_error_set(err, TW_EINVAL, "group %zu is out of range: the module has %zu groups",
                          g, module->group_count);
        goto cleanup;
    }
    group = &module->groups[g];
    out->text = group->text != NULL ? group->text : "";
    out->kind = group->kind;
    out->n_samples = group->n_samples;
    out->n_candidates = group->n_candidates;
    out->chosen = group->chosen;
    out->error = group->error != NULL ? group->error : "";
cleanup:
    return rc;
}

tw_code tw_module_result_candidate(const tw_module_result *module, size_t g, size_t c,
                                   const char **name, tw_candidate_report *report,
                                   tw_error *err)
{
    tw_code rc = TW_OK;
    const tw_group_entry *group;

    if (module == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "module is NULL");
        goto cleanup;
    }
    if (g >= module->group_count || c >= module->groups[g].n_candidates) {
        rc = tw_error_set(err, TW_EINVAL, "candidate %zu of group %zu is out of range", c, g);
        goto cleanup;
    }
    group = &module->groups[g];
    if (name != NULL) {
        *name = group->names[c];
    }
    if (report != NULL) {
        *report = group->reports[c];
    }
cleanup:
    return rc;
}

/* ------------------------------------------------------------------ table */

/* Fixed columns: marker, depth, modules, failed, then the search's latency,
 * spread and speedup, then the confirmed speedup; the status comes last because
 * it is the only field of unbounded length. */
#define TW_TABLE_ROW "%-2s%7s  %7s  %6s  %9s  %6s  %6s  %9s"

/* The digits the confirmed figure is written with, wherever it is written: a
 * busy keep whose interval's low end lies just above 1 is written with the
 * digit that shows it above 1 (1.003x, not 1.00x), and its figure and high end
 * with it; else 2. */
static int tw_confirmed_digits(const tw_confirmation *c)
{
    return c->quality == TW_QUALITY_BUSY && c->confirmed && c->speedup_low > 1.0 &&
                   c->speedup_low < 1.005
               ? 3
               : 2;
}

static void tw_format_latency(char *out, size_t size, const tw_stats *stats, int valid)
{
    if (valid) {
        snprintf(out, size, "%.3f", stats->median_ns / 1e6);
    } else {
        snprintf(out, size, "-");
    }
}

/* The relative spread of the rounds, (q75 - q25) / median, in percent. */
static void tw_format_spread(char *out, size_t size, const tw_stats *stats, int valid)
{
    if (valid && isfinite(stats->spread)) {
        snprintf(out, size, "%.0f%%", stats->spread * 100.0);
    } else {
        snprintf(out, size, "-");
    }
}

/* Speedup is baseline median over row median; "-" when either is unknown. */
static void tw_format_speedup(char *out, size_t size, const tw_result *result,
                              const tw_stats *stats, int valid)
{
    if (valid && result->baseline_measured && stats->median_ns > 0) {
        snprintf(out, size, "%.2fx", result->baseline.median_ns / stats->median_ns);
    } else {
        snprintf(out, size, "-");
    }
}

void tw_result_confirmed_figure(const tw_result *result, char *out, size_t size)
{
    const tw_confirmation *c = result != NULL ? &result->confirmation : NULL;

    if (out == NULL || size == 0) {
        return;
    }
    if (c != NULL && c->measured) {
        snprintf(out, size, "%.*fx", tw_confirmed_digits(c), c->speedup);
    } else {
        out[0] = '\0';
    }
}

/* The confirmed column of row i: the confirmation's figure on the row of the
 * depth it measured (the same number the last line gives), else "-". */
static void tw_format_confirmed(char *out, size_t size, const tw_result *result, size_t i)
{
    const tw_confirmation *c = &result->confirmation;
    const tw_row *row = &result->rows[i].row;

    if (c->measured && row->state == TW_ROW_MEASURED && c->depth == row->depth) {
        tw_result_confirmed_figure(result, out, size);
    } else {
        snprintf(out, size, "-");
    }
}

/* The status of a measured row: selected, or why the confirmed depth was not kept. */
static void tw_format_measured_status(tw_buf *buf, const tw_result *result, size_t i)
{
    const tw_confirmation *c = &result->confirmation;
    const tw_row *row = &result->rows[i].row;
    int busy = c->measured && c->quality == TW_QUALITY_BUSY;

    if ((long)i == result->selected) {
        tw_buf_appendf(buf, "  selected%s", busy ? ", measured busy in paired rounds"
                                            : c->measured && c->from_search
                                                ? ", by the search's figure (the smaller)"
                                            : c->measured ? ", measured side by side" : "");
    } else if (c->measured && !c->confirmed && c->depth == row->depth) {
        tw_buf_appendf(buf, "  %s %s", c->speedup_high < 1.0 ? "slower" : "within noise",
                       busy ? "in paired rounds (busy)"
                            : c->from_search ? "by the search's figure (the smaller)"
                                             : "side by side");
    }
}

static void tw_format_depth_row(tw_buf *buf, const tw_result *result, size_t i)
{
    const tw_row *row = &result->rows[i].row;
    int measured = row->state == TW_ROW_MEASURED;
    char depth[16];
    char modules[24];
    char failed[24];
    char latency[32];
    char spread[32];
    char speedup[32];
    char confirmed[32];

    snprintf(depth, sizeof depth, "%d", row->depth);
    snprintf(modules, sizeof modules, "%zu", row->modules);
    /* a dry run tunes nothing, so no module can have failed yet */
    if (row->state == TW_ROW_DRY) {
        snprintf(failed, sizeof failed, "-");
    } else {
        snprintf(failed, sizeof failed, "%zu", row->failed);
    }
    tw_format_latency(latency, sizeof latency, &row->stats, measured);
    tw_format_spread(spread, sizeof spread, &row->stats, measured);
    tw_format_speedup(speedup, sizeof speedup, result, &row->stats, measured);
    tw_format_confirmed(confirmed, sizeof confirmed, result, i);
    tw_buf_appendf(buf, TW_TABLE_ROW, (long)i == result->selected ? ">" : "", depth,
                   modules, failed, latency, spread, speedup, confirmed);
    switch (row->state) {
    case TW_ROW_MEASURED:
        tw_format_measured_status(buf, result, i);
        break;
    case TW_ROW_SKIPPED:
        tw_buf_appendf(buf, "  skipped: ");
        tw_buf_append_line(buf, row->error, 100);
        break;
    case TW_ROW_BUDGET:
        tw_buf_appendf(buf, "  %s", row->error != NULL && row->error[0] ? row->error
                                                                      : "time budget used up");
        break;
    case TW_ROW_DRY:
        tw_buf_appendf(buf, "  dry run");
        break;
    }
    tw_buf_appendf(buf, "\n");
}

/* Whether no depth was measured because the time budget ran out before any. */
static int tw_nothing_tried(const tw_result *result)
{
    size_t i;

    for (i = 0; i < result->row_count; i++) {
        if (result->rows[i].row.state != TW_ROW_BUDGET) {
            return 0;
        }
    }
    return result->row_count > 0;
}

/* The reason every depth was skipped for, when they all were for one (a caller
 * that refused every cut, say), else NULL. */
static const char *tw_one_skip_reason(const tw_result *result)
{
    const char *reason = NULL;
    size_t i;

    for (i = 0; i < result->row_count; i++) {
        const tw_row *row = &result->rows[i].row;

        if (row->state != TW_ROW_SKIPPED || row->error == NULL || row->error[0] == '\0' ||
            (reason != NULL && strcmp(reason, row->error) != 0)) {
            return NULL;
        }
        reason = row->error;
    }
    return reason;
}

/* The measured row of `depth`, or NULL. */
static const tw_row *tw_measured_row(const tw_result *result, int depth)
{
    size_t i;

    for (i = 0; i < result->row_count; i++) {
        if (result->rows[i].row.state == TW_ROW_MEASURED && result->rows[i].row.depth == depth) {
            return &result->rows[i].row;
        }
    }
    return NULL;
}

/* The one line saying that the side-by-side figures never agreed with the
 * search's, with both. */
static void tw_format_disagreement(tw_buf *buf, const tw_result *result)
{
    const tw_confirmation *c = &result->confirmation;
    const tw_row *row = tw_measured_row(result, c->depth);

    /* latencies only: the side-by-side ratio may be the one that is not to be believed */
    tw_buf_appendf(buf, "the figures disagree: side by side depth %d took %.3f ms and the untuned "
                   "model %.3f ms, in the search %.3f ms and %.3f ms (%u side-by-side "
                   "measurement%s): the machine's load changed while measuring; the smaller "
                   "speedup counts\n", c->depth, c->tuned.median_ns / 1e6,
                   c->untuned.median_ns / 1e6, row != NULL ? row->stats.median_ns / 1e6 : 0.0,
                   result->baseline.median_ns / 1e6, c->tries, c->tries == 1 ? "" : "s");
}

/* After a busy verdict that its paired rounds could not reach for lack of
 * time: the one setting that buys them, as tt.tweak's keyword. */
static void tw_format_wanted(tw_buf *buf, const tw_result *result)
{
    const tw_confirmation *c = &result->confirmation;
    int busy = c->busy_budget_wanted_ns != 0;
    uint64_t wanted = busy ? c->busy_budget_wanted_ns : c->time_budget_wanted_ns;

    if (wanted == 0 && c->rounds_ran_out && c->speedup > 1.0) {
        tw_buf_appendf(buf, "; its rounds ran out of time, and at this load no budget buys "
                       "enough of them (it won %u of %u): tweak again on a quieter machine",
                       c->paired_wins, c->paired_rounds);
        return;
    }
    if (wanted == 0) {
        return;
    }
    tw_buf_appendf(buf, "; the %s budget (%.3g s) ran out before the rounds could decide: "
                   "%s=%.0f buys them", busy ? "busy" : "time",
                   (double)(busy ? result->busy_budget_ns : result->time_budget_ns) / 1e9,
                   busy ? "busy_budget" : "time_budget", (double)wanted / 1e9);
}

/* The last line of a result measured on a busy machine: the paired rounds'
 * figure, marked busy, and whether the depth was kept. */
static void tw_format_busy(tw_buf *buf, const tw_result *result, const char *untuned)
{
    const tw_confirmation *c = &result->confirmation;
    double share = tw_result_others_share(result) * 100.0;
    int low_digits = tw_confirmed_digits(c);
    char figure[32];

    tw_result_confirmed_figure(result, figure, sizeof figure);
    if (c->confirmed) {
        tw_buf_appendf(buf, "kept depth %d: %s faster than untuned, measured busy (other "
                       "processes took %.0f%% of the CPUs) in %u paired rounds, 99%% interval "
                       "%.*fx to %.*fx; tweak again on a quiet machine for a quiet figure\n",
                       c->depth, figure, share, c->paired_rounds, low_digits,
                       c->speedup_low, low_digits, c->speedup_high);
    } else {
        tw_buf_appendf(buf, "depth %d was %s the untuned model, measured busy (other processes "
                       "took %.0f%% of the CPUs) in %u paired rounds (%s, 99%% interval "
                       "%.2fx to %.2fx): %s", c->depth,
                       c->speedup_high < 1.0 ? "slower than" : "within noise of", share,
                       c->paired_rounds, figure, c->speedup_low, c->speedup_high, untuned);
        tw_format_wanted(buf, result);
        tw_buf_appendf(buf, "\n");
    }
}

static void tw_format_summary(tw_buf *buf, const tw_result *result, const char *untuned)
{
    const tw_row *row;
    const char *skipped;
    const tw_confirmation *c = &result->confirmation;
    const tw_stats *tuned = &c->tuned;
    const tw_stats *base = &c->untuned;
    const char *how = "measured side by side";
    char figure[32];

    tw_result_confirmed_figure(result, figure, sizeof figure);
    if (c->measured && !c->agreed) {
        tw_format_disagreement(buf, result);
        how = c->from_search ? "by the smaller figure, the search's"
                             : "by the smaller figure, measured side by side";
    } else if (c->measured && c->quality == TW_QUALITY_REMEASURED) {
        how = "measured side by side again after the load changed";
    }
    if (c->measured && c->from_search && (row = tw_measured_row(result, c->depth)) != NULL) {
        /* the search's pair: its untuned baseline and the depth's row */
        tuned = &row->stats;
        base = &result->baseline;
    }
    if (result->dry_run) {
        tw_buf_appendf(buf, "dry run: nothing was built or measured\n");
    } else if (c->measured && c->quality == TW_QUALITY_BUSY) {
        tw_format_busy(buf, result, untuned);
    } else if (c->measured && c->confirmed) {
        tw_buf_appendf(buf, "kept depth %d: %s faster than untuned, %s "
                       "(%.3f ms, spread %.0f%%, against %.3f ms, spread %.0f%%; %.2fx to "
                       "%.2fx)\n", c->depth, figure, how, tuned->median_ns / 1e6,
                       tuned->spread * 100.0, base->median_ns / 1e6,
                       base->spread * 100.0, c->speedup_low, c->speedup_high);
    } else if (c->measured) {
        tw_buf_appendf(buf, "depth %d was %s the untuned model, %s (%s, from %.2fx to "
                       "%.2fx): %s\n", c->depth,
                       c->speedup_high < 1.0 ? "slower than" : "within noise of", how,
                       figure, c->speedup_low, c->speedup_high, untuned);
    } else if (result->selected >= 0) {
        row = &result->rows[result->selected].row;
        tw_buf_appendf(buf, "selected depth %d: %.2fx faster than untuned (%.3f ms against "
                       "%.3f ms)\n", row->depth,
                       row->stats.median_ns > 0
                           ? result->baseline.median_ns / row->stats.median_ns : 0.0,
                       row->stats.median_ns / 1e6, result->baseline.median_ns / 1e6);
    } else if (tw_nothing_tried(result)) {
        if (result->time_budget_ns <= 1) {
            tw_buf_appendf(buf, "no depth was tried: the time budget was 0: %s\n", untuned);
        } else {
            tw_buf_appendf(buf, "no depth was tried: the time budget (%.3g s) was used up "
                           "before the first depth: %s\n", result->time_budget_ns / 1e9,
                           untuned);
        }
    } else if ((skipped = tw_one_skip_reason(result)) != NULL) {
        tw_buf_appendf(buf, "every depth was skipped: %s: %s\n", skipped, untuned);
    } else {
        tw_buf_appendf(buf, "no depth beat the untuned model: %s\n", untuned);
    }
}

/* What the tweak kept and by how much, then the notes on the machine (busy budget,
 * busy, noisy): the lines that end the table, and tw_result_outcome_as's text. */
static void tw_format_outcome(tw_buf *buf, const tw_result *result, const char *untuned)
{
    tw_format_summary(buf, result, untuned != NULL ? untuned : "it stays untuned");
    if (result->busy_stopped) {
        tw_buf_appendf(buf, "the machine was busy: tuning stopped at its busy budget (%.0f s), "
                       "so deeper depths were not tried (busy_budget= raises it); tweak again "
                       "on a quiet machine to try them\n", result->busy_budget_ns / 1e9);
    }
    if (result->confirmation.measured && result->confirmation.quality == TW_QUALITY_BUSY) {
        /* the summary said it */
    } else if (tw_result_busy(result)) {
        /* no figure was claimed; the untuned model's measurement still fell on a busy moment */
        tw_buf_appendf(buf, "other processes took %.0f%% of the CPUs while the untuned model was "
                       "measured: the machine was busy; close other work and tweak again\n",
                       tw_result_others_share(result) * 100.0);
    } else if (tw_result_noisy(result)) {
        tw_buf_appendf(buf, "the measurements spread by up to %.0f%%: the machine was busy; close "
                       "other work and tweak again, or measure longer (measure={\"rounds_max\": "
                       "200})\n", tw_result_max_spread(result) * 100.0);
    }
}

char *tw_result_format(const tw_result *result, tw_error *err)
{
    return tw_result_format_as(result, NULL, err);
}

char *tw_result_format_as(const tw_result *result, const char *untuned, tw_error *err)
{
    tw_buf buf;
    char *text = NULL;
    char latency[32];
    char spread[32];
    char speedup[32];
    size_t i;

    if (result == NULL) {
        tw_error_set(err, TW_EINVAL, "result is NULL");
        goto cleanup;
    }
    tw_buf_init(&buf, &result->host);
    tw_buf_appendf(&buf, TW_TABLE_ROW "  %s\n", "", "depth", "modules", "failed",
                   "search ms", "spread", "search", "confirmed", "status");
    tw_buf_appendf(&buf, TW_TABLE_ROW "  %s\n", "", "-----", "-------", "------",
                   "---------", "------", "------", "---------", "------");
    for (i = 0; i < result->row_count; i++) {
        tw_format_depth_row(&buf, result, i);
    }
    tw_format_latency(latency, sizeof latency, &result->baseline, result->baseline_measured);
    tw_format_spread(spread, sizeof spread, &result->baseline, result->baseline_measured);
    tw_format_speedup(speedup, sizeof speedup, result, &result->baseline,
                      result->baseline_measured);
    /* the untuned model wraps nothing: its module columns stay empty */
    tw_buf_appendf(&buf, TW_TABLE_ROW "%s\n", "", "untuned", "-", "-", latency, spread, speedup,
                   "-", result->baseline_measured ? "" : "  not measured");
    tw_format_outcome(&buf, result, untuned);
    text = tw_buf_take(&buf);
    if (text == NULL) {
        tw_error_set(err, TW_ENOMEM, "out of memory formatting the result table");
    }
cleanup:
    return text;
}

char *tw_result_outcome_as(const tw_result *result, const char *untuned, tw_error *err)
{
    tw_buf buf;
    char *text = NULL;

    if (result == NULL) {
        tw_error_set(err, TW_EINVAL, "result is NULL");
        return NULL;
    }
    tw_buf_init(&buf, &result->host);
    tw_format_outcome(&buf, result, untuned);
    text = tw_buf_take(&buf);
    if (text == NULL) {
        tw_error_set(err, TW_ENOMEM, "out of memory formatting the result's outcome");
    }
    return text;
}

/* ------------------------------------------------------------ kept result */

/* TW_EINVAL naming `what` when `stats` are no measurement's: a latency that is
 * negative or not finite, quartiles out of order, a spread negative or NaN. */
static tw_code tw_check_kept_stats(const tw_stats *stats, const char *what, tw_error *err)
{
    const double values[4] = {stats->min_ns, stats->q25_ns, stats->median_ns, stats->q75_ns};
    size_t i;

    for (i = 0; i < 4; i++) {
        if (!isfinite(values[i]) || values[i] < 0.0) {
            return tw_error_set(err, TW_EINVAL, "%s: a latency of %g ns is no measurement's",
                                what, values[i]);
        }
    }
    if (!(stats->min_ns <= stats->q25_ns && stats->q25_ns <= stats->median_ns &&
          stats->median_ns <= stats->q75_ns)) {
        return tw_error_set(err, TW_EINVAL, "%s: its minimum, quartiles and median are out of "
                            "order", what);
    }
    if (isnan(stats->spread) || stats->spread < 0.0) {
        return tw_error_set(err, TW_EINVAL, "%s: a spread of %g is no measurement's", what,
                            stats->spread);
    }
    return TW_OK;
}

/* The rows, the selection and the baseline of a record, checked. */
static tw_code tw_check_kept_rows(const tw_result_record *record, tw_error *err)
{
    char what[64];
    const tw_row *row;
    tw_code rc = TW_OK;
    size_t i;

    if (record->row_count > TW_RESULT_MAX_ROWS || (record->rows == NULL && record->row_count > 0)) {
        return tw_error_set(err, TW_EINVAL, "%zu rows, more than the %u a kept result may have, "
                            "or none given", record->row_count, TW_RESULT_MAX_ROWS);
    }
    for (i = 0; i < record->row_count && rc == TW_OK; i++) {
        row = &record->rows[i];
        snprintf(what, sizeof what, "row %zu (depth %d)", i, row->depth);
        if ((int)row->state < (int)TW_ROW_MEASURED || (int)row->state > (int)TW_ROW_DRY ||
            row->depth < 0 || row->failed > row->modules) {
            rc = tw_error_set(err, TW_EINVAL, "%s: its state, depth or module counts are no "
                              "tweak's", what);
        } else if (row->state == TW_ROW_MEASURED) {
            rc = tw_check_kept_stats(&row->stats, what, err);
        }
    }
    if (rc == TW_OK && (record->selected < -1 || record->selected >= (long)record->row_count ||
                        (record->selected >= 0 &&
                         (record->rows[record->selected].state != TW_ROW_MEASURED ||
                          !record->baseline_measured)))) {
        rc = tw_error_set(err, TW_EINVAL, "the selected row (%ld) is not a measured row of a "
                          "result with an untuned baseline", record->selected);
    }
    if (rc == TW_OK && record->baseline_measured) {
        rc = tw_check_kept_stats(&record->baseline, "the untuned baseline", err);
    }
    if (rc == TW_OK && !(record->others_share == -1.0 ||
                         (record->others_share >= 0.0 && record->others_share <= 1.0))) {
        rc = tw_error_set(err, TW_EINVAL, "a share of the CPUs of %g is neither -1 (unknown) "
                          "nor within 0..1", record->others_share);
    }
    return rc;
}

/* A record's confirmation, checked before its figures are derived again. */
static tw_code tw_check_kept_confirmation(const tw_confirmation *c, tw_error *err)
{
    tw_code rc = TW_OK;

    if (c->tries < 1 || c->tries > TW_CONFIRM_TRIES + 1 || (int)c->quality < 0 ||
        (int)c->quality > (int)TW_QUALITY_BUSY || c->quality == TW_QUALITY_UNCHECKED) {
        rc = tw_error_set(err, TW_EINVAL, "the confirmation's tries (%u) or quality are no "
                          "tweak's", (unsigned)c->tries);
    } else if (!(c->others_share == -1.0 || (isfinite(c->others_share) && c->others_share >= 0))) {
        rc = tw_error_set(err, TW_EINVAL, "the confirmation's share of the CPUs (%g) is neither "
                          "-1 (unknown) nor a share", c->others_share);
    } else if ((rc = tw_check_kept_stats(&c->tuned, "the confirmation's tuned figure",
                                         err)) != TW_OK ||
               (rc = tw_check_kept_stats(&c->untuned, "the confirmation's untuned figure",
                                         err)) != TW_OK) {
        /* said */
    } else if (c->quality == TW_QUALITY_BUSY &&
               (isnan(c->speedup) || !(c->speedup_low >= 0.0) ||
                !(c->speedup_low <= c->speedup && c->speedup <= c->speedup_high) ||
                c->paired_wins > c->paired_rounds ||
                c->paired_rounds > TW_PAIRED_ROUNDS_MAX)) {
        rc = tw_error_set(err, TW_EINVAL, "the busy figure %gx (%gx to %gx, %u of %u paired "
                          "rounds) is no paired rounds'", c->speedup, c->speedup_low,
                          c->speedup_high, (unsigned)c->paired_wins, (unsigned)c->paired_rounds);
    }
    return rc;
}

/* The record's confirmation into the result, its figures derived again from
 * its measurements, and checked against the selection. */
static tw_code tw_restore_confirmation(tw_result *result, const tw_result_record *record,
                                       tw_error *err)
{
    const tw_confirmation *kept = &record->confirmation;
    tw_confirmation *c = &result->confirmation;
    const tw_row *row;
    tw_code rc;

    if (!kept->measured) {
        return TW_OK;
    }
    rc = tw_check_kept_confirmation(kept, err);
    if (rc != TW_OK) {
        return rc;
    }
    if ((row = tw_measured_row(result, kept->depth)) == NULL || !result->baseline_measured) {
        return tw_error_set(err, TW_EINVAL, "the confirmation is of depth %d, which no measured "
                            "row of a result with an untuned baseline has", kept->depth);
    }
    c->measured = 1;
    c->depth = kept->depth;
    c->tuned = kept->tuned;
    c->untuned = kept->untuned;
    c->tries = kept->tries;
    c->quality = kept->quality;
    c->others_share = kept->others_share;
    if (kept->quality == TW_QUALITY_BUSY) {
        c->speedup = kept->speedup;
        c->speedup_low = kept->speedup_low;
        c->speedup_high = kept->speedup_high;
        c->paired_rounds = kept->paired_rounds;
        c->paired_wins = kept->paired_wins;
        c->busy_budget_wanted_ns = kept->busy_budget_wanted_ns;
        c->time_budget_wanted_ns = kept->time_budget_wanted_ns;
        c->rounds_ran_out = kept->rounds_ran_out != 0;
    }
    tw_confirmation_derive(c, &result->baseline, &row->stats);
    if (c->confirmed && (c->busy_budget_wanted_ns != 0 || c->time_budget_wanted_ns != 0 ||
                         c->rounds_ran_out)) {
        return tw_error_set(err, TW_EINVAL, "the confirmation keeps depth %d and says its rounds "
                            "ran out undecided", c->depth);
    }
    if (c->busy_budget_wanted_ns != 0 && c->time_budget_wanted_ns != 0) {
        return tw_error_set(err, TW_EINVAL, "the confirmation wants both a busy and a time "
                            "budget; one budget is in force");
    }
    if (c->quality != kept->quality) {
        return tw_error_set(err, TW_EINVAL, "the confirmation says its figures were %s; they are "
                            "%s", tw_quality_name(kept->quality), tw_quality_name(c->quality));
    }
    if (c->confirmed != (result->selected >= 0) ||
        (c->confirmed && result->rows[result->selected].row.depth != c->depth)) {
        return tw_error_set(err, TW_EINVAL, "the selected row (%ld) is not the depth its "
                            "confirmation %s (depth %d, %.2fx from %.2fx)", result->selected,
                            c->confirmed ? "keeps" : "leaves", c->depth, c->speedup,
                            c->speedup_low);
    }
    return TW_OK;
}

tw_code tw_result_restore(const tw_host *host, const tw_result_record *record,
                          tw_result **out, tw_error *err)
{
    tw_result *result = NULL;
    tw_host resolved;
    tw_code rc;
    size_t i;

    if (record == NULL || out == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "%s is NULL", record == NULL ? "record" : "out");
        goto cleanup;
    }
    *out = NULL;
    tw_host_resolve(host, &resolved);
    rc = tw_check_kept_rows(record, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    result = tw_result_create(&resolved, record->row_count, 0);
    if (result == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory restoring a result of %zu rows",
                          record->row_count);
        goto cleanup;
    }
    for (i = 0; i < record->row_count; i++) {
        result->rows[i].row = record->rows[i];
        result->rows[i].row.error = result->rows[i].error; /* its own copy */
        tw_result_set_row_error(result, i, record->rows[i].error != NULL ? record->rows[i].error
                                                                         : "");
    }
    result->selected = record->selected;
    result->baseline = record->baseline;
    result->baseline_measured = record->baseline_measured != 0;
    result->baseline_others = record->others_share >= 0.0 ? record->others_share : 0.0;
    result->baseline_capacity = record->others_share >= 0.0 ? 1.0 : 0.0; /* >= TW_LOAD_MIN_CAPACITY */
    result->busy_stopped = record->busy_stopped != 0;
    result->time_budget_ns = record->time_budget_ns;
    result->busy_budget_ns = record->busy_budget_ns;
    rc = tw_restore_confirmation(result, record, err);
    if (rc == TW_OK) {
        *out = result;
        result = NULL;
    }
cleanup:
    tw_result_destroy(result);
    return rc;
}
