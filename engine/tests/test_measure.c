/*
 * test_measure.c - the measurement protocol on a fake clock: warm-up, the
 * stop rules, the statistics, errors and interleaved comparison.
 */
#include <math.h>

#include "check.h"
#include "fake.h"
#include "tweak.h"

static tw_measure_config base_config(void)
{
    tw_measure_config cfg;

    tw_measure_config_default(&cfg);
    cfg.warmup_min = 0;
    cfg.warmup_max = 0;
    cfg.time_cap_ns = 0;
    cfg.settle = 0;
    return cfg;
}

/* Measures with a fresh runner (id 1) that follows `script` over n_samples
 * samples; fr keeps the runner's calls for the checks. */
static tw_code measure_script(fake_env *env, fake_runner *fr, const uint64_t *script,
                              size_t script_len, size_t n_samples,
                              const tw_measure_config *cfg, tw_stats *st)
{
    tw_host host = fake_host(env);
    tw_runner runner;

    fake_runner_init(fr, env, 1, script, script_len, n_samples);
    runner = fake_runner_of(fr);
    return tw_measure(&host, &runner, cfg, st, NULL);
}

/* Slow first rounds: warm-up goes on while they fall, and stops after
 * `patience` rounds that are no faster. */
static void test_warmup(void)
{
    static const uint64_t script[] = {1000, 500, 300, 100, 100, 99, 100};
    fake_env env;
    fake_runner fr;
    tw_measure_config cfg;
    tw_stats st;

    fake_env_init(&env);
    tw_measure_config_default(&cfg);
    cfg.time_cap_ns = 0;
    CHECK_INT(measure_script(&env, &fr, script, 7, 2, &cfg, &st), TW_OK);
    /* 1000, 500, 300, 100 each fall; 100 and 99 fall less than 2 %: stop */
    CHECK_INT(st.warmup_rounds, 6);
    CHECK_INT(st.rounds, 5);
    CHECK_INT(st.stopped_by, TW_STOP_SPREAD);
    CHECK_NEAR(st.median_ns, 100, 1e-9);
    CHECK_INT(fr.calls, (6 + 5) * 2);
    CHECK_INT(env.live, 0);

    /* warmup_max bounds a latency that keeps falling */
    static const uint64_t falling[] = {1000, 900, 800, 700, 600, 500, 400, 300, 200, 100};
    cfg.warmup_max = 4;
    CHECK_INT(measure_script(&env, &fr, falling, 10, 1, &cfg, &st), TW_OK);
    CHECK_INT(st.warmup_rounds, 4);

    /* warmup_min holds even when the latency is flat from the start */
    static const uint64_t flat[] = {100};
    cfg.warmup_min = 5;
    cfg.warmup_max = 20;
    CHECK_INT(measure_script(&env, &fr, flat, 1, 1, &cfg, &st), TW_OK);
    CHECK_INT(st.warmup_rounds, 5);
}

/* A quiet runner stops at rounds_min, a noisy one runs to rounds_max. */
static void test_spread_rule(void)
{
    static const uint64_t quiet[] = {100};
    static const uint64_t noisy[] = {100, 200};
    uint64_t noisy_script[64];
    fake_env env;
    fake_runner fr;
    tw_measure_config cfg = base_config();
    tw_stats st;
    size_t i;

    for (i = 0; i < 64; i++) {
        noisy_script[i] = noisy[i % 2];
    }
    fake_env_init(&env);
    cfg.rounds_min = 4;
    cfg.rounds_max = 12;
    CHECK_INT(measure_script(&env, &fr, quiet, 1, 3, &cfg, &st), TW_OK);
    CHECK_INT(st.rounds, 4);
    CHECK_INT(st.stopped_by, TW_STOP_SPREAD);
    CHECK_NEAR(st.spread, 0, 1e-12);

    CHECK_INT(measure_script(&env, &fr, noisy_script, 64, 3, &cfg, &st), TW_OK);
    CHECK_INT(st.rounds, 12);
    CHECK_INT(st.stopped_by, TW_STOP_ROUNDS);
    CHECK(st.spread > cfg.rel_spread);
    CHECK_INT(fr.calls, 12 * 3);

    /* a looser rel_spread accepts the same noise at rounds_min */
    cfg.rel_spread = 1.0;
    CHECK_INT(measure_script(&env, &fr, noisy_script, 64, 3, &cfg, &st), TW_OK);
    CHECK_INT(st.rounds, 4);
    CHECK_INT(st.stopped_by, TW_STOP_SPREAD);
}

