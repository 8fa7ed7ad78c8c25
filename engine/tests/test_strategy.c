/*
 * test_strategy.c - the strategies' rules on fake backends.
 */
#include "check.h"
#include "fake.h"
#include "tweak.h"

#define MAX_BACKENDS 4

/* A backend that builds or not, with a fake runner of a fixed latency. */
typedef struct fake_backend {
    const char *name;
    tw_code build_rc;
    int builds;
    uint64_t latency;
    fake_runner runner;
} fake_backend;

static tw_code fake_build(void *ctx, tw_error *err)
{
    fake_backend *b = ctx;

    b->builds++;
    if (b->build_rc != TW_OK) {
        return tw_error_set(err, b->build_rc, "%s does not fit this module", b->name);
    }
    return TW_OK;
}

typedef struct fixture {
    fake_env env;
    tw_host host;
    fake_backend backends[MAX_BACKENDS];
    tw_candidate cands[MAX_BACKENDS];
    tw_candidate_report reports[MAX_BACKENDS];
    tw_measure_config cfg;
    long chosen;
    tw_error err;
} fixture;

static const char *const names[MAX_BACKENDS] = {"graph", "inductor", "openvino", "eager"};

/* n backends: build_rc[i] says whether each builds, latency[i] how fast. */
static void setup(fixture *f, size_t n, const tw_code *build_rc, const uint64_t *latency)
{
    size_t i;

    fake_env_init(&f->env);
    f->host = fake_host(&f->env);
    f->cfg = fake_quick_config();
    f->chosen = 99;
    for (i = 0; i < n; i++) {
        fake_backend *b = &f->backends[i];

        b->name = names[i];
        b->build_rc = build_rc[i];
        b->builds = 0;
        b->latency = latency[i];
        fake_runner_init(&b->runner, &f->env, (int)i, &b->latency, 1, 2);
        f->cands[i].name = names[i];
        f->cands[i].ctx = b;
        f->cands[i].build = fake_build;
        f->cands[i].runner = fake_runner_of(&b->runner);
    }
}

static tw_code choose(fixture *f, tw_strategy_kind kind, size_t n)
{
    return tw_strategy_choose(&f->host, kind, f->cands, n, &f->cfg, &f->chosen, f->reports,
                              &f->err);
}

static void test_first_wins(void)
{
    static const tw_code rc[] = {TW_ECALLBACK, TW_OK, TW_OK};
    static const uint64_t lat[] = {100, 300, 100};
    fixture f;

    setup(&f, 3, rc, lat);
    CHECK_INT(choose(&f, TW_STRATEGY_FIRST_WINS, 3), TW_OK);
    CHECK_INT(f.chosen, 1);
    CHECK_INT(f.reports[0].state, TW_CAND_FAILED);
    CHECK_STR(f.reports[0].msg, "graph does not fit this module");
    CHECK_INT(f.reports[1].state, TW_CAND_BUILT);
    CHECK_INT(f.reports[2].state, TW_CAND_NOT_TRIED);
    CHECK_INT(f.backends[2].builds, 0);
    /* first-wins measures nothing */
    CHECK_INT(f.env.log_len, 0);
}

static void test_highest_throughput(void)
{
    static const tw_code rc[] = {TW_OK, TW_ECALLBACK, TW_OK, TW_OK};
    static const uint64_t lat[] = {300, 50, 100, 200};
    fixture f;

    setup(&f, 4, rc, lat);
    CHECK_INT(choose(&f, TW_STRATEGY_HIGHEST_THROUGHPUT, 4), TW_OK);
    CHECK_INT(f.chosen, 2);
    CHECK_INT(f.reports[0].state, TW_CAND_MEASURED);
    CHECK_INT(f.reports[1].state, TW_CAND_FAILED);
    CHECK_STR(f.reports[1].msg, "inductor does not fit this module");
    CHECK_INT(f.reports[2].state, TW_CAND_MEASURED);
    CHECK_INT(f.reports[3].state, TW_CAND_MEASURED);
    CHECK_NEAR(f.reports[0].stats.median_ns, 300, 1e-9);
    CHECK_NEAR(f.reports[2].stats.median_ns, 100, 1e-9);
    CHECK_NEAR(f.reports[3].stats.median_ns, 200, 1e-9);
    CHECK_INT(f.backends[1].runner.calls, 0);
    CHECK_INT(f.env.live, 0);
}

/* Equal medians keep the earlier candidate. */
static void test_tie_keeps_earlier(void)
{
    static const tw_code rc[] = {TW_OK, TW_OK, TW_OK};
    static const uint64_t lat[] = {200, 100, 100};
    fixture f;

    setup(&f, 3, rc, lat);
    CHECK_INT(choose(&f, TW_STRATEGY_HIGHEST_THROUGHPUT, 3), TW_OK);
    CHECK_INT(f.chosen, 1);
}

