/*
 * tweak.h - the torch-tweak tuning engine (pure C11, no Python, no torch).
 *
 * The engine sees a model as a tree of called modules named by dotted paths,
 * and backends and models as callbacks. It owns every decision of a tweak:
 * the cuts per depth, each module's search (its signature groups and
 * candidates), the measurement protocol and its statistics, the
 * strategies' decision rules, the depth search and the result table.
 *
 * Conventions
 * - Every name carries the prefix tw_ (TW_ for macros and enum values).
 * - Objects are opaque and come in create/destroy pairs; destroy(NULL) is a
 *   no-op. Strings returned by tw_*_format are freed with tw_free().
 * - Calls return a tw_code (TW_OK == 0). When `err` is not NULL it receives
 *   the code and a message; `err` may always be NULL. The engine never aborts.
 * - Nothing here is thread-safe unless it says so: one object, one thread.
 * - Callbacks return a tw_code too. TW_EINTERRUPT from any callback stops the
 *   whole operation at once (Ctrl-C, out of memory): the engine cleans up
 *   (the tweak calls `leave` if it had called `enter`) and returns
 *   TW_EINTERRUPT. Any other non-zero code is a failure of that one step.
 */
#ifndef TWEAK_H
#define TWEAK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ status */

typedef enum tw_code {
    TW_OK = 0,
    TW_EINVAL = 1,      /* a bad argument: the message names it */
    TW_ENOMEM = 2,      /* an allocation failed */
    TW_ECALLBACK = 3,   /* a callback failed; the message is the callback's */
    TW_EINTERRUPT = 4,  /* a callback asked to stop everything */
    TW_EBUDGET = 5,     /* the time budget is used up */
    TW_ESTATE = 6       /* a call out of order (e.g. a tree not finished) */
} tw_code;

#define TW_MSG_SIZE 512

typedef struct tw_error {
    tw_code code;
    char msg[TW_MSG_SIZE]; /* NUL-terminated, never NULL */
} tw_error;

