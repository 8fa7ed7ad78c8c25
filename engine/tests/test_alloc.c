/*
 * test_alloc.c - running out of memory: an allocator that fails after N
 * allocations, for N = 0, 1, 2... until the work succeeds. Every failure
 * must be TW_ENOMEM, leave the model as it was and leak nothing.
 */
#include "check.h"
#include "fake.h"
#include "fake_model.h"
#include "tweak.h"

static tw_code build_tree(fake_model *m, tw_error *err)
{
    tw_code rc = TW_OK;
    size_t i;

    m->tree = tw_tree_create(&m->host, err);
    if (m->tree == NULL) {
        return TW_ENOMEM;
    }
    for (i = 0; i < N_NODES && rc == TW_OK; i++) {
        rc = tw_tree_add(m->tree, model_paths[i], 1, 1000, NULL, err);
    }
    if (rc == TW_OK) {
        rc = tw_tree_finish(m->tree, err);
    }
    return rc;
}

/* One pass with `limit` allocations allowed; returns its code. */
static tw_code run_with_limit(long limit)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_tweak_ops ops;
    tw_result *result = NULL;
    tw_error err;
    tw_code rc;
    char *text = NULL;

    fake_model_setup(&m);
    tw_tree_destroy(m.tree); /* built again below, under the limit */
    m.tree = NULL;
    m.tune_rc[L1] = TW_ECALLBACK; /* a failure message to keep */
    m.env.allocs_left = limit;
    rc = build_tree(&m, &err);
    if (rc == TW_OK) {
        ops = fake_model_ops(&m);
        rc = tw_tweak_run(&m.host, m.tree, &cfg, &ops, &result, &err);
    }
    if (rc == TW_OK) {
        text = tw_result_format(result, &err);
        rc = text != NULL ? TW_OK : TW_ENOMEM;
        CHECK(text != NULL || err.code == TW_ENOMEM);
        tw_free(text);
    }
    if (rc == TW_OK) {
        text = tw_tree_format(m.tree, &err);
        rc = text != NULL ? TW_OK : TW_ENOMEM;
        tw_free(text);
    }
    if (rc != TW_OK) {
        CHECK_INT(rc, TW_ENOMEM);
        CHECK_INT(err.code, TW_ENOMEM);
        /* the model is as it was: every enter was followed by a leave,
         * except the selected cut's when the tweak itself succeeded */
        CHECK_INT(m.enters - m.leaves, result != NULL ? 1 : 0);
    } else {
        CHECK_INT(tw_result_selected(result), 2);
        CHECK_INT(tw_result_module(result, L1, NULL), -1);
    }
    tw_result_destroy(result);
    tw_tree_destroy(m.tree);
    CHECK_INT(m.env.live, 0);
    return rc;
}

static void test_tweak_out_of_memory(void)
{
    long limit;
    tw_code rc = TW_ENOMEM;

    for (limit = 0; limit < 1000 && rc != TW_OK; limit++) {
        rc = run_with_limit(limit);
    }
    CHECK_INT(rc, TW_OK);
    CHECK(limit > 10); /* the loop really went through failures */
    printf("tweak: %ld allocation limits failed cleanly before one sufficed\n", limit - 1);
}

/* The strategies and measurement, with three candidates. */
static tw_code build_ok(void *ctx, tw_error *err)
{
    (void)ctx;
    (void)err;
    return TW_OK;
}

static void test_strategy_out_of_memory(void)
{
    static const uint64_t latency[3] = {300, 100, 200};
    fake_env env;
    tw_host host;
    fake_runner runners[3];
    tw_candidate cands[3];
    tw_candidate_report reports[3];
    tw_measure_config cfg = fake_quick_config();
    tw_error err;
    tw_code rc = TW_ENOMEM;
    long chosen = -1;
    long limit;
    size_t i;

    for (limit = 0; limit < 100 && rc != TW_OK; limit++) {
        fake_env_init(&env);
        env.allocs_left = limit;
        host = fake_host(&env);
        for (i = 0; i < 3; i++) {
            fake_runner_init(&runners[i], &env, (int)i, &latency[i], 1, 2);
            cands[i].name = "backend";
            cands[i].ctx = NULL;
            cands[i].build = build_ok;
            cands[i].runner = fake_runner_of(&runners[i]);
        }
        rc = tw_strategy_choose(&host, TW_STRATEGY_HIGHEST_THROUGHPUT, cands, 3, &cfg,
                                &chosen, reports, &err);
        if (rc != TW_OK) {
            CHECK_INT(rc, TW_ENOMEM);
            CHECK_INT(chosen, -1);
        }
        CHECK_INT(env.live, 0);
    }
    CHECK_INT(rc, TW_OK);
    CHECK_INT(chosen, 1);
    CHECK(limit > 2);
}

int main(void)
{
    test_tweak_out_of_memory();
    test_strategy_out_of_memory();
    return CHECK_SUMMARY("test_alloc");
}
