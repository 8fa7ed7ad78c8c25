/*
 * test_restore.c - a result built again from its numbers (tw_result_restore):
 * the same table and outcome as the result they were read from, and a clear
 * refusal of numbers no tweak gives, leaking nothing.
 */
#include <math.h>

#include "check.h"
#include "fake.h"
#include "fake_model.h"
#include "tweak.h"

/* A record of `result`, read through the public accessors as a caller keeps
 * it; rows[] must hold its rows. */
static tw_result_record record_of(const tw_result *result, tw_row *rows)
{
    tw_result_record record;
    size_t i;

    memset(&record, 0, sizeof record);
    record.row_count = tw_result_row_count(result);
    for (i = 0; i < record.row_count; i++) {
        CHECK_INT(tw_result_row(result, i, &rows[i], NULL), TW_OK);
    }
    record.rows = rows;
    record.selected = tw_result_selected(result);
    tw_result_baseline(result, &record.baseline, &record.baseline_measured);
    tw_result_confirmation(result, &record.confirmation);
    record.others_share = tw_result_others_share(result);
    record.busy_stopped = tw_result_busy_stopped(result);
    tw_result_budgets(result, &record.time_budget_ns, &record.busy_budget_ns);
    return record;
}

/* The result restored from its record reads as it: table, outcome, figures. */
static void check_same_restored(fake_model *m, const tw_result *result)
{
    tw_row rows[MAX_DEPTH];
    tw_result_record record = record_of(result, rows);
    tw_result *again = NULL;
    tw_confirmation a, b;
    char *text[2], *outcome[2];

    CHECK_INT(tw_result_restore(&m->host, &record, &again, NULL), TW_OK);
    text[0] = tw_result_format(result, NULL);
    text[1] = tw_result_format(again, NULL);
    outcome[0] = tw_result_outcome_as(result, "its modules stay untuned", NULL);
    outcome[1] = tw_result_outcome_as(again, "its modules stay untuned", NULL);
    CHECK_STR(text[1], text[0]);
    CHECK_STR(outcome[1], outcome[0]);
    tw_result_confirmation(result, &a);
    tw_result_confirmation(again, &b);
    CHECK(memcmp(&a, &b, sizeof a) == 0);
    CHECK_INT(tw_result_quality(again), tw_result_quality(result));
    CHECK_INT(tw_result_noisy(again), tw_result_noisy(result));
    CHECK_INT(tw_result_busy(again), tw_result_busy(result));
    CHECK_NEAR(tw_result_others_share(again), tw_result_others_share(result), 1e-12);
    CHECK(tw_result_module_search(again, 0) == NULL);
    tw_free(text[0]);
    tw_free(text[1]);
    tw_free(outcome[0]);
    tw_free(outcome[1]);
    tw_result_destroy(again);
}

/* One tweak of the fake model, its result restored; `busy`: a lasting load. */
static void restore_one(uint64_t wrapped, int deactivate, double share, uint64_t busy_budget,
                        tw_code depth_fail)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_tweak_ops ops;
    tw_result *result = NULL;

    fake_model_setup(&m);
    m.wrapped_latency = wrapped;
    m.depth_fail[1] = depth_fail;
    if (share > 0.0) {
        m.load_known = 1;
        m.search_share = m.side_share = share;
        m.tune_cost[ROOT] = busy_budget > 0 ? 1000000 : 0;
    }
    cfg.busy_budget_ns = busy_budget;
    ops = fake_model_ops(&m);
    ops.deactivate = deactivate ? model_deactivate : NULL;
    CHECK_INT(tw_tweak_run(&m.host, m.tree, &cfg, &ops, &result, NULL), TW_OK);
    check_same_restored(&m, result);
    fake_model_teardown(&m, result);
}

/* Busy rounds that leaned faster but ran out of the busy budget: the budget
 * that buys them is kept, and the verdict names it again. */
static void restore_budget_wanted(void)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_tweak_ops ops;
    tw_result *result = NULL;
    tw_confirmation c;

    fake_model_setup(&m);
    cfg.busy_budget_ns = 60000;
    m.loaded = 1;
    m.lcg = 3;
    m.load_known = 1;
    m.search_share = m.side_share = 0.7;
    m.wrapped_latency = 1000;
    m.depth_latency[0] = m.depth_latency[1] = m.depth_latency[2] = 650;
    ops = fake_model_ops(&m);
    ops.deactivate = model_deactivate;
    CHECK_INT(tw_tweak_run(&m.host, m.tree, &cfg, &ops, &result, NULL), TW_OK);
    tw_result_confirmation(result, &c);
    CHECK(!c.confirmed && c.busy_budget_wanted_ns > 0 && c.rounds_ran_out);
    check_same_restored(&m, result);
    fake_model_teardown(&m, result);
}