/* Sets err (when not NULL) to code and a printf-style message; returns code. */
tw_code tw_error_set(tw_error *err, tw_code code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* A static name of a code: "ok", "invalid argument"... */
const char *tw_code_name(tw_code code);

/* Frees a string returned by a tw_*_format call. NULL is a no-op. */
void tw_free(void *ptr);

/* -------------------------------------------------------------------- host */

/* What the engine needs from its host. A NULL host, or NULL members, take the
 * defaults: a monotonic clock, malloc/free, and no logging. Tests inject a fake
 * clock here so that every decision is deterministic. alloc and release are a
 * pair: unless both are set, both take the defaults. A string from a
 * tw_*_format call remembers its host's release, so tw_free needs no host. */
typedef struct tw_host {
    void *ctx;
    uint64_t (*now_ns)(void *ctx);              /* monotonic nanoseconds */
    void *(*alloc)(void *ctx, size_t size);     /* NULL on failure */
    void (*release)(void *ctx, void *ptr);
    void (*log)(void *ctx, int level, const char *msg); /* level: 0 info, 1 warn */
} tw_host;

/* -------------------------------------------------------------------- tree */

/* The tree of called modules. Paths are dotted ("", "layers.0", "layers.0.mlp");
 * the root is "". A node's parent is its nearest called ancestor by path
 * prefix, so containers that are never called (ModuleList) add no level.
 * Depth of the root is 0; every other node is one deeper than its parent. */
typedef struct tw_tree tw_tree;

/* host: may be NULL (defaults). Returns NULL on allocation failure. */
tw_tree *tw_tree_create(const tw_host *host, tw_error *err);
void tw_tree_destroy(tw_tree *tree);

/* Adds a called module. calls: how many times the dataset called it;
 * time_ns: the total time spent inside it (0 when unknown). Paths must be
 * unique; the root "" must be added (in any order). Returns the node's index
 * (0, 1, 2... in the order of adding) in *index (may be NULL).
 * TW_EINVAL on a NULL or duplicate path, or one with an empty name ("a..b",
 * ".a", "a."), TW_ESTATE after tw_tree_finish. */
tw_code tw_tree_add(tw_tree *tree, const char *path, uint64_t calls,
                    uint64_t time_ns, size_t *index, tw_error *err);

/* Links every node to its parent and computes depths. TW_EINVAL when the
 * root "" is missing. Must be called once, before any query below. */
tw_code tw_tree_finish(tw_tree *tree, tw_error *err);

size_t tw_tree_size(const tw_tree *tree);
/* Deepest depth of any node; -1 before finish. */
int tw_tree_max_depth(const tw_tree *tree);
/* Node queries; an out-of-range index gives NULL / -1 / 0. */
const char *tw_tree_path(const tw_tree *tree, size_t index);
int tw_tree_depth(const tw_tree *tree, size_t index);
long tw_tree_parent(const tw_tree *tree, size_t index); /* -1 for the root */
size_t tw_tree_child_count(const tw_tree *tree, size_t index);
uint64_t tw_tree_calls(const tw_tree *tree, size_t index);
uint64_t tw_tree_time_ns(const tw_tree *tree, size_t index);
/* Index of the node with this path, or -1. */
long tw_tree_find(const tw_tree *tree, const char *path);

/* The cut at `depth`: the nodes at that depth, plus every node shallower than
 * it that has no children, so every leaf lies inside the cut. Indices are
 * written in tree order (the order of adding) to out[0..cap); *count gets the
 * full size of the cut even when it exceeds cap. depth < 0 is TW_EINVAL. */
tw_code tw_tree_cut(const tw_tree *tree, int depth, size_t *out, size_t cap,
                    size_t *count, tw_error *err);

/* The distinct cuts between min_depth and max_depth (inclusive; max_depth < 0
 * means the deepest): a depth whose cut is empty or equal to the cut of a
 * shallower depth in the range is left out. The depths are written in
 * increasing order to out[0..cap); *count gets how many there are.
 * TW_EINVAL when min_depth < 0 or max_depth >= 0 and min_depth > max_depth. */
tw_code tw_tree_distinct_depths(const tw_tree *tree, int min_depth, int max_depth,
                                int *out, size_t cap, size_t *count, tw_error *err);

/* A text view of the tree: one line per node, indented by depth, with calls
 * and time. Free with tw_free(). NULL on allocation failure. */
char *tw_tree_format(const tw_tree *tree, tw_error *err);

/* ------------------------------------------------------------- measurement */

/* How to run something that is measured. run(ctx, i) makes call i of the
 * dataset (0 <= i < n_samples); sync(ctx) waits for the device (NULL: nothing
 * to wait for); round(ctx), when not NULL, is called before every round, warm-up
 * included, outside the timed calls (it puts the model in the state this runner
 * measures). The clock comes from the host. */
typedef struct tw_runner {
    void *ctx;
    size_t n_samples;
    tw_code (*run)(void *ctx, size_t sample, tw_error *err);
    tw_code (*sync)(void *ctx, tw_error *err);
    tw_code (*round)(void *ctx, tw_error *err);
} tw_runner;

/* The measurement protocol. One call is timed as: sync, clock, run, sync,
 * clock, so a call's latency is what a user waits for. A round is one call
 * of every sample; its value is the mean latency per call in that round.
 * 1. Warm-up: rounds are run until the round value stops falling: it stops
 *    when `warmup_patience` rounds in a row were not faster than
 *    (1 - warmup_gain) times the best round so far, after at least
 *    warmup_min and at most warmup_max rounds.
 * 2. Measurement: at least rounds_min rounds, then it stops as soon as the
 *    relative spread of the round values, (q75 - q25) / median, is at most
 *    rel_spread, or after rounds_max rounds.
 *    With stop_when_decided (the default), a comparison of two or more
 *    runners (tw_measure_compare) also stops, after rounds_min, as soon as one
 *    runner is clearly the fastest: its q75 is below every other runner's q25.
 *    In a comparison, each measured round of a runner is opened by `settle`
 *    untimed calls (sample 0, the device waited for): what the runner before
 *    it left running (a thread pool still spinning on a small CPU) slows its
 *    first calls, and would fall on whichever runner comes next.
 *    A round with round_min_ns goes over its samples again until its timed
 *    calls took that long together (at most TW_ROUND_PASSES_MAX passes, and
 *    no further once a pass read no time): on a busy machine a call is now and
 *    then held for a whole slice of the scheduler (a thread of its pool off
 *    the CPU), and a round long enough holds those stalls at their rate, so
 *    that the median of rounds is what the calls take on average.
 * 3. The statistic is the median of the measured rounds.
 * time_cap_ns bounds warm-up plus measurement (0: no cap); the cap is checked
 * between rounds, so at least one measured round is always taken.
 * A median of 0 (a clock too coarse to see a call) has spread 0 when every
 * round read the same, else an infinite spread. */
typedef struct tw_measure_config {
    uint32_t warmup_min;
    uint32_t warmup_max;
    uint32_t warmup_patience;
    double warmup_gain;
    uint32_t rounds_min;
    uint32_t rounds_max;
    double rel_spread;
    uint64_t time_cap_ns;
    uint32_t stop_when_decided; /* 0: a comparison runs until the spread rule or the caps */
    uint32_t settle;            /* untimed calls opening each compared runner's round */
    uint64_t round_min_ns;      /* 0: a round is each sample once; else the samples again
                                 * until the round's timed calls took this long */
} tw_measure_config;

/* The most untimed calls a round may open with (the time cap is checked
 * between rounds only). */
#define TW_SETTLE_MAX 100u

/* The longest round_min_ns (1 s: the time cap is checked between rounds only),
 * and the most passes over the samples one round makes. */
#define TW_ROUND_MIN_MAX_NS 1000000000ull
#define TW_ROUND_PASSES_MAX 10000u

/* Fills *cfg with the documented defaults:
 * warmup 2..20 rounds, patience 2, gain 0.02; rounds 5..50, rel_spread 0.05,
 * time cap 5 s, stop_when_decided 1, settle 1, round_min_ns 0. */
void tw_measure_config_default(tw_measure_config *cfg);

typedef enum tw_stop {
    TW_STOP_SPREAD = 0,    /* the spread fell below rel_spread */
    TW_STOP_ROUNDS = 1,    /* rounds_max was reached */
    TW_STOP_TIME = 2,      /* time_cap_ns was used up */
    TW_STOP_DECIDED = 3    /* a comparison's fastest runner was clear (stop_when_decided) */
} tw_stop;

typedef struct tw_stats {
    double median_ns;     /* the statistic: median of round values */
    double q25_ns, q75_ns;
    double min_ns;
    double spread;        /* (q75 - q25) / median */
    uint32_t warmup_rounds;
    uint32_t rounds;
    tw_stop stopped_by;
} tw_stats;

/* Measures one runner. cfg NULL: the defaults. TW_EINVAL for n_samples == 0
 * or run == NULL or an invalid cfg (rounds_min == 0, rounds_min > rounds_max,
 * warmup_min > warmup_max, negative or NaN fractions). A failing callback's
 * code and message are returned as they are. */
tw_code tw_measure(const tw_host *host, const tw_runner *runner,
                   const tw_measure_config *cfg, tw_stats *out, tw_error *err);

/* Measures n runners side by side: each is warmed up on its own, then the
 * measured rounds are interleaved (A, B, C, A, B, C...) so clock drift falls
 * on all alike. It stops when every runner's spread is at most rel_spread
 * (after rounds_min), when the fastest is clear (stop_when_decided, n >= 2)
 * or after rounds_max; the time cap is n * time_cap_ns,
 * counted from the call's start, and each runner's warm-up alone is bounded
 * by time_cap_ns so that the first cannot use up the others' share.
 * out[0..n) receives each runner's statistics. n == 0 is TW_EINVAL. */
tw_code tw_measure_compare(const tw_host *host, const tw_runner *runners, size_t n,
                           const tw_measure_config *cfg, tw_stats *out, tw_error *err);

/* ----------------------------------------------------------- paired rounds */

/* Measuring under interference, as pyperf and Google Benchmark do on a shared
 * machine: other processes take the CPUs in bursts, so two runners measured at
 * different moments are not comparable, and their medians' quartiles widen
 * with every burst. Paired rounds run the two runners' rounds side by side,
 * one pair after another, the order alternating (A B, B A, A B...), each round
 * opened by cfg->settle untimed calls; a pair's ratio, runner 0's round over
 * runner 1's (above 1: runner 1 is faster), sees the load both rounds saw
 * alike. The statistic is the median of the ratios, and its interval the
 * distribution-free 99 % interval of that median (the sign test: order
 * statistics k and n + 1 - k of n ratios), robust to bursts: a burst spoils
 * the pairs it falls on, not the median. After rounds_min pairs it stops as
 * soon as the interval lies wholly above or below 1 (TW_STOP_DECIDED), or is
 * narrow (high <= low * (1 + width): TW_STOP_SPREAD, within noise when it
 * holds 1); while it is wide, more pairs, up to rounds_max (TW_STOP_ROUNDS) or
 * the time cap (TW_STOP_TIME, counted from the call's start and checked
 * between pairs, after rounds_min pairs: rounds_min pairs are always taken).
 * Each runner is warmed up first as tw_measure does (cfg's warm-up and its
 * time cap). */
#define TW_PAIRED_ROUNDS_MIN 8u    /* 2^-8 < 0.005: the fewest pairs with a 99 % interval */
#define TW_PAIRED_ROUNDS_MAX 1000u

typedef struct tw_paired_config {
    uint32_t rounds_min;   /* TW_PAIRED_ROUNDS_MIN.. */
    uint32_t rounds_max;   /* rounds_min..TW_PAIRED_ROUNDS_MAX */
    double width;          /* > 0: an interval this narrow is decided (0.1: 10 %) */
    uint64_t time_cap_ns;  /* 0: none */
} tw_paired_config;

/* Defaults: rounds 10..400, width 0.1, no time cap. */
void tw_paired_config_default(tw_paired_config *cfg);

/* TW_EINVAL, with the message a user reads, for rounds or a width outside
 * their ranges. */
tw_code tw_paired_config_check(const tw_paired_config *cfg, tw_error *err);

typedef struct tw_paired {
    double ratio;        /* median of runner 0's round / runner 1's round */
    double low, high;    /* its 99 % interval (sign test) */
    uint32_t rounds;     /* pairs measured */
    uint32_t wins;       /* pairs in which runner 1's round was the faster */
    tw_stats stats[2];   /* each runner's rounds, as tw_measure gives them */
    tw_stop stopped_by;
} tw_paired;

/* Measures runners[0] and runners[1] in paired rounds (see above). cfg NULL,
 * pcfg NULL: the defaults. TW_EINVAL for an invalid config, a NULL pointer, a
 * runner without run or samples; a failing callback's code and message are
 * returned as they are. */
tw_code tw_measure_paired(const tw_host *host, const tw_runner *runners,
                          const tw_measure_config *cfg, const tw_paired_config *pcfg,
                          tw_paired *out, tw_error *err);

/* A pair's ratio: first / second; infinite when only second is 0, 1 when both are. */
double tw_paired_ratio(double first, double second);

/* Fills out->ratio, low and high from n >= 1 ratios (sorted in place): the
 * median and its 99 % sign-test interval (0 and infinity when n < 8). */
void tw_paired_fill(double *ratios, size_t n, tw_paired *out);

/* -------------------------------------------------------------- strategies */

typedef enum tw_strategy_kind {
    TW_STRATEGY_FIRST_WINS = 0,         /* first candidate that builds and passes */
    TW_STRATEGY_HIGHEST_THROUGHPUT = 1, /* build all, measure those that pass, fastest wins */
    TW_STRATEGY_ONE_BACKEND = 2         /* exactly one candidate; it wins if it builds */
} tw_strategy_kind;

/* One backend for one module. build(ctx, err) builds it and checks it against
 * the original (non-zero: rejected, err says why). runner measures it. */
typedef struct tw_candidate {
    const char *name;
    void *ctx;
    tw_code (*build)(void *ctx, tw_error *err);
    tw_runner runner;
} tw_candidate;

typedef enum tw_candidate_state {
    TW_CAND_NOT_TRIED = 0, /* a strategy never got to it */
    TW_CAND_FAILED = 1,    /* build or check failed: see msg */
    TW_CAND_BUILT = 2,     /* built and passed, not measured */
    TW_CAND_MEASURED = 3   /* built, passed and measured: see stats */
} tw_candidate_state;

/* Why a candidate failed its build, as a code: the host names it (see
 * tw_build_facts), except TW_REASON_BUDGET, which is the engine's own. */
typedef enum tw_reason {
    TW_REASON_NONE = 0,           /* built, not tried, or failed while measured */
    TW_REASON_BUILD_FAILED = 1,   /* the build failed (a failed build the host gave
                                   * no reason for reads as this) */
    TW_REASON_UNAVAILABLE = 2,    /* the backend cannot run here (a package missing) */
    TW_REASON_CRASHED = 3,        /* the build crashed its process */
    TW_REASON_MISMATCH = 4,       /* it built, and failed the correctness check */
    TW_REASON_DYNAMIC_SHAPES = 5, /* it refused the group's varying sizes */
    TW_REASON_OUT_OF_MEMORY = 6,  /* the device ran out of memory */
    TW_REASON_BUDGET = 7          /* a variant not built: the time budget was used
                                   * up before its turn (a tweak's module search) */
} tw_reason;

/* The most tw_reason values there are (TW_REASON_BUDGET + 1). */
#define TW_REASON_COUNT 8

/* "", "build failed", "unavailable", "crashed", "mismatch", "dynamic shapes",
 * "out of memory", "time budget"; NULL when out of range. */
const char *tw_reason_name(tw_reason reason);

/* What the host knows of one build, written by its build callback (a module
 * search's, tw_module_ops.build) into a struct the engine set to: reason
 * TW_REASON_NONE, max_error, tolerance and own_error NaN. max_error: the
 * correctness check's error (of a build that passed, or failed it), the one
 * that used most of its bound; tolerance: the bound it was held to; own_error:
 * under a measured rule, the original's own error by the same measure (the
 * bound's base: max_error / own_error is the candidate's error as a multiple
 * of the original's). NaN: not known, or a fixed tolerance. */
typedef struct tw_build_facts {
    tw_reason reason;
    double max_error;
    double tolerance;
    double own_error;
} tw_build_facts;

/* A candidate's flags (tw_group_info.flags, tw_candidate_report.flags). */
#define TW_CAND_VARIANT 1u          /* a variant the tweak's settings added (more
                                     * effort, lower precision): not built once the
                                     * tweak's time budget is used up */
