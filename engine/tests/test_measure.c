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
    return CHECK_SUMMARY("test_measure");
}