/* The time cap is checked between rounds. */
static void test_time_cap(void)
{
    uint64_t script[64];
    fake_env env;
    fake_runner fr;
    tw_measure_config cfg = base_config();
    tw_stats st;
    uint64_t start;
    size_t i;

    for (i = 0; i < 64; i++) {
        script[i] = (i % 2 == 0) ? 1000000 : 2000000; /* 1 ms, 2 ms: noisy */
    }
    fake_env_init(&env);
    cfg.rounds_min = 2;
    cfg.rounds_max = 50;
    cfg.time_cap_ns = 10000000;
    start = env.now;
    CHECK_INT(measure_script(&env, &fr, script, 64, 1, &cfg, &st), TW_OK);
    /* after 7 rounds 1+2+1+2+1+2+1 = 10 ms are used */
    CHECK_INT(st.stopped_by, TW_STOP_TIME);
    CHECK_INT(st.rounds, 7);
    CHECK_INT(env.now - start, 10000000);

    /* a cap used up in warm-up still leaves one measured round */
    cfg.warmup_min = 10;
    cfg.warmup_max = 10;
    cfg.time_cap_ns = 3000000;
    CHECK_INT(measure_script(&env, &fr, script, 64, 1, &cfg, &st), TW_OK);
    CHECK_INT(st.warmup_rounds, 2); /* 1 ms + 2 ms */
    CHECK_INT(st.rounds, 1);
    CHECK_INT(st.stopped_by, TW_STOP_TIME);
}

/* The median ignores an outlier round; quantiles interpolate linearly. */
static void test_statistics(void)
{
    static const uint64_t outlier[] = {100, 100, 50000000, 100, 100};
    static const uint64_t four[] = {4, 1, 3, 2};
    fake_env env;
    fake_runner fr;
    tw_measure_config cfg = base_config();
    tw_stats st;

    fake_env_init(&env);
    cfg.rounds_min = 5;
    cfg.rounds_max = 5;
    CHECK_INT(measure_script(&env, &fr, outlier, 5, 1, &cfg, &st), TW_OK);
    CHECK_NEAR(st.median_ns, 100, 1e-9);
    CHECK_NEAR(st.min_ns, 100, 1e-9);
    CHECK_NEAR(st.q75_ns, 100, 1e-9);

    cfg.rounds_min = 4;
    cfg.rounds_max = 4;
    CHECK_INT(measure_script(&env, &fr, four, 4, 1, &cfg, &st), TW_OK);
    CHECK_NEAR(st.median_ns, 2.5, 1e-9);
    CHECK_NEAR(st.q25_ns, 1.75, 1e-9);
    CHECK_NEAR(st.q75_ns, 3.25, 1e-9);
    CHECK_NEAR(st.min_ns, 1, 1e-9);
    CHECK_NEAR(st.spread, 1.5 / 2.5, 1e-9);
}

/* A sync that takes 50 ns: only the one after run falls inside the timing. */
static tw_code slow_sync(void *ctx, tw_error *err)
{
    fake_runner *fr = ctx;

    (void)err;
    fr->env->now += 50;
    return TW_OK;
}

static void test_sync_order(void)
{
    static const uint64_t script[] = {100};
    fake_env env;
    fake_runner fr;
    tw_runner runner;
    tw_measure_config cfg = base_config();
    tw_host host;
    tw_stats st;

    fake_env_init(&env);
    host = fake_host(&env);
    fake_runner_init(&fr, &env, 1, script, 1, 2);
    runner = fake_runner_of(&fr);
    runner.sync = slow_sync;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, NULL), TW_OK);
    CHECK_NEAR(st.median_ns, 150, 1e-9);
}