#define TW_CAND_LOWERS_PRECISION 2u /* its numerics are lower than the original's:
                                     * kept for the report, decides nothing */

typedef struct tw_candidate_report {
    tw_candidate_state state;
    tw_stats stats;        /* valid when state == TW_CAND_MEASURED */
    char msg[TW_MSG_SIZE]; /* the failure when state == TW_CAND_FAILED */
    tw_build_facts facts;  /* the build's facts (reason TW_REASON_NONE and NaNs
                            * when not tried; a failed build always has a reason) */
    uint64_t build_ns;     /* how long its build took by the host's clock; 0 when
                            * not tried or not built for the budget */
    unsigned flags;        /* TW_CAND_* (a module search's; 0 in tw_strategy_choose) */
} tw_candidate_report;

/* Applies a strategy's rule to candidates[0..n). reports[0..n) (not NULL)
 * receives what happened to each. *chosen gets the index of the winner or -1
 * when none built (that is TW_OK: the module keeps its original forward).
 * HIGHEST_THROUGHPUT measures every built candidate with tw_measure_compare
 * and picks the lowest median; equal medians keep the earlier candidate.
 * ONE_BACKEND with n != 1 is TW_EINVAL; any kind with n == 0 is TW_EINVAL.
 * A measurement failure of one candidate marks it FAILED and the others are
 * measured again without it. Every build is timed by the host's clock
 * (build_ns); a failed build's reason is TW_REASON_BUILD_FAILED here (only a
 * module search's host says more, see tw_build_facts). TW_EINTERRUPT from a
 * callback is returned. */
