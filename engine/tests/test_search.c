/*
 * test_search.c - one module's search (tw_tune_module): signature groups,
 * candidates that fail, the strategies' picks, the result model, failing and
 * interrupting callbacks, and running out of memory, on a scripted fake host.
 */
#include <math.h>

#include "check.h"
#include "fake.h"
#include "tweak.h"

#define MAX_GROUPS 4
#define MAX_CANDS 4

/* A module as the host describes it, and what the engine asked of it. */
typedef struct search_fake {
    fake_env env;
    tw_host host;
    /* behaviour */
    size_t n_groups;
    tw_code groups_rc;
    tw_code group_rc[MAX_GROUPS];
    tw_strategy_kind kind[MAX_GROUPS];
    size_t n_cands[MAX_GROUPS];
    const char *names[MAX_GROUPS][MAX_CANDS];
    const char *text[MAX_GROUPS];
    tw_code build_rc[MAX_GROUPS][MAX_CANDS];
    tw_build_facts facts[MAX_GROUPS][MAX_CANDS]; /* given when reason or max_error is set */
    uint64_t build_cost;                          /* fake ns a build takes */
    const unsigned *flags[MAX_GROUPS];
    uint64_t latency[MAX_GROUPS][MAX_CANDS];
    tw_code run_rc[MAX_GROUPS][MAX_CANDS];
    tw_code commit_rc[MAX_GROUPS];
    /* what happened */
    int groups_calls;
    int opened[MAX_GROUPS];
    int builds[MAX_GROUPS][MAX_CANDS];
    long runs[MAX_GROUPS][MAX_CANDS];
    int commits[MAX_GROUPS];
    long committed[MAX_GROUPS];
    int syncs;
    size_t node_seen;
} search_fake;

static tw_code sf_groups(void *ctx, size_t node, size_t *count, tw_error *err)
{
    search_fake *f = ctx;

    f->groups_calls++;
    f->node_seen = node;
    if (f->groups_rc != TW_OK) {
        return tw_error_set(err, f->groups_rc, "cannot record node %zu", node);
    }
    *count = f->n_groups;
    return TW_OK;
}

static tw_code sf_group(void *ctx, size_t node, size_t g, tw_group_info *info, tw_error *err)
{
    search_fake *f = ctx;

    CHECK_INT(node, f->node_seen);
    CHECK_INT(info->n_candidates, 0); /* zeroed by the engine */
    f->opened[g]++;
    if (f->group_rc[g] != TW_OK) {
        return tw_error_set(err, f->group_rc[g], "cannot describe group %zu", g);
    }
    info->text = f->text[g];
    info->kind = f->kind[g];
    info->n_candidates = f->n_cands[g];
    info->names = f->names[g];
    info->n_samples = 2;
    info->flags = f->flags[g];
    return TW_OK;
}

static tw_code sf_build(void *ctx, size_t node, size_t g, size_t c, tw_build_facts *facts,
                        tw_error *err)
{
    search_fake *f = ctx;

    CHECK_INT(node, f->node_seen);
    CHECK_INT(f->opened[g], 1);
    CHECK_INT(f->commits[g], 0); /* built inside its group */
    CHECK_INT(facts->reason, TW_REASON_NONE);
    CHECK(facts->max_error != facts->max_error && facts->tolerance != facts->tolerance &&
          facts->own_error != facts->own_error);
    f->builds[g][c]++;
    f->env.now += f->build_cost;
    if (f->facts[g][c].reason != TW_REASON_NONE || f->facts[g][c].max_error != 0) {
        *facts = f->facts[g][c];
    }
    if (f->build_rc[g][c] != TW_OK) {
        return tw_error_set(err, f->build_rc[g][c], "%s does not build",
                            f->names[g][c] != NULL ? f->names[g][c] : "it");
    }
    return TW_OK;
}

static tw_code sf_run(void *ctx, size_t node, size_t g, size_t c, size_t sample, tw_error *err)
{
    search_fake *f = ctx;

    (void)node;
    CHECK(sample < 2);
    CHECK_INT(f->builds[g][c], 1); /* only built candidates run */
    f->runs[g][c]++;
    if (f->run_rc[g][c] != TW_OK) {
        return tw_error_set(err, f->run_rc[g][c], "%s broke while measured", f->names[g][c]);
    }
    f->env.now += f->latency[g][c];
    return TW_OK;
}

static tw_code sf_sync(void *ctx, tw_error *err)
{
    search_fake *f = ctx;

    (void)err;
    f->syncs++;
    return TW_OK;
}

