/*
 * strategy.c - the strategies' decision rules: which backend a module keeps.
 */
#include <math.h>
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

const char *tw_reason_name(tw_reason reason)
{
    const char *name = NULL;

    switch (reason) {
    case TW_REASON_NONE: name = ""; break;
    case TW_REASON_BUILD_FAILED: name = "build failed"; break;
    case TW_REASON_UNAVAILABLE: name = "unavailable"; break;
    case TW_REASON_CRASHED: name = "crashed"; break;
    case TW_REASON_MISMATCH: name = "mismatch"; break;
    case TW_REASON_DYNAMIC_SHAPES: name = "dynamic shapes"; break;
    case TW_REASON_OUT_OF_MEMORY: name = "out of memory"; break;
    case TW_REASON_BUDGET: name = "time budget"; break;
    }
    return name;
}

void tw_report_reset(tw_candidate_report *report)
{
    memset(report, 0, sizeof *report);
    report->state = TW_CAND_NOT_TRIED;
    report->facts.reason = TW_REASON_NONE;
    report->facts.max_error = NAN;
    report->facts.tolerance = NAN;
    report->facts.own_error = NAN;
}

int tw_budget_spent(const tw_host *host, const tw_budget *budget)
{
    int spent = 0;
    uint64_t now;

    if (budget != NULL && budget->ns != 0) {
        now = tw_host_now(host);
        spent = now > budget->start_ns && now - budget->start_ns >= budget->ns;
    }
    return spent;
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

/* Builds candidate i, timed by the host's clock. A rejection marks it FAILED
 * (with a reason) and is not an error of the call; only TW_EINTERRUPT is
 * returned. */
static tw_code tw_build_candidate(const tw_host *host, const tw_candidate *cand,
                                  tw_candidate_report *report, int *built, tw_error *err)
{
    tw_code rc;
    tw_error cb_err;
    tw_error cause;
    char what[TW_MSG_SIZE];
    uint64_t started;
    uint64_t ended;

    *built = 0;
    tw_error_clear(&cb_err);
    started = tw_host_now(host);
    rc = cand->build(cand->ctx, &cb_err);
    ended = tw_host_now(host);
    report->build_ns = ended > started && report->facts.reason != TW_REASON_BUDGET
                           ? ended - started : 0;
    if (rc != TW_OK && report->facts.reason == TW_REASON_NONE) {
        report->facts.reason = TW_REASON_BUILD_FAILED;
    }
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

static tw_code tw_choose_first(const tw_host *host, const tw_candidate *cands, size_t n,
                               long *chosen, tw_candidate_report *reports, tw_error *err)
{
    tw_code rc = TW_OK;
    int built = 0;
    size_t i;

    for (i = 0; i < n && !built; i++) {
        rc = tw_build_candidate(host, &cands[i], &reports[i], &built, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        if (built) {
            TW_ASSERT(reports[i].state == TW_CAND_BUILT || reports[i].state == TW_CAND_MEASURED);
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
        rc = tw_build_candidate(host, &cands[i], &reports[i], &built, err);
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
        tw_report_reset(&reports[i]);
    }
    switch (kind) {
    case TW_STRATEGY_FIRST_WINS:
        rc = tw_choose_first(&resolved, candidates, n, chosen, reports, err);
        break;
    case TW_STRATEGY_HIGHEST_THROUGHPUT:
        rc = tw_choose_fastest(&resolved, candidates, n, cfg, chosen, reports, err);
        break;
    case TW_STRATEGY_ONE_BACKEND:
        rc = tw_build_candidate(&resolved, &candidates[0], &reports[0], &built, err);
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

const char *tw_candidate_state_name(tw_candidate_state state)
{
    const char *name = "unknown";

    switch (state) {
    case TW_CAND_NOT_TRIED: name = "not tried"; break;
    case TW_CAND_FAILED: name = "failed"; break;
    case TW_CAND_BUILT: name = "built"; break;
    case TW_CAND_MEASURED: name = "measured"; break;
    }
    return name;
}

const char *tw_candidate_verdict(const tw_candidate_report *report, int chosen)
{
    const char *verdict = "not tried";

    if (report == NULL) {
        goto cleanup;
    }
    if (chosen && report->state != TW_CAND_FAILED && report->state != TW_CAND_NOT_TRIED) {
        verdict = "chosen";
    } else if (report->state == TW_CAND_MEASURED) {
        verdict = "slower";
    } else {
        verdict = tw_candidate_state_name(report->state);
    }
cleanup:
    return verdict;
}

/* ---------------------------------------------------------- module search */

/* What one candidate's trampolines need to call the host back, and where its
 * build's facts go (its report, reset by tw_strategy_choose before any build). */
typedef struct tw_search_cand {
    const tw_module_ops *ops;
    size_t node;
    size_t group;
    size_t index;
    const tw_host *host;
    const tw_budget *budget;      /* NULL: none */
    unsigned flags;
    tw_candidate_report *report;
} tw_search_cand;

/* A variant is not built once the budget is used up: the strategy's own
 * backends still are, so the module still gets a choice. */
static tw_code tw_search_build(void *ctx, tw_error *err)
{
    const tw_search_cand *c = ctx;
    tw_code rc;

    if ((c->flags & TW_CAND_VARIANT) != 0 && tw_budget_spent(c->host, c->budget)) {
        c->report->facts.reason = TW_REASON_BUDGET;
        rc = tw_error_set(err, TW_EBUDGET, "not built: the time budget was used up before "
                          "this variant's turn (the backends alone still are)");
        goto cleanup;
    }
    rc = c->ops->build(c->ops->ctx, c->node, c->group, c->index, &c->report->facts, err);
cleanup:
    return rc;
}

static tw_code tw_search_run(void *ctx, size_t sample, tw_error *err)
{
    const tw_search_cand *c = ctx;

    return c->ops->run(c->ops->ctx, c->node, c->group, c->index, sample, err);
}

static tw_code tw_search_sync(void *ctx, tw_error *err)
{
    const tw_search_cand *c = ctx;

    return c->ops->sync(c->ops->ctx, err);
}

/* A copy of a message into *slot (replacing what it held); TW_ENOMEM when it
 * cannot be kept. */
static tw_code tw_keep_text(const tw_host *host, char **slot, const char *text, tw_error *err)
{
    tw_code rc = TW_OK;
    char *copy = tw_host_strdup(host, text != NULL ? text : "");

    if (copy == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory keeping a module's result");
        goto cleanup;
    }
    tw_host_release(host, *slot);
    *slot = copy;
cleanup:
    return rc;
}

/* Moves a built text into *slot as a host string (a tw_buf's text is freed
 * with tw_free, a result's strings with the host's release). */
static tw_code tw_keep_built_text(const tw_host *host, char **slot, tw_buf *buf, tw_error *err)
{
    tw_code rc;
    char *text = tw_buf_take(buf);

    if (text == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory explaining a failed search");
        goto cleanup;
    }
    rc = tw_keep_text(host, slot, text, err);
cleanup:
    tw_free(text);
    return rc;
}

/* Copies what group() said into the group's entry. */
static tw_code tw_keep_group_info(const tw_host *host, tw_group_entry *group,
                                  const tw_group_info *info, tw_error *err)
{
    tw_code rc;
    size_t c;

    rc = tw_keep_text(host, &group->text, info->text, err);
    if (rc != TW_OK || info->n_candidates == 0) {
        goto cleanup;
    }
    group->names = tw_host_alloc_array(host, info->n_candidates, sizeof *group->names);
    group->reports = tw_host_alloc_array(host, info->n_candidates, sizeof *group->reports);
    if (group->names == NULL || group->reports == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory keeping %zu candidates",
                          info->n_candidates);
        goto cleanup;
    }
    for (c = 0; c < info->n_candidates; c++) {
        group->names[c] = NULL;
        tw_report_reset(&group->reports[c]);
        group->reports[c].flags = info->flags != NULL ? info->flags[c] : 0u;
    }
    /* counted only now: destroy walks names[0..n_candidates) */
    group->n_candidates = info->n_candidates;
    for (c = 0; c < info->n_candidates && info->names != NULL; c++) {
        if (info->names[c] == NULL) {
            continue;
        }
        group->names[c] = tw_host_strdup(host, info->names[c]);
        if (group->names[c] == NULL) {
            rc = tw_error_set(err, TW_ENOMEM, "out of memory keeping a candidate's name");
            goto cleanup;
        }
    }
cleanup:
    return rc;
}

/* "no backend passed (a: why; b: not tried)": why a group chose nothing. */
static tw_code tw_explain_group(const tw_host *host, tw_group_entry *group, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_buf buf;
    size_t c;

    tw_buf_init(&buf, host);
    tw_buf_appendf(&buf, "no backend passed (");
    for (c = 0; c < group->n_candidates; c++) {
        const tw_candidate_report *r = &group->reports[c];

        tw_buf_appendf(&buf, "%s%s: %s", c > 0 ? "; " : "",
                       group->names[c] != NULL ? group->names[c] : "(unnamed)",
                       r->state == TW_CAND_FAILED && r->msg[0] != '\0'
                           ? r->msg : tw_candidate_state_name(r->state));
    }
    tw_buf_appendf(&buf, ")");
    rc = tw_keep_built_text(host, &group->error, &buf, err);
    return rc;
}

/* Runs the group's strategy on its candidates. A failure of the rule itself
 * (a refused info) fails the group; only TW_EINTERRUPT and TW_ENOMEM return. */
static tw_code tw_choose_group(const tw_host *host, const tw_module_ops *ops, size_t node,
                               size_t g, tw_group_entry *group, const tw_measure_config *cfg,
                               const tw_budget *budget, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_candidate *cands = NULL;
    tw_search_cand *ctxs = NULL;
    tw_error cause;
    size_t n = group->n_candidates;
    size_t c;

    if (n > 0) {
        cands = tw_host_alloc_array(host, n, sizeof *cands);
        ctxs = tw_host_alloc_array(host, n, sizeof *ctxs);
        if (cands == NULL || ctxs == NULL) {
            rc = tw_error_set(err, TW_ENOMEM, "out of memory choosing among %zu backends", n);
            goto cleanup;
        }
    }
    for (c = 0; c < n; c++) {
        ctxs[c].ops = ops;
        ctxs[c].node = node;
        ctxs[c].group = g;
        ctxs[c].index = c;
        ctxs[c].host = host;
        ctxs[c].budget = budget;
        ctxs[c].flags = group->reports[c].flags;
        ctxs[c].report = &group->reports[c];
        cands[c].name = group->names[c];
        cands[c].ctx = &ctxs[c];
        cands[c].build = tw_search_build;
        cands[c].runner.ctx = &ctxs[c];
        cands[c].runner.n_samples = group->n_samples;
        cands[c].runner.run = tw_search_run;
        cands[c].runner.sync = ops->sync != NULL ? tw_search_sync : NULL;
        cands[c].runner.round = NULL;
    }
    tw_error_clear(&cause);
    rc = tw_strategy_choose(host, group->kind, cands, n, cfg, &group->chosen, group->reports,
                            &cause);
    for (c = 0; c < n; c++) {
        group->reports[c].flags = ctxs[c].flags; /* the choice reset the reports */
    }
    if (rc == TW_EINTERRUPT || rc == TW_ENOMEM) {
        tw_error_set(err, rc, "%s", cause.msg);
        goto cleanup;
    }
    if (rc != TW_OK) {
        rc = tw_keep_text(host, &group->error, cause.msg, err);
        goto cleanup;
    }
    if (group->chosen < 0) {
        rc = tw_explain_group(host, group, err);
    }
cleanup:
    tw_host_release(host, cands);
    tw_host_release(host, ctxs);
    return rc;
}

/* Commits group g; a failing commit fails the group with its message. */
static tw_code tw_commit_group(const tw_host *host, const tw_module_ops *ops, size_t node,
                               size_t g, tw_group_entry *group, long chosen, tw_error *err)
{
    tw_code rc;
    tw_error cb_err;
    char what[64];

    tw_error_clear(&cb_err);
    rc = ops->commit(ops->ctx, node, g, chosen, &cb_err);
    if (rc == TW_OK) {
        goto cleanup;
    }
    snprintf(what, sizeof what, "commit of group %zu", g);
    tw_error_forward(&cb_err, rc, &cb_err, what);
    if (rc == TW_EINTERRUPT) {
        tw_error_set(err, rc, "%s", cb_err.msg);
        goto cleanup;
    }
    group->chosen = -1;
    rc = tw_keep_text(host, &group->error, cb_err.msg, err);
cleanup:
    return rc;
}

/* One group: begin it, choose, commit. Returns only what stops the search. */
static tw_code tw_search_group(const tw_host *host, const tw_module_ops *ops, size_t node,
                               size_t g, tw_group_entry *group, const tw_measure_config *cfg,
                               const tw_budget *budget, tw_error *err)
{
    tw_code rc;
    tw_code step;
    tw_group_info info;
    tw_error cb_err;
    char what[64];

    memset(&info, 0, sizeof info);
    tw_error_clear(&cb_err);
    step = ops->group(ops->ctx, node, g, &info, &cb_err);
    if (step != TW_OK) {
        snprintf(what, sizeof what, "group %zu", g);
        tw_error_forward(&cb_err, step, &cb_err, what);
        if (step == TW_EINTERRUPT) {
            rc = tw_error_set(err, step, "%s", cb_err.msg);
            goto commit;
        }
        rc = tw_keep_text(host, &group->error, cb_err.msg, err);
        if (rc == TW_OK) {
            rc = tw_keep_text(host, &group->text, "", err);
        }
        goto commit;
    }
    group->kind = info.kind;
    group->n_samples = info.n_samples;
    rc = tw_keep_group_info(host, group, &info, err);
    if (rc == TW_OK) {
        rc = tw_choose_group(host, ops, node, g, group, cfg, budget, err);
    }
commit:
    if (rc != TW_OK) {
        /* stopping: the host still gets its commit, and the first error wins */
        group->chosen = -1;
        (void)ops->commit(ops->ctx, node, g, -1, &cb_err);
    } else {
        rc = tw_commit_group(host, ops, node, g, group, group->chosen, err);
    }
    return rc;
}

/* The module's error: every failed group's, after its text when several. */
static tw_code tw_explain_module(tw_module_result *module, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_buf buf;
    size_t g;
    int first = 1;

    tw_buf_init(&buf, &module->host);
    for (g = 0; g < module->group_count; g++) {
        const tw_group_entry *group = &module->groups[g];

        if (group->error == NULL || group->error[0] == '\0') {
            continue;
        }
        if (module->group_count > 1 && group->text != NULL && group->text[0] != '\0') {
            tw_buf_appendf(&buf, "%s%s: %s", first ? "" : "; ", group->text, group->error);
        } else {
            tw_buf_appendf(&buf, "%s%s", first ? "" : "; ", group->error);
        }
        first = 0;
    }
    rc = tw_keep_built_text(&module->host, &module->error, &buf, err);
    return rc;
}

static tw_code tw_check_module_ops(const tw_module_ops *ops, tw_module_result **out,
                                   tw_error *err)
{
    tw_code rc = TW_OK;
    const char *missing;

    if (ops == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "ops is NULL: a module search needs its host's "
                          "callbacks");
        goto cleanup;
    }
    missing = ops->groups == NULL ? "groups" : ops->group == NULL ? "group"
            : ops->build == NULL ? "build" : ops->run == NULL ? "run"
            : ops->commit == NULL ? "commit" : NULL;
    if (missing != NULL) {
        rc = tw_error_set(err, TW_EINVAL, "ops.%s is NULL: every callback but sync is needed",
                          missing);
    } else if (out == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "out is NULL: the search needs a place for its result");
    }
cleanup:
    return rc;
}

/* The search behind tw_tune_module, with a resolved host and a checked cfg. */
static tw_code tw_search_module(const tw_host *host, const tw_module_ops *ops, size_t node,
                                const char *path, const tw_measure_config *cfg,
                                const tw_budget *budget, tw_module_result **out, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_code step;
    tw_module_result *module = NULL;
    tw_error cb_err;
    size_t count = 0;
    size_t g;

    module = tw_host_alloc(host, sizeof *module);
    if (module == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory starting a module's search");
        goto cleanup;
    }
    memset(module, 0, sizeof *module);
    module->host = *host;
    module->state = -1;
    module->path = tw_host_strdup(host, path != NULL ? path : "");
    if (module->path == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory starting a module's search");
        goto cleanup;
    }
    tw_error_clear(&cb_err);
    step = ops->groups(ops->ctx, node, &count, &cb_err);
    if (step != TW_OK) {
        tw_error_forward(&cb_err, step, &cb_err, "groups");
        if (step == TW_EINTERRUPT) {
            rc = tw_error_set(err, step, "%s", cb_err.msg);
            goto cleanup;
        }
        rc = tw_keep_text(host, &module->error, cb_err.msg, err);
        goto cleanup;
    }
    if (count == 0) {
        snprintf(cb_err.msg, sizeof cb_err.msg,
                 "the dataset never called %s; there is nothing to tune it on",
                 module->path[0] != '\0' ? module->path : "(root)");
        rc = tw_keep_text(host, &module->error, cb_err.msg, err);
        goto cleanup;
    }
    module->groups = tw_host_alloc_array(host, count, sizeof *module->groups);
    if (module->groups == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory keeping %zu signature groups", count);
        goto cleanup;
    }
    memset(module->groups, 0, count * sizeof *module->groups);
    module->group_count = count;
    for (g = 0; g < count; g++) {
        module->groups[g].chosen = -1;
    }
    for (g = 0; g < count; g++) {
        rc = tw_search_group(host, ops, node, g, &module->groups[g], cfg, budget, err);
        if (rc != TW_OK) {
            goto cleanup;
        }
        if (module->groups[g].chosen >= 0) {
            module->state = 1;
        }
    }
    rc = tw_explain_module(module, err);
cleanup:
    if (rc == TW_OK) {
        *out = module;
        module = NULL;
    }
    tw_module_result_destroy(module);
    return rc;
}

tw_code tw_tune_module(const tw_host *host, const tw_module_ops *ops, size_t node,
                       const char *path, const tw_measure_config *cfg,
                       tw_module_result **out, tw_error *err)
{
    return tw_tune_module_within(host, ops, node, path, cfg, NULL, out, err);
}

tw_code tw_tune_module_within(const tw_host *host, const tw_module_ops *ops, size_t node,
                              const char *path, const tw_measure_config *cfg,
                              const tw_budget *budget, tw_module_result **out, tw_error *err)
{
    tw_code rc;
    tw_host resolved;
    tw_measure_config defaults;

    tw_host_resolve(host, &resolved);
    if (out != NULL) {
        *out = NULL;
    }
    if (cfg == NULL) {
        tw_measure_config_default(&defaults);
        cfg = &defaults;
    }
    rc = tw_check_module_ops(ops, out, err);
    if (rc == TW_OK) {
        rc = tw_measure_config_check(cfg, err);
    }
    if (rc == TW_OK) {
        rc = tw_search_module(&resolved, ops, node, path, cfg, budget, out, err);
    }
    return rc;
}