tw_code tw_strategy_choose(const tw_host *host, tw_strategy_kind kind,
                           const tw_candidate *candidates, size_t n,
                           const tw_measure_config *cfg, long *chosen,
                           tw_candidate_report *reports, tw_error *err);

/* "first-wins", "highest-throughput", "one-backend"; NULL when out of range. */
const char *tw_strategy_name(tw_strategy_kind kind);

/* "not tried", "failed", "built", "measured"; "unknown" when out of range. */
const char *tw_candidate_state_name(tw_candidate_state state);

/* Why a candidate of a group that chose `chosen` (-1: none) won or lost, as a
 * static word: "chosen", "slower" (measured, a faster one won), "failed" (see
 * its message), "not tried" (the rule stopped before it: first-wins found an
 * earlier one, or the search was stopped), "built" (built, never measured). */
const char *tw_candidate_verdict(const tw_candidate_report *report, int chosen);

/* ----------------------------------------------------------- module search */

/* One module's search: for each of its signature groups (the calls of one
 * input signature), the group's candidates are built, checked, measured and
 * chosen from by the group's strategy (tw_strategy_choose). The host describes
 * the module and runs what the engine asks, through these callbacks; `node`
 * is the caller's number for the module (a tree index in a tweak), passed back
 * unchanged. Every callback may fail: TW_EINTERRUPT stops the search at once;
 * any other code is a failure of that one step (see each).
 *
 * groups(node, *count): how many signature groups the module has. 0: it was
 *   never called, and it fails ("the dataset never called ..."). Failing: the
 *   module fails with its message, and no other callback is called.
 * group(node, g, *info): begins group g (0 <= g < count, in order) and says
 *   what it holds (tw_group_info, zeroed before the call). Failing, or an
 *   info the strategy refuses (no candidates, one-backend with several): that
 *   group fails with the message, and the search goes on with the next one.
 * build(node, g, c, facts): builds candidate c of group g and checks it against
 *   the original (non-zero: rejected, err says why), and says what it knows of
 *   the build in *facts (see tw_build_facts; left as it is: nothing known). The
 *   engine times it with the host's clock (tw_candidate_report.build_ns). In a
 *   tweak with a time budget, a candidate flagged TW_CAND_VARIANT is not built
 *   once the budget is used up: it fails with reason TW_REASON_BUDGET and build
 *   is not called (see tw_tweak_run); tw_tune_module has no budget.
 * run(node, g, c, sample): makes call `sample` (0 <= sample < n_samples) of
 *   the group with built candidate c; what is measured.
 * sync(): waits for the device (NULL: nothing to wait for).
 * commit(node, g, chosen): ends group g with the index of the candidate its
 *   strategy chose, or -1 for none: the host installs it (or keeps the original
 *   forward). It follows every group() call, also one that failed, and also
 *   when the search stops (then with -1), so a host can release what group()
 *   took. Failing: the group counts as failed with its message (the host must
 *   not keep what it was installing).
 * The measurement uses cfg (NULL: the defaults). */
typedef struct tw_group_info {
    const char *text;         /* how the group reads in messages (its input
                               * signature); NULL: "" */
    tw_strategy_kind kind;    /* the strategy that chooses among its candidates */
    size_t n_candidates;
    const char *const *names; /* n_candidates names, NULL only when n_candidates
                               * is 0; a NULL name reads "(unnamed)" */
    size_t n_samples;         /* recorded calls, each measured run makes them all */
    const unsigned *flags;    /* n_candidates TW_CAND_* flags; NULL: all 0 */
} tw_group_info;              /* the strings and flags are copied before the next callback */

typedef struct tw_module_ops {
    void *ctx;
    tw_code (*groups)(void *ctx, size_t node, size_t *count, tw_error *err);
    tw_code (*group)(void *ctx, size_t node, size_t group, tw_group_info *info,
                     tw_error *err);
    tw_code (*build)(void *ctx, size_t node, size_t group, size_t candidate,
                     tw_build_facts *facts, tw_error *err);
    tw_code (*run)(void *ctx, size_t node, size_t group, size_t candidate, size_t sample,
                   tw_error *err);
    tw_code (*sync)(void *ctx, tw_error *err);
    tw_code (*commit)(void *ctx, size_t node, size_t group, long chosen, tw_error *err);
} tw_module_ops;

/* What one module's search found: per group, per candidate. Read-only. */
typedef struct tw_module_result tw_module_result;

/* Searches one module (see tw_module_ops). path names it in messages ("" or
 * NULL: "(root)"). On TW_OK, *out owns a new result (tw_module_result_destroy),
 * tuned or failed: the module failed when no group chose a candidate. An
 * interrupt (TW_EINTERRUPT) or running out of memory (TW_ENOMEM) stops the
 * search, the group in progress is committed with -1, and *out is NULL.
 * TW_EINVAL (nothing called) when ops, a callback other than sync, or out is
 * NULL, or cfg is invalid. Not thread-safe; the callbacks run on the caller's
 * thread. */
tw_code tw_tune_module(const tw_host *host, const tw_module_ops *ops, size_t node,
                       const char *path, const tw_measure_config *cfg,
                       tw_module_result **out, tw_error *err);

/* NULL is a no-op. */
void tw_module_result_destroy(tw_module_result *module);

/* 1: at least one group chose a candidate; -1: none did. 0 for NULL. */
int tw_module_result_state(const tw_module_result *module);

/* Why the module failed, "" when it did not: every failed group's error,
 * joined by "; ", each after its text when there are several groups. Owned
 * by the result; "" for NULL. */