/* A candidate whose measurement fails is dropped; the rest still compete. */
static void test_measure_failure(void)
{
    static const tw_code rc[] = {TW_OK, TW_OK, TW_OK};
    static const uint64_t lat[] = {100, 200, 300};
    fixture f;

    setup(&f, 3, rc, lat);
    f.backends[0].runner.fail_at = 1;
    CHECK_INT(choose(&f, TW_STRATEGY_HIGHEST_THROUGHPUT, 3), TW_OK);
    CHECK_INT(f.chosen, 1);
    CHECK_INT(f.reports[0].state, TW_CAND_FAILED);
    CHECK_STR(f.reports[0].msg, "runner 0 broke at call 1");
    CHECK_INT(f.reports[1].state, TW_CAND_MEASURED);
    CHECK_INT(f.reports[2].state, TW_CAND_MEASURED);
    CHECK_INT(f.env.live, 0);

    /* an empty dataset for one candidate fails that one only */
    setup(&f, 3, rc, lat);
    f.cands[2].runner.n_samples = 0;
    CHECK_INT(choose(&f, TW_STRATEGY_HIGHEST_THROUGHPUT, 3), TW_OK);
    CHECK_INT(f.chosen, 0);
    CHECK_INT(f.reports[2].state, TW_CAND_FAILED);
    CHECK_HAS(f.reports[2].msg, "no samples");
}

static void test_one_backend(void)
{
    static const tw_code ok[] = {TW_OK, TW_OK};
    static const tw_code bad[] = {TW_ECALLBACK};
    static const uint64_t lat[] = {100, 100};
    fixture f;

    setup(&f, 2, ok, lat);
    CHECK_INT(choose(&f, TW_STRATEGY_ONE_BACKEND, 2), TW_EINVAL);
    CHECK_HAS(f.err.msg, "exactly one");
    CHECK_INT(f.backends[0].builds, 0);
    CHECK_INT(choose(&f, TW_STRATEGY_ONE_BACKEND, 1), TW_OK);
    CHECK_INT(f.chosen, 0);
    CHECK_INT(f.reports[0].state, TW_CAND_BUILT);

    setup(&f, 1, bad, lat);
    CHECK_INT(choose(&f, TW_STRATEGY_ONE_BACKEND, 1), TW_OK);
    CHECK_INT(f.chosen, -1);
    CHECK_INT(f.reports[0].state, TW_CAND_FAILED);
}

static void test_none_builds(void)
{
    static const tw_code rc[] = {TW_ECALLBACK, TW_ECALLBACK};
    static const uint64_t lat[] = {100, 100};
    fixture f;

    setup(&f, 2, rc, lat);
    CHECK_INT(choose(&f, TW_STRATEGY_FIRST_WINS, 2), TW_OK);
    CHECK_INT(f.chosen, -1);
    CHECK_INT(f.reports[1].state, TW_CAND_FAILED);
    f.chosen = 5;
    CHECK_INT(choose(&f, TW_STRATEGY_HIGHEST_THROUGHPUT, 2), TW_OK);
    CHECK_INT(f.chosen, -1);
    CHECK_INT(f.env.log_len, 0);
    CHECK_INT(choose(&f, TW_STRATEGY_FIRST_WINS, 0), TW_EINVAL);
    CHECK_INT(choose(&f, (tw_strategy_kind)7, 2), TW_EINVAL);
}

static void test_interrupt(void)
{
    static const tw_code rc[] = {TW_ECALLBACK, TW_EINTERRUPT, TW_OK};
    static const tw_code ok[] = {TW_OK, TW_OK};
    static const uint64_t lat[] = {100, 100, 100};
    fixture f;

    setup(&f, 3, rc, lat);
    CHECK_INT(choose(&f, TW_STRATEGY_FIRST_WINS, 3), TW_EINTERRUPT);
    CHECK_INT(f.err.code, TW_EINTERRUPT);
    CHECK_INT(f.chosen, -1);
    CHECK_INT(f.backends[2].builds, 0);

    setup(&f, 3, rc, lat);
    CHECK_INT(choose(&f, TW_STRATEGY_HIGHEST_THROUGHPUT, 3), TW_EINTERRUPT);
    CHECK_INT(f.backends[2].builds, 0);

    /* an interrupt while measuring stops the whole choice */
    setup(&f, 2, ok, lat);
    f.backends[1].runner.fail_at = 0;
    f.backends[1].runner.fail_code = TW_EINTERRUPT;
    CHECK_INT(choose(&f, TW_STRATEGY_HIGHEST_THROUGHPUT, 2), TW_EINTERRUPT);
    CHECK_INT(f.chosen, -1);
    CHECK_INT(f.env.live, 0);
}

static void test_names(void)
{
    CHECK_STR(tw_strategy_name(TW_STRATEGY_FIRST_WINS), "first-wins");
    CHECK_STR(tw_strategy_name(TW_STRATEGY_HIGHEST_THROUGHPUT), "highest-throughput");
    CHECK_STR(tw_strategy_name(TW_STRATEGY_ONE_BACKEND), "one-backend");
    CHECK(tw_strategy_name((tw_strategy_kind)3) == NULL);
    CHECK_STR(tw_code_name(TW_EINTERRUPT), "interrupted");
}

int main(void)
{
    test_first_wins();
    test_highest_throughput();
    test_tie_keeps_earlier();
    test_measure_failure();
    test_one_backend();
    test_none_builds();
    test_interrupt();
    test_names();
    return CHECK_SUMMARY("test_strategy");
}