static void test_every_kind_of_result_reads_the_same_restored(void)
{
    restore_budget_wanted();
    restore_one(0, 0, 0.0, 0, TW_OK);            /* selected, no confirmation */
    restore_one(0, 0, 0.0, 0, TW_ECALLBACK);     /* a skipped row and its error */
    restore_one(1000, 1, 0.0, 0, TW_OK);         /* confirmed side by side */
    restore_one(3000, 1, 0.0, 0, TW_OK);         /* slower side by side: left */
    restore_one(1000, 1, 0.6, 0, TW_OK);         /* busy: paired rounds, kept */
    restore_one(700, 1, 0.6, 0, TW_OK);          /* busy: within noise, left */
    restore_one(1000, 1, 0.7, 500000, TW_OK);    /* busy budget used up */
}

/* A record from a confirmed tweak, for the forgeries below. */
typedef struct kept {
    fake_model m;
    tw_result *result;
    tw_row rows[MAX_DEPTH];
    tw_result_record record;
} kept;

static void kept_setup(kept *k)
{
    tw_tweak_config cfg = fake_model_config();
    tw_tweak_ops ops;

    fake_model_setup(&k->m);
    k->m.wrapped_latency = 1000;
    ops = fake_model_ops(&k->m);
    ops.deactivate = model_deactivate;
    k->result = NULL;
    CHECK_INT(tw_tweak_run(&k->m.host, k->m.tree, &cfg, &ops, &k->result, NULL), TW_OK);
    k->record = record_of(k->result, k->rows);
    CHECK_INT(k->record.selected, 2);
    CHECK(k->record.confirmation.confirmed);
}

/* The forged record is refused with a message holding `words`, and nothing leaks. */
static void check_refused(kept *k, const char *words)
{
    tw_result *out = (tw_result *)&k->record; /* any non-NULL: it must be cleared */
    tw_error err;

    memset(&err, 0, sizeof err);
    CHECK_INT(tw_result_restore(&k->m.host, &k->record, &out, &err), TW_EINVAL);
    CHECK(out == NULL);
    CHECK_HAS(err.msg, words);
    fake_model_teardown(&k->m, k->result);
}

static void test_forged_numbers_are_refused(void)
{
    kept k;

    kept_setup(&k);
    k.rows[1].stats.median_ns = -5.0;
    check_refused(&k, "row 1 (depth 1): a latency of -5 ns is no measurement's");
    kept_setup(&k);
    k.rows[0].stats.q75_ns = NAN;
    check_refused(&k, "no measurement's");
    kept_setup(&k);
    k.rows[0].stats.q25_ns = k.rows[0].stats.median_ns * 2.0;
    check_refused(&k, "out of order");
    kept_setup(&k);
    k.rows[0].stats.spread = NAN;
    check_refused(&k, "a spread of nan");
    kept_setup(&k);
    k.rows[2].state = (tw_row_state)7;
    check_refused(&k, "its state, depth or module counts are no tweak's");
    kept_setup(&k);
    k.rows[2].failed = k.rows[2].modules + 1;
    check_refused(&k, "module counts");
    kept_setup(&k);
    k.record.row_count = TW_RESULT_MAX_ROWS + 1;
    check_refused(&k, "1025 rows");
    kept_setup(&k);
    k.record.selected = 5;
    check_refused(&k, "the selected row (5)");
    kept_setup(&k);
    k.record.others_share = 1.5;
    check_refused(&k, "a share of the CPUs of 1.5");
    kept_setup(&k);
    k.record.confirmation.tries = 0;
    check_refused(&k, "tries (0)");
    kept_setup(&k);
    k.record.confirmation.depth = 7;
    check_refused(&k, "the confirmation is of depth 7");
    kept_setup(&k);
    k.record.confirmation.quality = TW_QUALITY_REMEASURED; /* one try, agreeing: consistent */
    check_refused(&k, "the confirmation says its figures were remeasured; they are consistent");
    kept_setup(&k);
    k.record.selected = -1; /* a kept depth left out */
    check_refused(&k, "the selected row (-1) is not the depth its confirmation keeps");
    kept_setup(&k);
    k.record.selected = 1; /* another depth than the one confirmed */
    check_refused(&k, "the selected row (1) is not the depth its confirmation keeps (depth 2");
    kept_setup(&k);
    k.record.confirmation.untuned = k.record.confirmation.tuned; /* no faster side by side */
    check_refused(&k, "the confirmation says its figures were consistent; they are inconsistent");
    kept_setup(&k);
    k.record.confirmation.quality = TW_QUALITY_BUSY;
    k.record.confirmation.speedup = 42.0;
    k.record.confirmation.speedup_low = 50.0;
    k.record.confirmation.speedup_high = 60.0;
    check_refused(&k, "the busy figure 42x");
    kept_setup(&k);
    k.record.confirmation.quality = TW_QUALITY_BUSY;
    k.record.confirmation.busy_budget_wanted_ns = 10000000000ull; /* for a depth it keeps */
    check_refused(&k, "keeps depth 2 and says its rounds ran out undecided");
    kept_setup(&k);
    k.record.confirmation.quality = TW_QUALITY_BUSY;
    k.record.confirmation.paired_rounds = 3;
    k.record.confirmation.paired_wins = 4;
    check_refused(&k, "4 of 3 paired rounds");
}