const char *tw_module_result_error(const tw_module_result *module);

/* The name the module was searched under (path), owned by the result. */
const char *tw_module_result_path(const tw_module_result *module);

size_t tw_module_result_group_count(const tw_module_result *module);

/* One group, as the search left it. Strings are owned by the result. */
typedef struct tw_group_report {
    const char *text;
    tw_strategy_kind kind;
    size_t n_samples;
    size_t n_candidates;
    long chosen;          /* the winner, or -1 */
    const char *error;    /* "" when a candidate was chosen, else why not:
                           * "no backend passed (name: error or state; ...)", or
                           * the message of the step that failed */
} tw_group_report;

/* Copies group g into *out; TW_EINVAL when module or out is NULL or g is out
 * of range. */
tw_code tw_module_result_group(const tw_module_result *module, size_t g,
                               tw_group_report *out, tw_error *err);

/* Candidate c of group g: *name (owned by the result; may be NULL) and a copy
 * of what happened to it in *report (may be NULL). TW_EINVAL when module is
 * NULL or g or c is out of range. */
tw_code tw_module_result_candidate(const tw_module_result *module, size_t g, size_t c,
                                   const char **name, tw_candidate_report *report,
                                   tw_error *err);

/* ------------------------------------------------------------ depth search */

/* What the tweak asks of its host, for one cut at a time:
 * enter(nodes, tune, n): wrap the modules of the cut (tree indices nodes[0..n))
 *   so that they run their original forward, and record samples for every
 *   node with tune[i] != 0 (by running the dataset once).
 * modules: the module search's callbacks (tw_module_ops), which the engine
 *   runs (tw_tune_module, with cfg->measure) for every node of the entered cut
 *   with tune[i] != 0, node being its tree index: each module is searched once
 *   over the whole tweak, at the first cut that holds it, and reused after. A
 *   module that fails keeps its original forward.
 * activate(): switch the entered cut's tuned modules to their backends.
 * deactivate(): switch them back to their original forward, still wrapped
 *   (may be NULL: the kept depth is then not confirmed, see tw_tweak_run).
 * leave(): unwrap the entered cut, leaving the model as it was.
 * model: runs the whole model on the dataset (used for every measurement).
 * On TW_EINTERRUPT from any callback the engine calls leave() (if a cut is
 * entered) and returns TW_EINTERRUPT at once.
 * leave() follows every enter(), even one that failed, so the host can undo a
 * partial wrap. enter() or activate() failing skips that depth with its error.
 * leave() failing ends the tweak with its code: the engine cannot know what
 * state the model is in. */
/* The machine's load as the host reads it, to tell a busy machine (see
 * TW_BUSY_SHARE): two running totals of CPU-seconds, which the engine takes
 * the difference of over a measurement window.
 * others: CPU time taken by processes other than the tuning one and its
 * descendants (its threads, compile workers and isolated children are its own
 * work, not the machine's load); capacity: the CPU time the machine's cores
 * could give (cores x wall time). known: 0 when the host cannot tell (no
 * /proc/stat): then nothing depends on it. */
typedef struct tw_load {
    int known;
    double others;
    double capacity;
} tw_load;

typedef struct tw_tweak_ops {
    void *ctx;
    tw_code (*enter)(void *ctx, const size_t *nodes, const int *tune, size_t n,
                     tw_error *err);
    tw_module_ops modules;
    tw_code (*activate)(void *ctx, tw_error *err);
    tw_code (*deactivate)(void *ctx, tw_error *err);
    tw_code (*leave)(void *ctx, tw_error *err);
    tw_runner model;
    /* may be NULL: the load is unknown. Read before and after each measurement
     * of the untuned model and each side-by-side measurement. TW_EINTERRUPT
     * stops the tweak; any other failure counts as unknown. */
    tw_code (*load)(void *ctx, tw_load *out, tw_error *err);
} tw_tweak_ops;

typedef struct tw_tweak_config {
    int min_depth;           /* >= 0 */
    int max_depth;           /* < 0: the deepest */
    double tie_tolerance;    /* >= 0, a fraction: 0.02 is 2 % */
    uint64_t time_budget_ns; /* 0: no budget */
    uint64_t busy_budget_ns; /* once the machine is found busy, the search's bound
                              * (TW_BUSY_BUDGET_NS; 0: none, only time_budget_ns) */
    uint64_t busy_round_ns;  /* once the machine is found busy, every round lasts at least
                              * this long (TW_BUSY_ROUND_NS; measure.round_min_ns) */
    int dry_run;             /* non-zero: build and measure nothing */
    tw_measure_config measure;
} tw_tweak_config;

/* The default busy budget: 120 s. */
#define TW_BUSY_BUDGET_NS 120000000000ull

/* The shortest round once the machine is found busy: 20 ms, a few slices of the
 * scheduler, so that each round holds the stalls the load puts on a call (a
 * thread of its pool off the CPU) at their rate. Beside two busy loops and a
 * third job on two cores, eager torch's median call of the README's quick
 * start read 0.4 ms in rounds of one pass (the stalls fell between rounds)
 * against 3.6 to 4.2 ms in rounds of 25 passes, its mean. */
#define TW_BUSY_ROUND_NS 20000000ull

/* The paired rounds a busy machine's budget keeps time for (see tw_tweak_run):
 * the sign test's 99 % interval of 100 pairs lies above 1 when fewer than 37
 * of them are spoilt by the load's bursts (the depth measured slower in them):
 * for a depth that loses a quarter of its pairs, 995 times in 1000 (10 pairs
 * decide it 56 times in 1000: all 10 must be won). The time is estimated
 * from the untuned model's busy latency (the upper quartile of its rounds):
 * each pair is two rounds of every sample and the settle calls, and each
 * runner's warm-up at most warmup_max rounds. At most half the budget in force
 * is kept so. */
#define TW_BUSY_PAIRS 100u

/* Defaults: min_depth 0, max_depth 1 (the model and its children: deeper cuts
 * won on no benchmarked model and cost much tuning time), tie_tolerance 0.02, no budget, a busy
 * budget of TW_BUSY_BUDGET_NS, not a dry run, the default measurement. */
void tw_tweak_config_default(tw_tweak_config *cfg);