static tw_code sf_commit(void *ctx, size_t node, size_t g, long chosen, tw_error *err)
{
    search_fake *f = ctx;

    CHECK_INT(node, f->node_seen);
    CHECK_INT(f->opened[g], 1); /* one commit per group() */
    f->commits[g]++;
    f->committed[g] = chosen;
    if (f->commit_rc[g] != TW_OK) {
        return tw_error_set(err, f->commit_rc[g], "cannot install group %zu", g);
    }
    return TW_OK;
}

static void sf_setup(search_fake *f)
{
    size_t g;
    size_t c;

    memset(f, 0, sizeof *f);
    fake_env_init(&f->env);
    f->host = fake_host(&f->env);
    for (g = 0; g < MAX_GROUPS; g++) {
        f->text[g] = g == 0 ? "(float32[8, 16])" : "(float32[1, 16])";
        f->committed[g] = -2;
        for (c = 0; c < MAX_CANDS; c++) {
            f->names[g][c] = c == 0 ? "Inductor" : c == 1 ? "OpenVINO" : c == 2 ? "Eager"
                                                                                : "Extra";
            f->latency[g][c] = 100 * (c + 1);
        }
    }
}

static tw_module_ops sf_ops(search_fake *f)
{
    tw_module_ops ops = {f, sf_groups, sf_group, sf_build, sf_run, NULL, sf_commit};
    return ops;
}

static tw_code sf_tune(search_fake *f, const char *path, tw_module_result **out, tw_error *err)
{
    tw_module_ops ops = sf_ops(f);
    tw_measure_config cfg = fake_quick_config();

    return tw_tune_module(&f->host, &ops, 7, path, &cfg, out, err);
}

static tw_candidate_report sf_report(const tw_module_result *m, size_t g, size_t c,
                                     const char **name)
{
    tw_candidate_report r;

    memset(&r, 0, sizeof r);
    CHECK_INT(tw_module_result_candidate(m, g, c, name, &r, NULL), TW_OK);
    return r;
}

static tw_group_report sf_group_report(const tw_module_result *m, size_t g)
{
    tw_group_report r;

    memset(&r, 0, sizeof r);
    CHECK_INT(tw_module_result_group(m, g, &r, NULL), TW_OK);
    return r;
}

/* Two groups, two strategies: the fastest of the measured ones, and the first
 * that builds; the result keeps every candidate's state, figures and error. */
