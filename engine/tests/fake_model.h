/*
 * fake_model.h - a fake model for the depth search tests: its latency depends
 * on the cut that is entered and activated, and every callback is recorded.
 * Include after check.h: the callbacks check the order of calls.
 */
#ifndef TW_FAKE_MODEL_H
#define TW_FAKE_MODEL_H

#include <stdio.h>
#include <string.h>

#include "fake.h"
#include "tweak.h"

#define MAX_NODES 16
#define MAX_DEPTH 8

/* The model: root, layers.0(.mlp), layers.1(.mlp), head (a leaf at depth 1).
 * Cuts: 0 {root}; 1 {layers.0, layers.1, head}; 2 {layers.0.mlp, layers.1.mlp, head}. */
static const char *const model_paths[] = {"", "layers.0", "layers.0.mlp", "layers.1",
                                          "layers.1.mlp", "head"};
enum { ROOT, L0, L0_MLP, L1, L1_MLP, HEAD, N_NODES };

typedef struct fake_model {
    fake_env env;
    tw_host host;
    tw_tree *tree;
    /* behaviour */
    tw_code tune_rc[MAX_NODES];
    uint64_t tune_cost[MAX_NODES];    /* fake ns a tune takes */
    uint64_t depth_latency[MAX_DEPTH];
    tw_code depth_fail[MAX_DEPTH];     /* the model fails when active at this depth */
    uint64_t base_first;              /* untuned latency before any leave() */
    uint64_t base_second;             /* untuned latency after */
    uint64_t wrapped_latency;         /* a cut entered but deactivated; 0: as untuned */
    uint64_t burst_latency;           /* a burst of load: the untuned latency of a cut
                                       * entered and deactivated while deactivates <=
                                       * burst_until (the side-by-side measurement,
                                       * 3 deactivates per measurement); 0: none */
    int burst_until;
    uint64_t burst_tuned;             /* likewise, the active cut's latency; 0: none */
    double jitter;                    /* each call's latency varies by up to this fraction */
    int loaded;                       /* each call is slowed as beside other CPU-bound jobs
                                       * on 2 cores (model_loaded) */
    uint64_t lcg;                     /* the jitter's and the load's random state */
    tw_code deactivate_rc;
    tw_code enter_rc;
    tw_code activate_rc;
    int activate_fail_at;             /* this activate (1, 2...) fails; 0: none */
    tw_code leave_rc;
    tw_code baseline_rc;
    int variants;                     /* every group opens with a variant candidate,
                                       * "fake [variant]" (TW_CAND_VARIANT), before "fake" */
    uint64_t build_cost;              /* fake ns a build takes */
    /* the machine's load (model_load, set in the ops only when load_known): the
     * share of 2 cores other processes take while nothing was deactivated yet
     * (the search), and once something was (the side-by-side measurement) */
    int load_known;
    double search_share;
    double side_share;
    tw_code load_rc;                  /* the load callback fails with this */
    double load_unit;                 /* fake ns per second of wall time; 0: 1000 */
    double load_others;               /* its running totals, in fake ns */
    double load_capacity;
    uint64_t load_last;
    int load_calls;
    /* what happened */
    int tune_calls[MAX_NODES];        /* module searches started (groups()) */
    int builds[MAX_NODES][2];         /* builds per node and candidate */
    long committed[MAX_NODES];        /* per node, the last commit's choice */
    int enters;
    int leaves;
    int activates;
    int deactivates;
    int entered;
    int active;
    int depth;                        /* depth of the entered cut */
    int last_tune_flags[MAX_NODES];   /* per node, from the last enter */
    long untuned_runs;
    char events[2048];
    size_t events_len;
} fake_model;

static inline void log_event(fake_model *m, const char *text)
{
    size_t n = strlen(text);

    if (m->events_len + n + 1 < sizeof m->events) {
        memcpy(m->events + m->events_len, text, n + 1);
        m->events_len += n;
    }
}

static inline tw_code model_enter(void *ctx, const size_t *nodes, const int *tune,
                                  size_t n, tw_error *err)
{
    fake_model *m = ctx;
    char text[32];
    size_t i;

    CHECK(!m->entered); /* never entered twice without a leave */
    m->enters++;
    m->entered = 1;
    m->depth = 0;
    for (i = 0; i < MAX_NODES; i++) {
        m->last_tune_flags[i] = -1;
    }
    for (i = 0; i < n; i++) {
        int d = tw_tree_depth(m->tree, nodes[i]);

        m->depth = d > m->depth ? d : m->depth;
        m->last_tune_flags[nodes[i]] = tune[i];
    }
    snprintf(text, sizeof text, "E%d ", m->depth);
    log_event(m, text);
    if (m->enter_rc != TW_OK) {
        return tw_error_set(err, m->enter_rc, "cannot wrap depth %d", m->depth);
    }
    return TW_OK;
}

/* The module search's groups(): "tuning" a module starts here; tune_rc[node]
 * fails it before any group. Every module has one group of one candidate. */