/* The rules a tweak config keeps, the one place they are written: TW_EINVAL,
 * with the message a user reads, for cfg NULL, min_depth < 0 ("min_depth must
 * be an int >= 0, got -1"), max_depth >= 0 below min_depth ("min_depth (3) is
 * greater than max_depth (1): lower min_depth or raise max_depth"), a
 * tie_tolerance that is negative or not finite ("tie_tolerance must be a
 * fraction >= 0 (0.02 is 2 %), got -0.1"), or, unless dry_run, an invalid
 * measurement config. tw_tweak_run checks it first. */
tw_code tw_tweak_config_check(const tw_tweak_config *cfg, tw_error *err);

typedef struct tw_result tw_result;

/* The depth search. For every distinct cut from min_depth to max_depth:
 *   - when the time budget (counted from this call's start) is used up, the
 *     depth is not started and its row says "time budget used up";
 *   - enter the cut (tune[i] set for modules not tuned at an earlier depth),
 *     search those modules (tw_tune_module with ops->modules; the result
 *     keeps each search, see tw_result_module_search); once the time budget is
 *     used up, a candidate flagged TW_CAND_VARIANT is not built (it fails with
 *     reason TW_REASON_BUDGET) while the others still are, so every module of
 *     the depth in progress still gets a choice; and when every module
 *     of the cut has failed, leave and record the depth as skipped with the
 *     first module's error (tw_module_result_error);
 *   - otherwise activate, measure the model, leave.
 * The untuned model is measured first, and again after the last depth when at
 * least one depth was measured; the lower of its measurements counts.
 * Selection: among depths faster than the untuned model, the shallowest
 * whose latency is within tie_tolerance of the fastest (latency <= fastest *
 * (1 + tie_tolerance)). When no depth is faster, nothing is selected and the
 * model stays untuned. The selected cut is entered and activated again at the
 * end (modules are not tuned again).
 * Confirmation (when ops->deactivate is set): the selected cut, active, and
 * the same cut deactivated are measured side by side (tw_measure_compare, one
 * runner activating before each round, the other deactivating), so that the
 * claimed speedup never rests on measurements taken at different moments.
 * Its two latencies are then held against the search's own figures for the
 * same configurations (the untuned against the baseline, the tuned against
 * the selected row; see tw_stats_agree), and so is the speedup they give (as
 * a latency, within the four spreads: two latencies that each moved within
 * the margin, but apart, move the speedup beyond it). When any disagrees (the machine's
 * load changed between the two), the side-by-side measurement is taken again,
 * at most TW_CONFIRM_TRIES times in all and none once the time budget is used
 * up. The figure reported is the side-by-side one when they agree, else the
 * smaller of the two (the search's, or the last side by side), and the result
 * says which (tw_confirmation.quality). The cut is kept only when the
 * reported speedup's interval lies above 1: untuned q25 over tuned q75 above
 * 1. Otherwise it is left, nothing is selected, and the confirmation says why
 * (see tw_confirmation). The kept cut ends active.
 * A busy machine (ops->load): when other processes took more than
 * TW_BUSY_SHARE of the machine's CPU capacity during the untuned model's
 * measurements in the search or a side-by-side measurement, figures taken at
 * different moments are not comparable (the load comes in bursts, and it slows
 * eager torch's threads more than a compiled backend's). Then:
 *   - once the untuned model was measured busy, the budget in force is the
 *     smaller of time_budget_ns and busy_budget_ns (when not 0), split in two:
 *     the paired rounds' share (TW_BUSY_PAIRS pairs at the untuned model's
 *     busy latency, at most half the budget; only with ops->deactivate set),
 *     and the search's, the rest: a depth not started once the search's share
 *     is used up says "busy budget used up" (tw_result_busy_stopped), and a
 *     variant is not built. The paired rounds stop at what is left of the whole
 *     budget, or after their own share, whichever is later (after their
 *     minimum), so a search that ran over its share never takes theirs;
 *     when they stop so, leaning faster but undecided, the confirmation says
 *     which budget would buy the rounds (busy_budget_wanted_ns,
 *     time_budget_wanted_ns) and so does the result's last line;
 *   - with ops->deactivate set, the fastest measured depth is selected
 *     (shallowest within tie_tolerance) even when the untuned model's own
 *     measurement was faster;
 *   - the selected cut and the untuned model (the cut deactivated) are
 *     measured in paired rounds (tw_measure_paired, runner 0 deactivated,
 *     runner 1 active) instead of the side-by-side measurement and its
 *     agreement rule: the confirmation's figure is their median ratio with its
 *     99 % interval (paired_rounds, paired_wins), the quality TW_QUALITY_BUSY,
 *     others_share the load during those rounds, and the cut is kept when the
 *     interval lies above 1. A figure measured busy is marked busy wherever the
 *     result shows it.
 * A dry run computes the rows with their module counts and calls nothing;
 * ops may be NULL then. A depth not started for the budget still reports its
 * modules, and as failed those that failed at a shallower depth.
 * When entering or activating the selected cut again fails, leave() is called
 * and that code is returned: the model stays as it was, untuned.
 * On success *out owns a new result (free with tw_result_destroy); on any
 * failure *out is NULL and the model is as it was before the call (as far as
 * leave() could restore it). */
tw_code tw_tweak_run(const tw_host *host, const tw_tree *tree,
                     const tw_tweak_config *cfg, const tw_tweak_ops *ops,
                     tw_result **out, tw_error *err);

/* ------------------------------------------------------------------ result */

typedef enum tw_row_state {
    TW_ROW_MEASURED = 0, /* latency is valid */
    TW_ROW_SKIPPED = 1,  /* every module failed, or measuring failed: see error */
    TW_ROW_BUDGET = 2,   /* not started: "time budget used up" */
    TW_ROW_DRY = 3       /* dry run: only modules is valid */
} tw_row_state;

typedef struct tw_row {
    int depth;
    size_t modules;        /* modules in the cut */
    size_t failed;         /* of which failed to tune (kept their forward) */
    tw_row_state state;
    tw_stats stats;        /* valid when state == TW_ROW_MEASURED */
    const char *error;     /* "" when none; owned by the result */
} tw_row;

void tw_result_destroy(tw_result *result);
size_t tw_result_row_count(const tw_result *result);
/* Copies row i into *row; TW_EINVAL when out of range. */
tw_code tw_result_row(const tw_result *result, size_t i, tw_row *row, tw_error *err);
/* Index of the selected row, or -1 when the model stays untuned. */
long tw_result_selected(const tw_result *result);
/* The untuned model's statistics (the lower measurement); *measured is 0 on a
 * dry run. Either out parameter may be NULL. */
void tw_result_baseline(const tw_result *result, tw_stats *stats, int *measured);
/* Per module of the tree: 1 tuned, -1 failed, 0 never tuned; its error in
 * *error ("" when none, owned by the result). */