static void test_invalid(void)
{
    static const uint64_t script[] = {100};
    fake_env env;
    fake_runner fr;
    tw_runner runner;
    tw_measure_config cfg;
    tw_host host;
    tw_stats st;
    tw_error err;

    fake_env_init(&env);
    host = fake_host(&env);
    fake_runner_init(&fr, &env, 1, script, 1, 1);
    runner = fake_runner_of(&fr);

    cfg = base_config();
    cfg.rounds_min = 0;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "rounds_min");
    cfg = base_config();
    cfg.rounds_min = 9;
    cfg.rounds_max = 8;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "rounds_min (9) is greater than rounds_max (8)");
    cfg = base_config();
    cfg.warmup_min = 3;
    cfg.warmup_max = 2;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "warmup_min");
    cfg = base_config();
    cfg.warmup_gain = NAN;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "warmup_gain");
    cfg = base_config();
    cfg.rel_spread = -0.1;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "rel_spread");
    cfg = base_config();
    cfg.settle = TW_SETTLE_MAX;
    cfg.round_min_ns = TW_ROUND_MIN_MAX_NS + 1;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "round_min (1 s) is longer than 1 s");
    cfg.round_min_ns = 0;
    cfg.settle = TW_SETTLE_MAX + 1;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "settle (101) is more than 100");
    CHECK_INT(fr.calls, 0);
    cfg = base_config();
    runner.n_samples = 0;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "empty");
    runner = fake_runner_of(&fr);
    runner.run = NULL;
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINVAL);
    runner = fake_runner_of(&fr);
    CHECK_INT(tw_measure_compare(&host, &runner, 0, &cfg, &st, &err), TW_EINVAL);
    CHECK_INT(tw_measure(&host, NULL, &cfg, &st, &err), TW_EINVAL);
    CHECK_INT(fr.calls, 0);
    CHECK_INT(env.live, 0);
}

static void test_callback_error(void)
{
    static const uint64_t script[] = {100};
    fake_env env;
    fake_runner fr;
    tw_runner runner;
    tw_measure_config cfg = base_config();
    tw_host host;
    tw_stats st;
    tw_error err;

    fake_env_init(&env);
    host = fake_host(&env);
    fake_runner_init(&fr, &env, 7, script, 1, 2);
    fr.fail_at = 3;
    fr.fail_code = TW_ECALLBACK;
    runner = fake_runner_of(&fr);
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_ECALLBACK);
    CHECK_INT(err.code, TW_ECALLBACK);
    CHECK_STR(err.msg, "runner 7 broke at call 3");
    CHECK_INT(fr.calls, 4);

    fake_runner_init(&fr, &env, 7, script, 1, 2);
    fr.fail_at = 0;
    fr.fail_code = TW_EINTERRUPT;
    runner = fake_runner_of(&fr);
    CHECK_INT(tw_measure(&host, &runner, &cfg, &st, &err), TW_EINTERRUPT);
    CHECK_INT(fr.calls, 1);
    CHECK_INT(env.live, 0);
}

/* A fake runner per script (ids 1 and 2, one sample each) on a fresh env,
 * compared with cfg; fa and fb keep each runner's calls for the checks. */
typedef struct pair_script {
    const uint64_t *script;
    size_t len;
} pair_script;

static tw_code compare_pair_of(fake_env *env, fake_runner *fa, fake_runner *fb, pair_script a,
                               pair_script b, size_t n_samples, const tw_measure_config *cfg,
                               tw_stats st[2])
{
    tw_runner runners[2];
    tw_host host;

    fake_env_init(env);
    host = fake_host(env);
    fake_runner_init(fa, env, 1, a.script, a.len, n_samples);
    fake_runner_init(fb, env, 2, b.script, b.len, n_samples);
    runners[0] = fake_runner_of(fa);
    runners[1] = fake_runner_of(fb);
    return tw_measure_compare(&host, runners, 2, cfg, st, NULL);
}

static tw_code compare_pair(fake_env *env, fake_runner *fa, fake_runner *fb, pair_script a,
                            pair_script b, const tw_measure_config *cfg, tw_stats st[2])
{
    return compare_pair_of(env, fa, fb, a, b, 1, cfg, st);
}

/* Warm-up runs each runner alone (2 rounds); measured rounds alternate A, B,
 * A, B, each opened by `settle` untimed calls that its value leaves out. */