static inline tw_code model_groups(void *ctx, size_t node, size_t *count, tw_error *err)
{
    fake_model *m = ctx;
    char text[64];

    CHECK(m->entered);
    CHECK_INT(m->last_tune_flags[node], 1);
    m->tune_calls[node]++;
    m->env.now += m->tune_cost[node];
    snprintf(text, sizeof text, "T%s ", model_paths[node][0] ? model_paths[node] : "()");
    log_event(m, text);
    if (m->tune_rc[node] != TW_OK) {
        return tw_error_set(err, m->tune_rc[node], "no backend fits %s",
                            model_paths[node][0] ? model_paths[node] : "(root)");
    }
    *count = 1;
    return TW_OK;
}

static const char *const model_candidates[] = {"fake"};
static const char *const model_variant_candidates[] = {"fake [variant]", "fake"};
static const unsigned model_variant_flags[] = {TW_CAND_VARIANT | TW_CAND_LOWERS_PRECISION, 0};

static inline tw_code model_group(void *ctx, size_t node, size_t group, tw_group_info *info,
                                  tw_error *err)
{
    fake_model *m = ctx;

    (void)node;
    (void)group;
    (void)err;
    info->text = "(x)";
    info->kind = TW_STRATEGY_FIRST_WINS;
    info->n_candidates = m->variants ? 2 : 1;
    info->names = m->variants ? model_variant_candidates : model_candidates;
    info->flags = m->variants ? model_variant_flags : NULL;
    info->n_samples = 1;
    return TW_OK;
}

/* Builds take build_cost fake ns; a build that passes says its largest error. */
static inline tw_code model_build(void *ctx, size_t node, size_t group, size_t cand,
                                  tw_build_facts *facts, tw_error *err)
{
    fake_model *m = ctx;

    (void)group;
    (void)err;
    CHECK(m->entered);
    CHECK_INT(m->last_tune_flags[node], 1);
    CHECK_INT(facts->reason, TW_REASON_NONE); /* as the engine set it */
    CHECK(facts->max_error != facts->max_error);
    m->builds[node][cand < 2 ? cand : 1]++;
    m->env.now += m->build_cost;
    facts->max_error = 0.001;
    return TW_OK;
}

static inline tw_code model_cand_run(void *ctx, size_t node, size_t group, size_t cand,
                                     size_t sample, tw_error *err)
{
    fake_model *m = ctx;

    (void)node;
    (void)group;
    (void)cand;
    (void)sample;
    (void)err;
    m->env.now += 10;
    return TW_OK;
}

static inline tw_code model_commit(void *ctx, size_t node, size_t group, long chosen,
                                   tw_error *err)
{
    fake_model *m = ctx;

    (void)group;
    (void)err;
    CHECK(m->entered);
    m->committed[node] = chosen;
    return TW_OK;
}

static inline tw_code model_activate(void *ctx, tw_error *err)
{
    fake_model *m = ctx;

    CHECK(m->entered);
    m->activates++;
    log_event(m, "A ");
    if (m->activate_fail_at == m->activates) {
        return tw_error_set(err, TW_ECALLBACK, "activate %d broke", m->activates);
    }
    if (m->activate_rc != TW_OK) {
        return tw_error_set(err, m->activate_rc, "cannot activate depth %d", m->depth);
    }
    m->active = 1;
    return TW_OK;
}

static inline tw_code model_deactivate(void *ctx, tw_error *err)
{
    fake_model *m = ctx;

    CHECK(m->entered);
    m->deactivates++;
    if (m->deactivate_rc != TW_OK) {
        return tw_error_set(err, m->deactivate_rc, "cannot deactivate depth %d", m->depth);
    }
    m->active = 0;
    return TW_OK;
}

static inline tw_code model_leave(void *ctx, tw_error *err)
{
    fake_model *m = ctx;

    CHECK(m->entered);
    m->leaves++;
    m->entered = 0;
    m->active = 0;
    log_event(m, "L ");
    if (m->leave_rc != TW_OK) {
        return tw_error_set(err, m->leave_rc, "cannot unwrap");
    }
    return TW_OK;
}

/* The next number of the model's fixed random sequence, in [0, 1). */
static inline double model_uniform(fake_model *m)
{
    m->lcg = m->lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(m->lcg >> 11) / 9007199254740992.0;
}

/* A call's latency beside two busy loops and one more CPU-bound job on 2
 * cores: half the calls run unhindered, most others wait for the CPU up to 3
 * times their own length more, and one in 20 ten times its length (a burst). */
static inline double model_loaded(fake_model *m, double latency)
{
    double u = model_uniform(m);

    return u < 0.5 ? latency : u < 0.95 ? latency * (1.0 + 3.0 * model_uniform(m))
                                        : latency * 10.0;
}

/* `latency` moved by up to +-jitter of itself, then slowed by the load when
 * the model is loaded, from a fixed random sequence. */
static inline uint64_t model_jittered(fake_model *m, uint64_t latency)
{
    double value = (double)latency;

    if (m->jitter != 0.0) {
        value *= 1.0 + m->jitter * (2.0 * model_uniform(m) - 1.0);
    }
    return (uint64_t)(m->loaded ? model_loaded(m, value) : value);
}