int tw_result_module(const tw_result *result, size_t node, const char **error);

/* What the search of module `node` found (see tw_module_result), owned by the
 * result; NULL when it was never searched (or node is out of range). */
const tw_module_result *tw_result_module_search(const tw_result *result, size_t node);

/* Whether node lies in the cut of row i (0 when either is out of range): the
 * depths a module was measured at, and with the selected row, whether the
 * model runs its backend now. */
int tw_result_row_has(const tw_result *result, size_t i, size_t node);

/* A spread (see tw_stats) above this makes the result table say the machine
 * was too busy to measure well, and what to do. */
#define TW_NOISY_SPREAD 0.25

/* Two measurements of one configuration agree when their medians differ by at
 * most the sum of their spreads plus this fraction, relative to the smaller
 * median. A shared machine measures the same configuration up to about a fifth
 * apart at different moments (a sleep's overshoot, a short call's cache and
 * clock state); a burst of load that makes up a speedup moves it by several
 * times (an eager call from 25 ms to 600 ms). */
#define TW_AGREE_MARGIN 0.25

/* Other processes taking more than this share of the machine's CPU capacity
 * (cores x wall time) while the figures are measured make the machine busy
 * (see tw_tweak_run). A quarter: half a core of a 2-core machine, one whole
 * core of 4. What a desktop runs beside (an editor, a browser left alone,
 * daemons) takes a few percent; one single-threaded job beside the tweak on
 * up to 3 cores is above it, and that is a load under which eager torch's
 * threads were measured losing far more than OpenVINO's (1.75x claimed on a
 * loaded 2-core machine, 1.12x when quiet). */
#define TW_BUSY_SHARE 0.25

/* A window of less capacity than this (CPU-seconds: 0.15 s on 2 cores) is too
 * short to tell the load from its readings' rounding (clock ticks of 10 ms):
 * a short side-by-side measurement is judged together with the untuned
 * model's measurements (see tw_result_others_share). */
#define TW_LOAD_MIN_CAPACITY 0.3

/* The most side-by-side measurements of one confirmation (the first included). */
#define TW_CONFIRM_TRIES 3u

/* 1 when a and b agree (see TW_AGREE_MARGIN); two medians of 0 agree, and an
 * infinite spread agrees with anything. 0 when either is NULL. */
int tw_stats_agree(const tw_stats *a, const tw_stats *b);

/* How far the figures a result reports can be believed. */
typedef enum tw_quality {
    TW_QUALITY_UNCHECKED = 0,   /* nothing was measured side by side: no depth beat
                                 * the untuned model in the search, a dry run, no
                                 * deactivate callback, or the confirmation failed */
    TW_QUALITY_CONSISTENT = 1,  /* the side-by-side figures agreed with the search's */
    TW_QUALITY_REMEASURED = 2,  /* they disagreed at first and agreed when measured again */
    TW_QUALITY_INCONSISTENT = 3, /* they never agreed: the smaller figure is reported */
    TW_QUALITY_BUSY = 4          /* other processes took more than TW_BUSY_SHARE of the
                                  * CPUs while measuring: the figure comes from paired
                                  * rounds and is marked as measured busy */
} tw_quality;

/* "unchecked", "consistent", "remeasured", "inconsistent", "busy"; "unknown" when out of range. */
const char *tw_quality_name(tw_quality quality);

/* The selected depth measured side by side with the untuned model. */
typedef struct tw_confirmation {
    int measured;        /* 0: none (nothing selected, no deactivate, a dry run) */
    int depth;           /* the depth that was confirmed, or found within noise */
    int confirmed;       /* 1: the reported speedup lies above 1 beyond noise: the cut is kept */
    tw_stats tuned;      /* the last side-by-side measurement: the cut active */
    tw_stats untuned;    /* the same cut deactivated */
    double speedup;      /* the reported figure: untuned median / tuned median of
                          * the side-by-side measurement, or, when quality is
                          * inconsistent, of whichever of it and the search's
                          * (baseline against the selected row) is smaller */
    double speedup_low;  /* its untuned q25 / tuned q75: the interval's low end */
    double speedup_high; /* its untuned q75 / tuned q25 */
    tw_quality quality;  /* consistent, remeasured, inconsistent or busy */
    uint32_t tries;      /* side-by-side measurements taken, 1..TW_CONFIRM_TRIES */
    int from_search;     /* 1: the reported figure is the search's (inconsistent,
                          * and the search's was the smaller) */
    double side_speedup;   /* the last side-by-side figure (untuned / tuned medians) */
    double search_speedup; /* the search's figure: baseline median / the selected
                            * row's median */
    int agreed;          /* 1: the side-by-side figures agreed with the search's
                          * (quality consistent or remeasured, or busy and agreeing) */
    uint32_t paired_rounds; /* busy: the paired rounds the figure comes from
                             * (tw_measure_paired); else 0 */
    uint32_t paired_wins;   /* busy: of which the cut active was the faster */
    uint64_t busy_budget_wanted_ns; /* busy, not kept: the paired rounds leaned faster
                                     * (median above 1) but the busy budget ran out
                                     * before their interval could decide; the busy
                                     * budget that buys the rounds it needs (estimated
                                     * from the pairs' wins and pace, in whole seconds
                                     * rounded up, to tens from 10 s). Else 0 */
    uint64_t time_budget_wanted_ns; /* likewise when the time budget (the smaller of
                                     * the two) was the one in force; else 0 */
    int rounds_ran_out;  /* busy, not kept: the paired rounds stopped at their time cap
                          * before their interval decided (with a budget wanted, or none
                          * when at their share of pairs won no number of pairs up to
                          * their most would decide) */
    double others_share; /* what other processes took of the CPU capacity during
                          * the last side-by-side measurement, 0..1; -1: unknown
                          * or too short to tell (TW_LOAD_MIN_CAPACITY) */
} tw_confirmation;

/* Copies the confirmation into *out (all zero when none was measured). */
void tw_result_confirmation(const tw_result *result, tw_confirmation *out);
/* The confirmation's figure as the result table's "confirmed" column and its
 * last line write it, the one place that writes it: "1.54x", or for a busy
 * keep whose interval's low end lies just above 1, with the digit that shows
 * it ("1.003x"). Into out (size bytes, 16 are enough); "" when none was
 * measured or result is NULL. */