static void test_groups_and_picks(void)
{
    search_fake f;
    tw_module_result *m = NULL;
    tw_candidate_report r;
    tw_group_report g;
    const char *name = NULL;

    sf_setup(&f);
    f.n_groups = 2;
    f.kind[0] = TW_STRATEGY_HIGHEST_THROUGHPUT;
    f.n_cands[0] = 3;
    f.latency[0][0] = 300;
    f.latency[0][1] = 100;
    f.build_rc[0][2] = TW_ECALLBACK;
    f.kind[1] = TW_STRATEGY_FIRST_WINS;
    f.n_cands[1] = 3;
    f.build_rc[1][0] = TW_ECALLBACK;
    CHECK_INT(sf_tune(&f, "layers.0", &m, NULL), TW_OK);
    CHECK(m != NULL);
    CHECK_INT(f.node_seen, 7);
    CHECK_INT(tw_module_result_state(m), 1);
    CHECK_STR(tw_module_result_error(m), "");
    CHECK_STR(tw_module_result_path(m), "layers.0");
    CHECK_INT(tw_module_result_group_count(m), 2);

    g = sf_group_report(m, 0);
    CHECK_STR(g.text, "(float32[8, 16])");
    CHECK_INT(g.kind, TW_STRATEGY_HIGHEST_THROUGHPUT);
    CHECK_INT(g.n_candidates, 3);
    CHECK_INT(g.n_samples, 2);
    CHECK_INT(g.chosen, 1);
    CHECK_STR(g.error, "");
    r = sf_report(m, 0, 0, &name);
    CHECK_STR(name, "Inductor");
    CHECK_INT(r.state, TW_CAND_MEASURED);
    CHECK_NEAR(r.stats.median_ns, 300, 1e-9);
    CHECK_STR(tw_candidate_verdict(&r, 0), "slower");
    r = sf_report(m, 0, 1, NULL);
    CHECK_INT(r.state, TW_CAND_MEASURED);
    CHECK_NEAR(r.stats.median_ns, 100, 1e-9);
    CHECK_STR(tw_candidate_verdict(&r, 1), "chosen");
    r = sf_report(m, 0, 2, &name);
    CHECK_STR(name, "Eager");
    CHECK_INT(r.state, TW_CAND_FAILED);
    CHECK_STR(r.msg, "Eager does not build");
    CHECK_STR(tw_candidate_verdict(&r, 0), "failed");
    CHECK_INT(f.runs[0][2], 0);

    g = sf_group_report(m, 1);
    CHECK_INT(g.chosen, 1);
    r = sf_report(m, 1, 0, NULL);
    CHECK_INT(r.state, TW_CAND_FAILED);
    r = sf_report(m, 1, 1, NULL);
    CHECK_INT(r.state, TW_CAND_BUILT);
    CHECK_STR(tw_candidate_verdict(&r, 1), "chosen");
    CHECK_STR(tw_candidate_verdict(&r, 0), "built");
    r = sf_report(m, 1, 2, NULL);
    CHECK_INT(r.state, TW_CAND_NOT_TRIED);
    CHECK_STR(tw_candidate_verdict(&r, 0), "not tried");
    CHECK_INT(f.builds[1][2], 0); /* first-wins stopped at the first that built */
    CHECK_INT(f.runs[1][1], 0);   /* and measured nothing */

    CHECK_INT(f.commits[0], 1);
    CHECK_INT(f.commits[1], 1);
    CHECK_INT(f.committed[0], 1);
    CHECK_INT(f.committed[1], 1);

    /* the accessors refuse what is out of range */
    CHECK_INT(tw_module_result_group(m, 2, &g, NULL), TW_EINVAL);
    CHECK_INT(tw_module_result_candidate(m, 0, 3, NULL, NULL, NULL), TW_EINVAL);
    CHECK_INT(tw_module_result_candidate(m, 2, 0, NULL, NULL, NULL), TW_EINVAL);
    tw_module_result_destroy(m);
    CHECK_INT(f.env.live, 0);

    /* NULL reads as nothing */
    CHECK_INT(tw_module_result_state(NULL), 0);
    CHECK_STR(tw_module_result_error(NULL), "");
    CHECK_INT(tw_module_result_group_count(NULL), 0);
    CHECK_INT(tw_module_result_group(NULL, 0, &g, NULL), TW_EINVAL);
    tw_module_result_destroy(NULL);
}

/* Nothing passes: the group and the module say why, per candidate. */
static void test_every_candidate_fails(void)
{
    search_fake f;
    tw_module_result *m = NULL;
    tw_group_report g;

    sf_setup(&f);
    f.n_groups = 1;
    f.kind[0] = TW_STRATEGY_HIGHEST_THROUGHPUT;
    f.n_cands[0] = 2;
    f.build_rc[0][0] = TW_ECALLBACK;
    f.build_rc[0][1] = TW_ECALLBACK;
    CHECK_INT(sf_tune(&f, "head", &m, NULL), TW_OK);
    CHECK_INT(tw_module_result_state(m), -1);
    g = sf_group_report(m, 0);
    CHECK_INT(g.chosen, -1);
    CHECK_STR(g.error, "no backend passed (Inductor: Inductor does not build; "
                       "OpenVINO: OpenVINO does not build)");
    CHECK_STR(tw_module_result_error(m), g.error);
    CHECK_INT(f.committed[0], -1);
    tw_module_result_destroy(m);

    /* two groups: each error after its text; a never-tried candidate by its state */
    sf_setup(&f);
    f.n_groups = 2;
    f.n_cands[0] = 1;
    f.build_rc[0][0] = TW_ECALLBACK;
    f.kind[1] = TW_STRATEGY_FIRST_WINS;
    f.n_cands[1] = 1;
    f.names[1][0] = NULL;
    f.build_rc[1][0] = TW_ECALLBACK;
    CHECK_INT(sf_tune(&f, "head", &m, NULL), TW_OK);
    CHECK_STR(tw_module_result_error(m),
              "(float32[8, 16]): no backend passed (Inductor: Inductor does not build); "
              "(float32[1, 16]): no backend passed ((unnamed): it does not build)");
    tw_module_result_destroy(m);
    CHECK_INT(f.env.live, 0);
}

/* A candidate whose measurement fails loses; the others are measured again. */
/* The build facts live in the result: the host's reason, largest error and
 * tolerance, the engine's build time by the host's clock, the group's flags; a
 * failed build the host gave no reason for reads "build failed", and a
 * candidate that failed while measured has none. */