/* The claim a record makes is the one its numbers give: a figure written in it
 * counts for nothing (a side-by-side figure is derived again), and a record
 * whose numbers say nothing was kept says so. */
static void test_figures_come_from_the_numbers(void)
{
    kept k;
    tw_result *again = NULL;
    tw_confirmation c;
    char *text;

    kept_setup(&k);
    k.record.confirmation.speedup = 42.0;
    k.record.confirmation.speedup_low = 42.0;
    k.record.confirmation.speedup_high = 42.0;
    k.record.confirmation.search_speedup = 42.0;
    CHECK_INT(tw_result_restore(&k.m.host, &k.record, &again, NULL), TW_OK);
    tw_result_confirmation(again, &c);
    CHECK_NEAR(c.speedup, 1000.0 / 700.0, 1e-9);
    text = tw_result_outcome_as(again, NULL, NULL);
    CHECK_HAS(text, "kept depth 2: 1.43x faster than untuned");
    CHECK(strstr(text, "42") == NULL);
    tw_free(text);
    tw_result_destroy(again);
    again = NULL;

    k.record.selected = -1; /* nothing kept: no confirmation either */
    memset(&k.record.confirmation, 0, sizeof k.record.confirmation);
    k.record.confirmation.speedup = 42.0; /* not measured: ignored */
    CHECK_INT(tw_result_restore(&k.m.host, &k.record, &again, NULL), TW_OK);
    text = tw_result_outcome_as(again, NULL, NULL);
    CHECK_STR(text, "no depth beat the untuned model: it stays untuned\n");
    tw_free(text);
    tw_result_destroy(again);
    fake_model_teardown(&k.m, k.result);
}

static void test_null_arguments(void)
{
    kept k;
    tw_result *out = NULL;
    tw_error err;

    kept_setup(&k);
    CHECK_INT(tw_result_restore(NULL, &k.record, &out, &err), TW_OK); /* the default host */
    tw_result_destroy(out);
    out = NULL;
    CHECK_INT(tw_result_restore(&k.m.host, NULL, &out, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "record is NULL");
    CHECK_INT(tw_result_restore(&k.m.host, &k.record, NULL, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "out is NULL");
    k.record.rows = NULL;
    CHECK_INT(tw_result_restore(&k.m.host, &k.record, &out, &err), TW_EINVAL);
    CHECK(out == NULL);
    fake_model_teardown(&k.m, k.result);
}

/* Out of memory at each allocation in turn: TW_ENOMEM, nothing leaks, and
 * with enough memory the result is built. */
static void test_out_of_memory(void)
{
    kept k;
    tw_result *out = NULL;
    tw_error err;
    tw_code rc = TW_ENOMEM;
    long limit;

    kept_setup(&k);
    for (limit = 0; limit < 64 && rc == TW_ENOMEM; limit++) {
        long live = k.m.env.live;

        k.m.env.allocs_left = limit;
        rc = tw_result_restore(&k.m.host, &k.record, &out, &err);
        k.m.env.allocs_left = -1;
        if (rc == TW_ENOMEM) {
            CHECK(out == NULL);
            CHECK_INT(err.code, TW_ENOMEM);
            CHECK_INT(k.m.env.live, live);
        }
    }
    CHECK_INT(rc, TW_OK);
    CHECK(limit > 1);
    tw_result_destroy(out);
    fake_model_teardown(&k.m, k.result);
}

int main(void)
{
    test_every_kind_of_result_reads_the_same_restored();
    test_forged_numbers_are_refused();
    test_figures_come_from_the_numbers();
    test_null_arguments();
    test_out_of_memory();
    return CHECK_SUMMARY("test_restore");
}
