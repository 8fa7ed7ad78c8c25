/*
 * fake.h - a fake host for the engine tests: a clock that only moves when a
 * fake runner runs, and an allocator that counts blocks and can fail.
 */
#ifndef TW_FAKE_H
#define TW_FAKE_H

#include <stdio.h>
#include <stdlib.h>

#include "tweak.h"

#define FAKE_LOG_CAP 4096

typedef struct fake_env {
    uint64_t now;        /* the fake clock, in ns */
    long allocs_left;    /* allocations that still succeed; < 0: no limit */
    long live;           /* blocks allocated and not yet released */
    int log[FAKE_LOG_CAP]; /* the id of every runner call, in order */
    size_t log_len;
} fake_env;

static inline uint64_t fake_now(void *ctx)
{
    return ((fake_env *)ctx)->now;
}

static inline void *fake_alloc(void *ctx, size_t size)
{
    fake_env *env = ctx;
    void *ptr = NULL;

    if (env->allocs_left == 0) {
        return NULL;
    }
    ptr = malloc(size == 0 ? 1 : size);
    if (ptr != NULL) {
        env->live++;
        if (env->allocs_left > 0) {
            env->allocs_left--;
        }
    }
    return ptr;
}

static inline void fake_release(void *ctx, void *ptr)
{
    fake_env *env = ctx;

    if (ptr != NULL) {
        env->live--;
        free(ptr);
    }
}

static inline void fake_env_init(fake_env *env)
{
    env->now = 1000;
    env->allocs_left = -1;
    env->live = 0;
    env->log_len = 0;
}

static inline tw_host fake_host(fake_env *env)
{
    tw_host host = {env, fake_now, fake_alloc, fake_release, NULL};
    return host;
}

/* A runner whose call i of round r advances the clock by script[r] ns (the
 * last value repeats), and whose call number fail_at fails with fail_code. */
typedef struct fake_runner {
    fake_env *env;
    int id;
    const uint64_t *script;
    size_t script_len;
    size_t n_samples;
    size_t calls;
    long fail_at;
    tw_code fail_code;
} fake_runner;

static inline tw_code fake_run(void *ctx, size_t sample, tw_error *err)
{
    fake_runner *r = ctx;
    size_t round = r->calls / r->n_samples;

    (void)sample;
    if (r->fail_at >= 0 && (size_t)r->fail_at == r->calls) {
        r->calls++;
        return tw_error_set(err, r->fail_code, "runner %d broke at call %zu", r->id,
                            r->calls - 1);
    }
    if (round >= r->script_len) {
        round = r->script_len - 1;
    }
    r->env->now += r->script[round];
    if (r->env->log_len < FAKE_LOG_CAP) {
        r->env->log[r->env->log_len++] = r->id;
    }
    r->calls++;
    return TW_OK;
}

static inline void fake_runner_init(fake_runner *r, fake_env *env, int id,
                                    const uint64_t *script, size_t script_len,
                                    size_t n_samples)
{
    r->env = env;
    r->id = id;
    r->script = script;
    r->script_len = script_len;
    r->n_samples = n_samples;
    r->calls = 0;
    r->fail_at = -1;
    r->fail_code = TW_ECALLBACK;
}

static inline tw_runner fake_runner_of(fake_runner *r)
{
    tw_runner runner = {r, r->n_samples, fake_run, NULL, NULL};
    return runner;
}

/* A measurement that stops fast on a quiet fake runner. */
static inline tw_measure_config fake_quick_config(void)
{
    tw_measure_config cfg;

    tw_measure_config_default(&cfg);
    cfg.warmup_min = 0;
    cfg.warmup_max = 0;
    cfg.rounds_min = 3;
    cfg.rounds_max = 3;
    cfg.time_cap_ns = 0;
    return cfg;
}

#endif /* TW_FAKE_H */