static void test_build_facts(void)
{
    static const unsigned flags[MAX_CANDS] = {0, TW_CAND_LOWERS_PRECISION | TW_CAND_VARIANT,
                                              0, 0};
    search_fake f;
    tw_module_result *m = NULL;
    tw_candidate_report r;

    sf_setup(&f);
    f.n_groups = 1;
    f.kind[0] = TW_STRATEGY_HIGHEST_THROUGHPUT;
    f.n_cands[0] = 4;
    f.flags[0] = flags;
    f.build_cost = 250;
    f.facts[0][0].max_error = 2e-5;
    f.facts[0][0].tolerance = NAN;
    f.facts[0][0].own_error = NAN;
    f.build_rc[0][1] = TW_ECALLBACK;
    f.facts[0][1].reason = TW_REASON_MISMATCH;
    f.facts[0][1].max_error = 0.5;
    f.facts[0][1].tolerance = 0.01;
    f.facts[0][1].own_error = 0.002;
    f.build_rc[0][2] = TW_ECALLBACK;
    f.run_rc[0][3] = TW_ECALLBACK;
    CHECK_INT(sf_tune(&f, "layers.0", &m, NULL), TW_OK);
    r = sf_report(m, 0, 0, NULL);
    CHECK_INT(r.state, TW_CAND_MEASURED);
    CHECK_INT(r.facts.reason, TW_REASON_NONE);
    CHECK_NEAR(r.facts.max_error, 2e-5, 1e-12);
    CHECK(r.facts.tolerance != r.facts.tolerance);
    CHECK(r.facts.own_error != r.facts.own_error);
    CHECK_INT(r.build_ns, 250);
    CHECK_INT(r.flags, 0);
    r = sf_report(m, 0, 1, NULL);
    CHECK_INT(r.state, TW_CAND_FAILED);
    CHECK_INT(r.facts.reason, TW_REASON_MISMATCH);
    CHECK_NEAR(r.facts.max_error, 0.5, 1e-12);
    CHECK_NEAR(r.facts.tolerance, 0.01, 1e-12);
    CHECK_NEAR(r.facts.own_error, 0.002, 1e-12);
    CHECK_INT(r.build_ns, 250);
    /* a module searched alone has no budget: the variant was built */
    CHECK_INT(f.builds[0][1], 1);
    CHECK_INT(r.flags, TW_CAND_LOWERS_PRECISION | TW_CAND_VARIANT);
    r = sf_report(m, 0, 2, NULL);
    CHECK_INT(r.facts.reason, TW_REASON_BUILD_FAILED);
    CHECK(r.facts.max_error != r.facts.max_error);
    r = sf_report(m, 0, 3, NULL);
    CHECK_INT(r.state, TW_CAND_FAILED);
    CHECK_INT(r.facts.reason, TW_REASON_NONE);
    CHECK_INT(r.build_ns, 250);
    tw_module_result_destroy(m);
}

static void test_measurement_failure(void)
{
    search_fake f;
    tw_module_result *m = NULL;
    tw_candidate_report r;

    sf_setup(&f);
    f.n_groups = 1;
    f.kind[0] = TW_STRATEGY_HIGHEST_THROUGHPUT;
    f.n_cands[0] = 2;
    f.latency[0][0] = 50;
    f.run_rc[0][0] = TW_ECALLBACK;
    CHECK_INT(sf_tune(&f, "a", &m, NULL), TW_OK);
    CHECK_INT(sf_group_report(m, 0).chosen, 1);
    r = sf_report(m, 0, 0, NULL);
    CHECK_INT(r.state, TW_CAND_FAILED);
    CHECK_STR(r.msg, "Inductor broke while measured");
    tw_module_result_destroy(m);
    CHECK_INT(f.env.live, 0);
}

/* The module never called, and groups() failing, end before any group. */
static void test_no_groups(void)
{
    search_fake f;
    tw_module_result *m = NULL;

    sf_setup(&f);
    CHECK_INT(sf_tune(&f, "", &m, NULL), TW_OK);
    CHECK_INT(tw_module_result_state(m), -1);
    CHECK_STR(tw_module_result_error(m),
              "the dataset never called (root); there is nothing to tune it on");
    CHECK_INT(tw_module_result_group_count(m), 0);
    tw_module_result_destroy(m);

    sf_setup(&f);
    f.n_groups = 1;
    f.groups_rc = TW_ECALLBACK;
    CHECK_INT(sf_tune(&f, "enc", &m, NULL), TW_OK);
    CHECK_INT(tw_module_result_state(m), -1);
    CHECK_STR(tw_module_result_error(m), "cannot record node 7");
    CHECK_INT(f.opened[0], 0);
    CHECK_INT(f.commits[0], 0);
    tw_module_result_destroy(m);
    CHECK_INT(f.env.live, 0);
}

