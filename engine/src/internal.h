/*
 * internal.h - helpers shared by the engine's source files. Not installed.
 */
#ifndef TW_INTERNAL_H
#define TW_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "tweak.h"

/* ------------------------------------------------------------------- host */

/* Copies `in` into `out`, filling every NULL member with the default. The
 * allocator is a pair: unless both alloc and release are set, both default,
 * so memory is never released by a function that did not allocate it. */
void tw_host_resolve(const tw_host *in, tw_host *out);

/* These take a resolved host (every member set, log excepted). */
void *tw_host_alloc(const tw_host *host, size_t size);
/* size * count with an overflow check; NULL on overflow or failure. */
void *tw_host_alloc_array(const tw_host *host, size_t count, size_t size);
void tw_host_release(const tw_host *host, void *ptr);
uint64_t tw_host_now(const tw_host *host);
/* Logs a printf-style message when the host has a logger. */
void tw_host_logf(const tw_host *host, int level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* A copy of `s` from the host allocator; NULL on failure. */
char *tw_host_strdup(const tw_host *host, const char *s);

/* Memory that tw_free() can release without a host: the block remembers the
 * host's release function in a header in front of the returned pointer. */
void *tw_free_alloc(const tw_host *host, size_t size);

/* ------------------------------------------------------------- invariants */

/* TW_ASSERT(cond): an invariant of the engine's own code, never a check of its
 * input (bad input is an error code with a message). The debug and sanitizer
 * builds (TW_DEBUG, TW_SANITIZE: TW_CHECK_INVARIANTS) check it: a broken one
 * names its condition, file and line on stderr and stops the process there,
 * so the test that broke it fails at the cause. The release build compiles
 * it out; nothing a user runs stops on one. */
#ifdef TW_CHECK_INVARIANTS
void tw_invariant_failed(const char *cond, const char *file, int line);
#define TW_ASSERT(cond) ((cond) ? (void)0 : tw_invariant_failed(#cond, __FILE__, __LINE__))
#else
#define TW_ASSERT(cond) ((void)0)
#endif

/* ------------------------------------------------------------------ error */

/* Resets a callback's error slot before a call, so that an empty message
 * after a failure can be told apart from the message of an earlier call. */
void tw_error_clear(tw_error *err);

/* Passes a failed callback's code and message on to `err`. When the callback
 * left no message, `what` (e.g. "run of sample 3") makes one. Returns code. */
tw_code tw_error_forward(tw_error *err, tw_code code, const tw_error *cb_err,
                         const char *what);

/* ------------------------------------------------------------------- text */

/* A growing string from the host allocator (released by tw_free). A failed
 * append sets `failed`; later appends do nothing, so callers check once. */
typedef struct tw_buf {
    const tw_host *host;
    char *data;
    size_t len;
    size_t cap;
    int failed;
} tw_buf;

void tw_buf_init(tw_buf *buf, const tw_host *host);
void tw_buf_appendf(tw_buf *buf, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Appends the first line of `s`, at most `width` bytes of it (cut at a space
 * where there is one), with " ..." when anything was left out and control
 * characters as spaces: a callback's long or multi-line message keeps a table
 * row on one line. The whole message stays in the result (tw_row.error). */
void tw_buf_append_line(tw_buf *buf, const char *s, size_t width);
/* Cuts a UTF-8 sequence that a truncation left incomplete at the end of `s`
 * (a message cut to its slot's size may stop inside a character): the text
 * every reader gets is whole characters. */
void tw_utf8_trim(char *s);
/* Gives the string away (NULL when an append failed) and resets buf. */
char *tw_buf_take(tw_buf *buf);
void tw_buf_dispose(tw_buf *buf);

/* ------------------------------------------------------------ measurement */

/* No runner failed: the engine itself failed (bad config, no memory). */
#define TW_NO_RUNNER ((size_t)-1)

/* Checks a measurement config; TW_EINVAL with a message naming the field. */
tw_code tw_measure_config_check(const tw_measure_config *cfg, tw_error *err);

/* The protocol behind tw_measure and tw_measure_compare. On a failure that
 * came from runner i (a callback, or an unusable runner), *failed gets i;
 * otherwise TW_NO_RUNNER. cfg must not be NULL here. */
tw_code tw_measure_runners(const tw_host *host, const tw_runner *runners, size_t n,
                           const tw_measure_config *cfg, tw_stats *out,
                           size_t *failed, tw_error *err);

/* The rank k (1-based) of the order statistics that bound a 99 % interval of
 * the median of n values (the sign test: the largest k with P(X <= k - 1) <=
 * 0.005 for X ~ Binomial(n, 1/2)); 0 when n is too small for one. */
size_t tw_sign_rank(size_t n);

/* tw_measure_paired on a resolved host, with cfg and pcfg given; *failed is
 * the runner whose callback failed, or TW_NO_RUNNER. */
tw_code tw_measure_pairs(const tw_host *host, const tw_runner *runners,
                         const tw_measure_config *cfg, const tw_paired_config *pcfg,
                         tw_paired *out, size_t *failed, tw_error *err);

/* Fills the quantiles, minimum and spread of values[0..n) (n > 0), sorting
 * `values` in place. */
void tw_stats_fill(double *values, size_t n, tw_stats *out);

/* ------------------------------------------------------------------- tree */

/* Whether tw_tree_finish has run. */
int tw_tree_is_finished(const tw_tree *tree);

/* ---------------------------------------------------------- module search */

/* A time budget on the host's clock: ns nanoseconds from start_ns (ns 0: none). */
typedef struct tw_budget {
    uint64_t start_ns;
    uint64_t ns;
} tw_budget;

/* 1 when `budget` (NULL: none) is used up by the host's clock: ns have passed
 * since start_ns. host is resolved. */
int tw_budget_spent(const tw_host *host, const tw_budget *budget);

/* A report as tw_strategy_choose begins it: not tried, no facts (NaNs), flags 0. */
void tw_report_reset(tw_candidate_report *report);

/* tw_tune_module within a tweak's time budget (NULL: none): a candidate
 * flagged TW_CAND_VARIANT is not built once it is used up. */
tw_code tw_tune_module_within(const tw_host *host, const tw_module_ops *ops, size_t node,
                              const char *path, const tw_measure_config *cfg,
                              const tw_budget *budget, tw_module_result **out, tw_error *err);

/* One signature group of a module's search. */
typedef struct tw_group_entry {
    char *text;                   /* never NULL once the group is begun */
    tw_strategy_kind kind;
    size_t n_samples;
    size_t n_candidates;
    char **names;                 /* n_candidates copies; an entry may be NULL */
    tw_candidate_report *reports; /* n_candidates */
    long chosen;
    char *error;                  /* NULL: none */
} tw_group_entry;

struct tw_module_result {
    tw_host host;
    char *path;
    int state;                    /* 1 tuned, -1 failed */
    char *error;                  /* NULL: none */
    size_t group_count;
    tw_group_entry *groups;
};

/* ----------------------------------------------------------------- result */

/* The result is built by the depth search and read through tweak.h. */
typedef struct tw_result_entry {
    tw_row row;               /* row.error points into `error` */
    char error[TW_MSG_SIZE];
} tw_result_entry;

struct tw_result {
    tw_host host;
    tw_result_entry *rows;
    size_t row_count;
    long selected;
    tw_stats baseline;
    int baseline_measured;
    tw_confirmation confirmation;
    double baseline_others;      /* what others took during the untuned model's
                                  * measurements, and the capacity then, in
                                  * CPU-seconds; baseline_capacity 0: unknown */
    double baseline_capacity;
    double side_others;          /* the same during the last side-by-side measurement */
    double side_capacity;
    size_t module_count;
    tw_module_result **modules;  /* per node: its search, NULL when never searched */
    unsigned char *in_cut;       /* row_count * module_count: node in row's cut */
    int dry_run;
    uint64_t time_budget_ns;     /* the tweak's (0: none), for the table's last line */
    uint64_t busy_budget_ns;     /* likewise its busy budget */
    int busy_stopped;            /* the busy budget left a depth untried */
};

/* A speedup's figure from an untuned and a tuned measurement: the median
 * ratio and its interval (untuned q25 / tuned q75 to untuned q75 / tuned q25),
 * 0 where the tuned figure is 0. */
void tw_speedup_of(const tw_stats *untuned, const tw_stats *tuned, double *speedup,
                   double *low, double *high);
/* Whether a side-by-side measurement (untuned, tuned) agrees with the search's
 * figures for the same configurations (its untuned baseline, the depth's row):
 * each latency with its own (tw_stats_agree), and the speedup they give as a
 * latency, within the four spreads. */
int tw_side_agrees(const tw_stats *untuned, const tw_stats *tuned, const tw_stats *baseline,
                   const tw_stats *row);
/* Derives what a confirmation's measurements give, given the search's untuned
 * baseline and the confirmed depth's row: on a busy machine (quality
 * TW_QUALITY_BUSY, its figure the paired rounds') the search's figure and the
 * verdict; otherwise, from its last side-by-side measurement (tuned, untuned,
 * tries), whether it agreed with the search's (tw_side_agrees), its quality,
 * the figure reported (the smaller of the two when they disagree) and the
 * verdict. The one rule tw_tweak_run and tw_result_restore share. */
void tw_confirmation_derive(tw_confirmation *c, const tw_stats *baseline, const tw_stats *row);

/* A result with `rows` empty rows and `modules` unsearched modules. */
tw_result *tw_result_create(const tw_host *host, size_t rows, size_t modules);
/* Sets the error text of a row (truncated to TW_MSG_SIZE). */
void tw_result_set_row_error(tw_result *result, size_t i, const char *msg);

#endif /* TW_INTERNAL_H */