static void check_interleaving(size_t n_samples, uint32_t settle)
{
    static const uint64_t fast[] = {100};
    static const uint64_t slow[] = {300};
    fake_env env;
    fake_runner fa;
    fake_runner fb;
    tw_measure_config cfg = base_config();
    tw_stats st[2];
    size_t round_len = settle + n_samples;
    size_t warm = 2 * n_samples;
    size_t i;
    int alternates = 1;

    cfg.warmup_min = 2;
    cfg.warmup_max = 2;
    cfg.rounds_min = 6;
    cfg.rounds_max = 6;
    cfg.settle = settle;
    CHECK_INT(compare_pair_of(&env, &fa, &fb, (pair_script){fast, 1}, (pair_script){slow, 1},
                              n_samples, &cfg, st),
              TW_OK);
    CHECK_INT(env.log_len, 2 * warm + 2 * 6 * round_len);
    for (i = 0; i < 2 * warm; i++) {
        alternates = alternates && env.log[i] == (i < warm ? 1 : 2);
    }
    for (i = 2 * warm; i < env.log_len; i++) {
        alternates = alternates && env.log[i] == (((i - 2 * warm) / round_len) % 2 == 0 ? 1 : 2);
    }
    CHECK(alternates);
    CHECK_NEAR(st[0].median_ns, 100, 1e-9);
    CHECK_NEAR(st[1].median_ns, 300, 1e-9);
    CHECK_INT(st[0].rounds, 6);
    CHECK_INT(st[1].rounds, 6);
    CHECK_INT(st[0].warmup_rounds, 2);
}

static void test_compare_interleaves(void)
{
    static const uint64_t fast[] = {100};
    fake_env env;
    fake_runner fr;
    tw_measure_config cfg = base_config();
    tw_stats one;

    check_interleaving(1, 0);
    check_interleaving(2, 1);
    check_interleaving(3, 2);
    /* a lone runner: no untimed calls */
    cfg.rounds_min = 4;
    cfg.rounds_max = 4;
    cfg.settle = 1;
    fake_env_init(&env);
    CHECK_INT(measure_script(&env, &fr, fast, 1, 2, &cfg, &one), TW_OK);
    CHECK_INT(fr.calls, 4 * 2);
}

/* Comparison stops on spread only when every runner is quiet (the rule for
 * a clear fastest is off here: it would stop this one early). */
static void test_compare_waits_for_all(void)
{
    static const uint64_t quiet[] = {100};
    uint64_t noisy[64];
    fake_env env;
    fake_runner fa;
    fake_runner fb;
    tw_measure_config cfg = base_config();
    tw_stats st[2];
    size_t i;

    for (i = 0; i < 64; i++) {
        noisy[i] = i % 2 ? 100 : 300;
    }
    cfg.rounds_min = 3;
    cfg.rounds_max = 9;
    cfg.stop_when_decided = 0;
    CHECK_INT(compare_pair(&env, &fa, &fb, (pair_script){quiet, 1}, (pair_script){noisy, 64}, &cfg,
                           st), TW_OK);
    CHECK_INT(st[0].rounds, 9);
    CHECK_INT(st[0].stopped_by, TW_STOP_ROUNDS);
    CHECK_INT(fa.calls, 9);
    CHECK_INT(fb.calls, 9);
    CHECK_INT(env.live, 0);
}

/* A comparison stops once the fastest is clear, though a slower runner is
 * still noisy; with stop_when_decided off it runs to rounds_max. */
static void test_compare_stops_when_decided(void)
{
    static const uint64_t quiet[] = {100};
    uint64_t noisy[64];
    tw_measure_config cfg = base_config();
    fake_env env;
    fake_runner fa;
    fake_runner fb;
    tw_stats st[2];
    size_t i;
    int off;

    for (i = 0; i < 64; i++) {
        noisy[i] = i % 2 ? 500 : 300;
    }
    cfg.rounds_min = 4;
    cfg.rounds_max = 9;
    for (off = 0; off < 2; off++) {
        cfg.stop_when_decided = off ? 0 : 1;
        CHECK_INT(compare_pair(&env, &fa, &fb, (pair_script){quiet, 1}, (pair_script){noisy, 64},
                               &cfg, st), TW_OK);
        CHECK(st[1].spread > cfg.rel_spread);
        CHECK_INT(st[0].rounds, off ? 9 : 4);
        CHECK_INT(st[0].stopped_by, off ? TW_STOP_ROUNDS : TW_STOP_DECIDED);
        CHECK_INT(st[1].stopped_by, off ? TW_STOP_ROUNDS : TW_STOP_DECIDED);
        CHECK_INT(fb.calls, off ? 9 : 4);
        CHECK_NEAR(st[0].median_ns, 100, 1e-9);
        CHECK_INT(env.live, 0);
    }
    /* the leader is the lowest median wherever it stands */
    cfg.stop_when_decided = 1;
    CHECK_INT(compare_pair(&env, &fa, &fb, (pair_script){noisy, 64}, (pair_script){quiet, 1}, &cfg,
                           st), TW_OK);
    CHECK_INT(st[1].stopped_by, TW_STOP_DECIDED);
    CHECK_INT(st[1].rounds, 4);
}

