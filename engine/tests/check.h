/*
 * check.h - the engine tests' assertions: each failure prints file:line and
 * is counted; CHECK_SUMMARY() prints the count and gives the exit status.
 */
#ifndef TW_CHECK_H
#define TW_CHECK_H

#include <stdio.h>
#include <string.h>

static int tw_checks_run;
static int tw_checks_failed;

#define CHECK(cond)                                                              \
    do {                                                                         \
        tw_checks_run++;                                                         \
        if (!(cond)) {                                                           \
            tw_checks_failed++;                                                  \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                        \
    } while (0)

#define CHECK_INT(a, b)                                                          \
    do {                                                                         \
        long long check_a_ = (long long)(a);                                     \
        long long check_b_ = (long long)(b);                                     \
        tw_checks_run++;                                                         \
        if (check_a_ != check_b_) {                                              \
            tw_checks_failed++;                                                  \
            fprintf(stderr, "%s:%d: check failed: %s == %s (%lld != %lld)\n",    \
                    __FILE__, __LINE__, #a, #b, check_a_, check_b_);             \
        }                                                                        \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                    \
    do {                                                                         \
        double check_a_ = (double)(a);                                           \
        double check_b_ = (double)(b);                                           \
        tw_checks_run++;                                                         \
        if (!(check_a_ - check_b_ <= (tol) && check_b_ - check_a_ <= (tol))) {   \
            tw_checks_failed++;                                                  \
            fprintf(stderr, "%s:%d: check failed: %s ~= %s (%g != %g)\n",        \
                    __FILE__, __LINE__, #a, #b, check_a_, check_b_);             \
        }                                                                        \
    } while (0)

#define CHECK_STR(a, b)                                                          \
    do {                                                                         \
        const char *check_a_ = (a);                                              \
        const char *check_b_ = (b);                                              \
        tw_checks_run++;                                                         \
        if (check_a_ == NULL || check_b_ == NULL || strcmp(check_a_, check_b_) != 0) { \
            tw_checks_failed++;                                                  \
            fprintf(stderr, "%s:%d: check failed: %s == %s (\"%s\" != \"%s\")\n", \
                    __FILE__, __LINE__, #a, #b, check_a_ ? check_a_ : "(null)",  \
                    check_b_ ? check_b_ : "(null)");                             \
        }                                                                        \
    } while (0)

/* `text` contains `part`. */
#define CHECK_HAS(text, part)                                                    \
    do {                                                                         \
        const char *check_t_ = (text);                                           \
        const char *check_p_ = (part);                                           \
        tw_checks_run++;                                                         \
        if (check_t_ == NULL || strstr(check_t_, check_p_) == NULL) {            \
            tw_checks_failed++;                                                  \
            fprintf(stderr, "%s:%d: check failed: \"%s\" in %s:\n%s\n",         \
                    __FILE__, __LINE__, check_p_, #text,                         \
                    check_t_ ? check_t_ : "(null)");                             \
        }                                                                        \
    } while (0)

#define CHECK_SUMMARY(name)                                                      \
    (printf("%s: %d checks, %d failed\n", (name), tw_checks_run, tw_checks_failed), \
     tw_checks_failed == 0 && tw_checks_run > 0 ? 0 : 1)

#endif /* TW_CHECK_H */