/* group() failing, a strategy refusing its candidates, and commit() failing
 * fail their group only; the next group is still searched. */
static void test_group_failures(void)
{
    search_fake f;
    tw_module_result *m = NULL;
    tw_group_report g;

    sf_setup(&f);
    f.n_groups = 2;
    f.group_rc[0] = TW_ECALLBACK;
    f.n_cands[1] = 1;
    CHECK_INT(sf_tune(&f, "enc", &m, NULL), TW_OK);
    CHECK_INT(tw_module_result_state(m), 1);
    g = sf_group_report(m, 0);
    CHECK_INT(g.chosen, -1);
    CHECK_STR(g.error, "cannot describe group 0");
    CHECK_STR(g.text, "");
    CHECK_INT(g.n_candidates, 0);
    CHECK_INT(f.commits[0], 1);
    CHECK_INT(f.committed[0], -1);
    CHECK_INT(f.committed[1], 0);
    /* a group without text is named by its error alone */
    CHECK_STR(tw_module_result_error(m), "cannot describe group 0");
    tw_module_result_destroy(m);

    sf_setup(&f);
    f.n_groups = 2;
    f.kind[0] = TW_STRATEGY_ONE_BACKEND;
    f.n_cands[0] = 2;
    f.n_cands[1] = 0;
    CHECK_INT(sf_tune(&f, "enc", &m, NULL), TW_OK);
    CHECK_INT(tw_module_result_state(m), -1);
    CHECK_STR(sf_group_report(m, 0).error, "strategy one-backend takes exactly one backend, not 2");
    CHECK_STR(sf_group_report(m, 1).error, "strategy first-wins got no backends: give it at "
                                           "least one");
    CHECK_INT(f.builds[0][0], 0); /* refused before any build */
    CHECK_INT(f.commits[0] + f.commits[1], 2);
    tw_module_result_destroy(m);

    sf_setup(&f);
    f.n_groups = 1;
    f.n_cands[0] = 1;
    f.commit_rc[0] = TW_ECALLBACK;
    CHECK_INT(sf_tune(&f, "enc", &m, NULL), TW_OK);
    CHECK_INT(tw_module_result_state(m), -1);
    g = sf_group_report(m, 0);
    CHECK_INT(g.chosen, -1);
    CHECK_STR(g.error, "cannot install group 0");
    CHECK_INT(sf_report(m, 0, 0, NULL).state, TW_CAND_BUILT);
    tw_module_result_destroy(m);
    CHECK_INT(f.env.live, 0);
}

/* TW_EINTERRUPT from any callback: the group in progress is committed with
 * -1, nothing else runs, no result, nothing leaks. */
static void test_interrupt(void)
{
    search_fake f;
    tw_module_result *m = (tw_module_result *)&f; /* must be reset to NULL */
    tw_error err;
    int where;

    for (where = 0; where < 5; where++) {
        sf_setup(&f);
        f.n_groups = 2;
        f.kind[0] = TW_STRATEGY_HIGHEST_THROUGHPUT;
        f.n_cands[0] = 2;
        f.kind[1] = TW_STRATEGY_HIGHEST_THROUGHPUT;
        f.n_cands[1] = 2;
        switch (where) {
        case 0: f.groups_rc = TW_EINTERRUPT; break;
        case 1: f.group_rc[1] = TW_EINTERRUPT; break;
        case 2: f.build_rc[1][0] = TW_EINTERRUPT; break;
        case 3: f.run_rc[1][1] = TW_EINTERRUPT; break;
        default: f.commit_rc[1] = TW_EINTERRUPT; break;
        }
        CHECK_INT(sf_tune(&f, "enc", &m, &err), TW_EINTERRUPT);
        CHECK(m == NULL);
        CHECK_INT(err.code, TW_EINTERRUPT);
        CHECK(err.msg[0] != '\0');
        if (where == 0) {
            CHECK_INT(f.opened[0], 0);
            CHECK_INT(f.commits[0], 0);
        } else {
            CHECK_INT(f.committed[0], 0); /* the first group was done */
            CHECK_INT(f.commits[1], 1);   /* the second was ended, with -1 */
            CHECK_INT(f.committed[1], where == 4 ? 0 : -1);
        }
        if (where == 2) {
            CHECK_INT(f.builds[1][1], 0); /* nothing ran after the interrupt */
            CHECK_STR(err.msg, "Inductor does not build");
        }
        CHECK_INT(f.env.live, 0);
        m = (tw_module_result *)&f;
    }
}