void tw_result_confirmed_figure(const tw_result *result, char *out, size_t size);
/* The confirmation's quality; TW_QUALITY_UNCHECKED when none was measured or
 * result is NULL. */
tw_quality tw_result_quality(const tw_result *result);
/* 1 when no speedup was confirmed and a measurement of the result spread more
 * than TW_NOISY_SPREAD: the machine may have been too busy to decide. */
int tw_result_noisy(const tw_result *result);
/* The share of the machine's CPU capacity other processes took while the
 * figures were measured (see tw_load): the larger of the untuned model's
 * measurements in the search and the last side-by-side one, each judged only
 * when its capacity reaches TW_LOAD_MIN_CAPACITY, and both together when
 * neither does; 0..1; -1 when unknown (no load callback, no reading, windows
 * too short, a dry run). */
double tw_result_others_share(const tw_result *result);
/* 1 when tw_result_others_share is above TW_BUSY_SHARE. */
int tw_result_busy(const tw_result *result);
/* 1 when the busy budget (tw_tweak_config.busy_budget_ns) stopped the search:
 * a depth was not tried because the machine was busy. */
int tw_result_busy_stopped(const tw_result *result);

/* The result table: one row per depth (depth, modules wrapped, then the
 * search's figures: "search ms" its latency, its spread, "search" its speedup
 * against the untuned model's search baseline; then "confirmed": on the row of
 * the depth measured against the untuned model side by side or in paired
 * rounds, the figure that decided whether it is kept, the same number the last
 * line gives; then its status or error) and one for the untuned model, the
 * selected row marked with '>', then what was kept and by how much: the
 * confirmed figure, "slower" when its interval lies wholly below 1, "within
 * noise" when it holds 1; when the side-by-side figures never agreed with the
 * search's, one line says so and the smaller figure counts; when no depth was
 * tried because the time budget was used up first, the last line says that.
 * Every figure of a row is its column's moment's: the search's columns are
 * never the confirmation's, and the reverse.
 * Free with tw_free(). */
char *tw_result_format(const tw_result *result, tw_error *err);
/* The same table; `untuned` (NULL: "it stays untuned") ends its last line when no
 * depth is kept, for a caller that keeps something else, e.g. "its modules stay
 * untuned; generate() runs tweak's decode loop (graph)". */
char *tw_result_format_as(const tw_result *result, const char *untuned, tw_error *err);
/* The lines that end that table, alone: what was kept and by how much (or why
 * nothing was), then the notes on the machine (busy budget, busy, noisy), one per
 * line; the one place tweak's outcome is written (TweakResult.outcome() joins
 * the lines, a tuning-cache entry keeps them). Free with tw_free(). */
char *tw_result_outcome_as(const tw_result *result, const char *untuned, tw_error *err);

/* The time budget and the busy budget the result was computed under, in ns (0:
 * none; tw_tweak_config's). Either out parameter may be NULL; both 0 for a NULL
 * result. */
void tw_result_budgets(const tw_result *result, uint64_t *time_budget_ns,
                       uint64_t *busy_budget_ns);

/* ---------------------------------------------------------- a kept result */

/* The most rows a kept result may have: a module tree is never this deep. */
#define TW_RESULT_MAX_ROWS 1024u

/* The numbers a result's table and outcome are written from, as a caller kept
 * them (a tuning-cache entry keeps a finished tweak's, read with the accessors
 * above): tw_result_restore checks them and builds the result again, so that
 * every line a user reads of a kept result is written from checked numbers by
 * the one formatter (tw_result_format_as, tw_result_outcome_as), never kept as
 * text. */
typedef struct tw_result_record {
    const tw_row *rows;     /* row_count rows (may be NULL when row_count is 0);
                             * each row's error NULL or text, copied and cut to
                             * TW_MSG_SIZE - 1 bytes; stats read when measured */
    size_t row_count;       /* at most TW_RESULT_MAX_ROWS */
    long selected;          /* -1, or the index of a measured row */
    tw_stats baseline;      /* read when baseline_measured */
    int baseline_measured;
    /* Read: measured, depth, tuned, untuned, tries, quality (whether busy;
     * any other quality must be the one the figures give), others_share; on a
     * busy machine also speedup, speedup_low, speedup_high (the paired rounds'
     * figure), paired_rounds, paired_wins, busy_budget_wanted_ns,
     * time_budget_wanted_ns and rounds_ran_out (each only for rounds that did
     * not keep the depth; 0 otherwise). Everything else (agreed, the
     * figures of a side-by-side measurement, from_search, side_speedup,
     * search_speedup, confirmed) is derived again from the numbers, as
     * tw_tweak_run derives it. Ignored unless measured. */
    tw_confirmation confirmation;
    double others_share;    /* tw_result_others_share: 0..1, or -1 (unknown) */
    int busy_stopped;       /* tw_result_busy_stopped */
    uint64_t time_budget_ns; /* tw_result_budgets */
    uint64_t busy_budget_ns;
} tw_result_record;

/* A result built from `record`: its rows, selection, baseline, confirmation,
 * load and budgets read as the result the numbers were read from, and its table
 * and outcome are written from them (it keeps no module search:
 * tw_result_module_search is NULL for every node). On success *out owns it
 * (free with tw_result_destroy); on any failure *out is NULL. host: NULL, or
 * NULL members, take the defaults (see tw_host).
 * TW_EINVAL, with what was wrong, for a NULL record or out, and for
 * numbers no tweak gives: more than TW_RESULT_MAX_ROWS rows, a row state out of
 * range, a negative depth, more failed modules than modules; a latency
 * (median, quartiles, minimum) that is negative or not finite, quartiles out of
 * order, a spread that is negative or NaN; a selected row out of range or not
 * measured, or without an untuned baseline; a confirmation of a depth no
 * measured row has, with no tries or more than TW_CONFIRM_TRIES + 1, a quality
 * out of range or not the one its figures give, a busy figure that is NaN or
 * negative or outside its interval, more paired wins than rounds or more
 * rounds than TW_PAIRED_ROUNDS_MAX, a budget wanted or rounds run out for a
 * kept depth (or both budgets wanted), a share that is neither -1 nor within 0..1
 * (the confirmation's: -1 or >= 0), a kept depth its confirmation does not
 * keep or the other way round. TW_ENOMEM when out of memory. Thread-safe: it
 * reads the record and touches only what it creates. */
tw_code tw_result_restore(const tw_host *host, const tw_result_record *record,
                          tw_result **out, tw_error *err);

#ifdef __cplusplus
}
#endif
#endif /* TWEAK_H */