/* A runner under interference: every call costs `cost` ns, and the machine's
 * bursts (shared by both runners: one random state) make a call up to 6x
 * slower, one call in three. */
typedef struct busy_runner {
    fake_env *env;
    uint64_t cost;
    uint64_t *lcg;
    double noise;    /* a quiet call still varies by up to this fraction */
} busy_runner;

static double busy_uniform(uint64_t *lcg)
{
    *lcg = *lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*lcg >> 11) / 9007199254740992.0;
}

static tw_code busy_run(void *ctx, size_t sample, tw_error *err)
{
    busy_runner *r = ctx;
    double factor = 1.0 + r->noise * (2.0 * busy_uniform(r->lcg) - 1.0);

    (void)sample;
    (void)err;
    if (busy_uniform(r->lcg) < 1.0 / 3.0) {
        factor *= 1.0 + 5.0 * busy_uniform(r->lcg);
    }
    r->env->now += (uint64_t)((double)r->cost * factor);
    return TW_OK;
}

static tw_runner busy_runner_of(busy_runner *r)
{
    tw_runner runner = {r, 4, busy_run, NULL, NULL};
    return runner;
}

/* Under bursts that spread each runner's rounds far beyond a 1.25x gap, the
 * paired rounds still find the faster one, with a 99 % interval above 1. */
static void test_paired_finds_the_faster_under_bursts(void)
{
    fake_env env;
    tw_host host;
    uint64_t lcg = 7;
    busy_runner a = {&env, 1000, &lcg, 0.02};
    busy_runner b = {&env, 800, &lcg, 0.02};
    tw_runner runners[2];
    tw_measure_config cfg = fake_quick_config();
    tw_paired p;
    tw_stats stats[2];

    fake_env_init(&env);
    host = fake_host(&env);
    runners[0] = busy_runner_of(&a);
    runners[1] = busy_runner_of(&b);
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, NULL, &p, NULL), TW_OK);
    CHECK(p.rounds >= 10 && p.rounds <= 400);
    CHECK(p.low > 1.0 && p.low <= p.ratio && p.ratio <= p.high);
    CHECK(p.ratio > 1.1 && p.ratio < 1.45);
    CHECK_INT(p.stopped_by, TW_STOP_DECIDED);
    CHECK(p.wins > p.rounds / 2);
    CHECK_INT(p.stats[0].rounds, p.rounds);
    /* the same bursts spread the unpaired medians' quartiles across each other */
    lcg = 7;
    cfg.rounds_min = cfg.rounds_max = 10;
    CHECK_INT(tw_measure_compare(&host, runners, 2, &cfg, stats, NULL), TW_OK);
    CHECK(stats[0].q25_ns < stats[1].q75_ns);
    CHECK_INT(env.live, 0);
}

/* Two equal runners: the interval holds 1, and more pairs are taken while it
 * is wide; the time cap stops them (after rounds_min) when it stays wide. */