/* sync() runs around every timed call when given (settle 0: every call is a
 * timed one; the untimed calls opening a round get one sync, before the first
 * timed call). */
static void test_sync(void)
{
    search_fake f;
    tw_module_ops ops;
    tw_measure_config cfg = fake_quick_config();
    tw_module_result *m = NULL;

    cfg.settle = 0;
    sf_setup(&f);
    f.n_groups = 1;
    f.kind[0] = TW_STRATEGY_HIGHEST_THROUGHPUT;
    f.n_cands[0] = 2;
    ops = sf_ops(&f);
    ops.sync = sf_sync;
    CHECK_INT(tw_tune_module(&f.host, &ops, 7, "a", &cfg, &m, NULL), TW_OK);
    CHECK(f.syncs >= 2 * (int)(f.runs[0][0] + f.runs[0][1]));
    tw_module_result_destroy(m);
    CHECK_INT(f.env.live, 0);
}

/* Bad arguments call nothing. */
static void test_invalid(void)
{
    search_fake f;
    tw_module_ops ops;
    tw_measure_config cfg = fake_quick_config();
    tw_module_result *m = NULL;
    tw_error err;

    sf_setup(&f);
    f.n_groups = 1;
    f.n_cands[0] = 1;
    CHECK_INT(tw_tune_module(&f.host, NULL, 0, "a", &cfg, &m, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "ops is NULL");
    ops = sf_ops(&f);
    ops.commit = NULL;
    CHECK_INT(tw_tune_module(&f.host, &ops, 0, "a", &cfg, &m, &err), TW_EINVAL);
    CHECK_STR(err.msg, "ops.commit is NULL: every callback but sync is needed");
    ops = sf_ops(&f);
    CHECK_INT(tw_tune_module(&f.host, &ops, 0, "a", &cfg, NULL, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "out is NULL");
    cfg.rounds_min = 0;
    CHECK_INT(tw_tune_module(&f.host, &ops, 0, "a", &cfg, &m, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "rounds_min");
    CHECK(m == NULL);
    CHECK_INT(f.groups_calls, 0);
    /* a NULL cfg is the defaults, a NULL path the root */
    CHECK_INT(tw_tune_module(&f.host, &ops, 0, NULL, NULL, &m, &err), TW_OK);
    CHECK_STR(tw_module_result_path(m), "");
    CHECK_INT(tw_module_result_state(m), 1);
    tw_module_result_destroy(m);
    CHECK_INT(f.env.live, 0);
}

/* Running out of memory at every allocation in turn: TW_ENOMEM, every group()
 * still committed, nothing leaked; until the search succeeds. */
static void test_out_of_memory(void)
{
    search_fake f;
    tw_module_result *m = NULL;
    tw_error err;
    tw_code rc = TW_ENOMEM;
    long limit;
    size_t g;

    for (limit = 0; limit < 200 && rc != TW_OK; limit++) {
        sf_setup(&f);
        f.n_groups = 2;
        f.kind[0] = TW_STRATEGY_HIGHEST_THROUGHPUT;
        f.n_cands[0] = 3;
        f.build_rc[0][2] = TW_ECALLBACK;
        f.n_cands[1] = 2;
        f.build_rc[1][0] = TW_ECALLBACK;
        f.build_rc[1][1] = TW_ECALLBACK;
        f.env.allocs_left = limit;
        rc = sf_tune(&f, "layers.0", &m, &err);
        if (rc != TW_OK) {
            CHECK_INT(rc, TW_ENOMEM);
            CHECK_INT(err.code, TW_ENOMEM);
            CHECK(m == NULL);
        }
        for (g = 0; g < 2; g++) {
            CHECK_INT(f.commits[g], f.opened[g]);
        }
        tw_module_result_destroy(m);
        m = NULL;
        CHECK_INT(f.env.live, 0);
    }
    CHECK_INT(rc, TW_OK);
    CHECK(limit > 8);
}

int main(void)
{
    test_groups_and_picks();
    test_every_candidate_fails();
    test_build_facts();
    test_measurement_failure();
    test_no_groups();
    test_group_failures();
    test_interrupt();
    test_sync();
    test_invalid();
    test_out_of_memory();
    return CHECK_SUMMARY("test_search");
}