static inline tw_code model_run(void *ctx, size_t sample, tw_error *err)
{
    fake_model *m = ctx;

    (void)sample;
    if (m->active) {
        if (m->depth_fail[m->depth] != TW_OK) {
            return tw_error_set(err, m->depth_fail[m->depth], "model broke at depth %d",
                                m->depth);
        }
        if (m->burst_tuned != 0 && m->deactivates > 0 && m->deactivates <= m->burst_until) {
            m->env.now += model_jittered(m, m->burst_tuned);
            return TW_OK;
        }
        m->env.now += model_jittered(m, m->depth_latency[m->depth]);
        return TW_OK;
    }
    if (m->baseline_rc != TW_OK) {
        return tw_error_set(err, m->baseline_rc, "untuned model broke");
    }
    m->untuned_runs++;
    if (m->entered && m->burst_latency != 0 && m->deactivates > 0 &&
        m->deactivates <= m->burst_until) {
        m->env.now += model_jittered(m, m->burst_latency);
        return TW_OK;
    }
    if (m->entered && m->wrapped_latency != 0) {
        m->env.now += model_jittered(m, m->wrapped_latency);
        return TW_OK;
    }
    m->env.now += model_jittered(m, m->leaves == 0 ? m->base_first : m->base_second);
    return TW_OK;
}

/* The fake load: since the last reading, others took the share of the phase
 * the model is in (see fake_model.search_share) of 2 cores' capacity; a fake
 * ns stands for a ms (the fake model's calls take about a second). */
static inline tw_code model_load(void *ctx, tw_load *out, tw_error *err)
{
    fake_model *m = ctx;
    double elapsed = 2.0 * (double)(m->env.now - m->load_last) /
                     (m->load_unit > 0.0 ? m->load_unit : 1000.0);

    m->load_calls++;
    if (m->load_rc != TW_OK) {
        return tw_error_set(err, m->load_rc, "cannot read the load");
    }
    m->load_capacity += elapsed;
    m->load_others += elapsed * (m->deactivates > 0 ? m->side_share : m->search_share);
    m->load_last = m->env.now;
    out->known = 1;
    out->others = m->load_others;
    out->capacity = m->load_capacity;
    return TW_OK;
}

static inline void fake_model_setup(fake_model *m)
{
    size_t i;

    memset(m, 0, sizeof *m);
    fake_env_init(&m->env);
    m->host = fake_host(&m->env);
    m->tree = tw_tree_create(&m->host, NULL);
    for (i = 0; i < N_NODES; i++) {
        CHECK_INT(tw_tree_add(m->tree, model_paths[i], 1, 0, NULL, NULL), TW_OK);
    }
    CHECK_INT(tw_tree_finish(m->tree, NULL), TW_OK);
    m->base_first = 1000;
    m->base_second = 1000;
    m->depth_latency[0] = 900;
    m->depth_latency[1] = 800;
    m->depth_latency[2] = 700;
}

static inline tw_tweak_ops fake_model_ops(fake_model *m)
{
    tw_tweak_ops ops;

    ops.ctx = m;
    ops.enter = model_enter;
    ops.modules.ctx = m;
    ops.modules.groups = model_groups;
    ops.modules.group = model_group;
    ops.modules.build = model_build;
    ops.modules.run = model_cand_run;
    ops.modules.sync = NULL;
    ops.modules.commit = model_commit;
    ops.activate = model_activate;
    ops.deactivate = NULL;
    ops.leave = model_leave;
    ops.model.ctx = m;
    ops.model.n_samples = 2;
    ops.model.run = model_run;
    ops.model.sync = NULL;
    ops.model.round = NULL;
    ops.load = m->load_known ? model_load : NULL;
    return ops;
}

static inline tw_tweak_config fake_model_config(void)
{
    tw_tweak_config cfg;

    tw_tweak_config_default(&cfg);
    cfg.max_depth = 2; /* the fake model's three depths */
    cfg.measure = fake_quick_config();
    /* the fake model's calls take microseconds and its load slows each call, not
     * a scheduler's slices: rounds of one pass, which its tests were written for
     * (test_measure holds the rounds a busy machine gets) */
    cfg.busy_round_ns = 0;
    return cfg;
}

static inline tw_code fake_model_tweak(fake_model *m, const tw_tweak_config *cfg,
                                       tw_result **result, tw_error *err)
{
    tw_tweak_ops ops = fake_model_ops(m);

    return tw_tweak_run(&m->host, m->tree, cfg, &ops, result, err);
}

static inline tw_row fake_model_row(const tw_result *result, size_t i)
{
    tw_row row;

    memset(&row, 0, sizeof row);
    CHECK_INT(tw_result_row(result, i, &row, NULL), TW_OK);
    return row;
}

static inline void fake_model_teardown(fake_model *m, tw_result *result)
{
    tw_result_destroy(result);
    tw_tree_destroy(m->tree);
    CHECK_INT(m->env.live, 0);
}

#endif /* TW_FAKE_MODEL_H */