static void test_paired_equal_runners_straddle_one(void)
{
    fake_env env;
    tw_host host;
    uint64_t lcg = 3;
    busy_runner a = {&env, 1000, &lcg, 0.3};
    busy_runner b = {&env, 1000, &lcg, 0.3};
    tw_runner runners[2];
    tw_measure_config cfg = fake_quick_config();
    tw_paired_config pcfg;
    tw_paired p;

    fake_env_init(&env);
    host = fake_host(&env);
    runners[0] = busy_runner_of(&a);
    runners[1] = busy_runner_of(&b);
    tw_paired_config_default(&pcfg);
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, &pcfg, &p, NULL), TW_OK);
    CHECK(p.low <= 1.0 && p.high >= 1.0);
    CHECK(p.rounds > pcfg.rounds_min); /* wide at first: more pairs */
    CHECK(p.stopped_by == TW_STOP_SPREAD || p.stopped_by == TW_STOP_ROUNDS);
    /* a cap of one pair's time: rounds_min pairs, then it stops */
    pcfg.width = 1e-6;
    pcfg.time_cap_ns = 1;
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, &pcfg, &p, NULL), TW_OK);
    CHECK_INT(p.rounds, pcfg.rounds_min);
    CHECK_INT(p.stopped_by, TW_STOP_TIME);
    CHECK_INT(env.live, 0);
}

/* The sign test's ranks and the ratio's edge cases. */
static void test_paired_interval(void)
{
    double r[20];
    tw_paired p;
    size_t i;

    for (i = 0; i < 20; i++) {
        r[i] = (double)(20 - i); /* sorted in place */
    }
    tw_paired_fill(r, 7, &p); /* 2^-7 > 0.005: no 99 % interval */
    CHECK(p.low == 0.0 && isinf(p.high));
    for (i = 0; i < 20; i++) {
        r[i] = (double)(20 - i);
    }
    tw_paired_fill(r, 8, &p); /* the first 8 values: 13..20; their extremes */
    CHECK_NEAR(p.low, 13.0, 0.0);
    CHECK_NEAR(p.high, 20.0, 0.0);
    CHECK_NEAR(p.ratio, 16.5, 1e-12);
    for (i = 0; i < 20; i++) {
        r[i] = (double)(i + 1);
    }
    tw_paired_fill(r, 20, &p); /* P(X <= 3) = 0.0013, P(X <= 4) = 0.0059: ranks 4 and 17 */
    CHECK_NEAR(p.low, 4.0, 0.0);
    CHECK_NEAR(p.high, 17.0, 0.0);
    CHECK_NEAR(tw_paired_ratio(2.0, 1.0), 2.0, 0.0);
    CHECK(isinf(tw_paired_ratio(1.0, 0.0)));
    CHECK_NEAR(tw_paired_ratio(0.0, 0.0), 1.0, 0.0);
}

static void test_paired_invalid_and_failures(void)
{
    fake_env env;
    tw_host host;
    fake_runner f[2];
    const uint64_t script[] = {100};
    tw_runner runners[2];
    tw_measure_config cfg = fake_quick_config();
    tw_paired_config pcfg;
    tw_paired p;
    tw_error err;

    fake_env_init(&env);
    host = fake_host(&env);
    fake_runner_init(&f[0], &env, 0, script, 1, 2);
    fake_runner_init(&f[1], &env, 1, script, 1, 2);
    runners[0] = fake_runner_of(&f[0]);
    runners[1] = fake_runner_of(&f[1]);
    tw_paired_config_default(&pcfg);
    pcfg.rounds_min = 7;
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, &pcfg, &p, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "a 99 % interval needs 8 pairs");
    pcfg.rounds_min = 10;
    pcfg.rounds_max = 2000;
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, &pcfg, &p, &err), TW_EINVAL);
    pcfg.rounds_max = 20;
    pcfg.width = 0.0;
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, &pcfg, &p, &err), TW_EINVAL);
    CHECK_INT(tw_measure_paired(&host, NULL, &cfg, NULL, &p, &err), TW_EINVAL);
    CHECK_INT(env.now, 1000); /* nothing ran */
    /* equal constant runners: ratio 1 exactly, a narrow interval holding 1 */
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, NULL, &p, &err), TW_OK);
    CHECK(p.ratio == 1.0 && p.low == 1.0 && p.high == 1.0);
    CHECK_INT(p.rounds, 10);
    CHECK_INT(p.stopped_by, TW_STOP_SPREAD);
    /* the order alternates: A B, B A, ... */
    CHECK(env.log[2] == 0 && env.log[3] == 1 && env.log[6] == 1 && env.log[9] == 0);
    /* a failing callback's code comes back; out of memory frees what it took */
    f[1].fail_at = (long)f[1].calls + 5;
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, NULL, &p, &err), TW_ECALLBACK);
    CHECK_HAS(err.msg, "runner 1 broke");
    env.allocs_left = 1;
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, NULL, &p, &err), TW_ENOMEM);
    env.allocs_left = -1;
    CHECK_INT(env.live, 0);
}

/* A runner whose calls cost `cost` ns and, one call in `every`, stall for
 * `stall` ns (a thread of its pool off the CPU for a slice of the scheduler). */
typedef struct stall_runner {
    fake_env *env;
    uint64_t cost;
    uint64_t stall;
    unsigned every;
    unsigned calls;
} stall_runner;

static tw_code stall_run(void *ctx, size_t sample, tw_error *err)
{
    stall_runner *r = ctx;

    (void)sample;
    (void)err;
    r->calls++;
    r->env->now += r->cost + (r->calls % r->every == 0 ? r->stall : 0);
    return TW_OK;
}

/* Rounds of one pass over the samples leave a stall of one call in 10 between
 * their medians: the median reads the quiet call. Rounds of round_min_ns hold
 * the stalls at their rate, so the median is the calls' mean (the runner is
 * two candidates' worth of time slower than it looked); and paired rounds of
 * such a runner against one that does not stall find the gap. */
static void test_rounds_long_enough_hold_the_stalls(void)
{
    fake_env env;
    tw_host host;
    stall_runner a = {&env, 100000, 5000000, 10, 0};  /* 0.1 ms, 5 ms one call in 10 */
    stall_runner b = {&env, 200000, 0, 1, 0};         /* 0.2 ms, no stall */
    tw_runner runners[2] = {{&a, 2, stall_run, NULL, NULL}, {&b, 2, stall_run, NULL, NULL}};
    tw_measure_config cfg = base_config();
    tw_stats st;
    tw_paired p;

    fake_env_init(&env);
    host = fake_host(&env);
    cfg.rounds_min = cfg.rounds_max = 40;
    CHECK_INT(tw_measure(&host, &runners[0], &cfg, &st, NULL), TW_OK);
    CHECK(st.median_ns < 200000.0); /* the quiet call: 0.1 ms */
    a.calls = 0;
    cfg.round_min_ns = 20000000; /* 20 ms: 40 calls a round, 4 stalls */
    CHECK_INT(tw_measure(&host, &runners[0], &cfg, &st, NULL), TW_OK);
    CHECK(st.median_ns > 550000.0 && st.median_ns < 650000.0); /* the mean: 0.6 ms */
    CHECK_INT((int)a.calls, 40 * 2 * 20);
    /* the paired verdict follows: the runner that never stalls is faster */
    a.calls = 0;
    cfg = fake_quick_config();
    cfg.round_min_ns = 20000000;
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, NULL, &p, NULL), TW_OK);
    CHECK(p.low > 1.0 && p.ratio > 2.5);
    cfg.round_min_ns = 0;
    a.calls = 0;
    CHECK_INT(tw_measure_paired(&host, runners, &cfg, NULL, &p, NULL), TW_OK);
    CHECK(p.ratio < 1.0); /* one pass a round: the stalling runner reads as the faster */
    /* a clock that reads no time ends a round after one pass */
    {
        stall_runner still = {&env, 0, 0, 1, 0};
        tw_runner r = {&still, 3, stall_run, NULL, NULL};

        cfg = base_config();
        cfg.rounds_min = cfg.rounds_max = 5;
        cfg.round_min_ns = 20000000;
        CHECK_INT(tw_measure(&host, &r, &cfg, &st, NULL), TW_OK);
        CHECK_INT((int)still.calls, 5 * 3);
    }
    CHECK_INT(env.live, 0);
}

int main(void)
{
    test_warmup();
    test_spread_rule();
    test_time_cap();
    test_statistics();
    test_sync_order();
    test_invalid();
    test_callback_error();
    test_compare_interleaves();
    test_compare_waits_for_all();
    test_compare_stops_when_decided();
    test_paired_finds_the_faster_under_bursts();
    test_paired_equal_runners_straddle_one();
    test_paired_interval();
    test_paired_invalid_and_failures();
    test_rounds_long_enough_hold_the_stalls();
    return CHECK_SUMMARY("test_measure");
}
