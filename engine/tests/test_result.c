/*
 * test_result.c - the result object and its table.
 */
#include "check.h"
#include "fake.h"
#include "fake_model.h"
#include "tweak.h"

/* The line of `text` that starts with `start`, copied into line[]. */
static const char *find_line(const char *text, const char *start, char *line, size_t size)
{
    const char *at = text;
    size_t n;

    line[0] = '\0';
    while (at != NULL && *at != '\0') {
        if (strncmp(at, start, strlen(start)) == 0) {
            n = strcspn(at, "\n");
            n = n < size - 1 ? n : size - 1;
            memcpy(line, at, n);
            line[n] = '\0';
            return line;
        }
        at = strchr(at, '\n');
        at = at != NULL ? at + 1 : NULL;
    }
    return NULL;
}

/* The line of `text` that starts with `start` contains `part`. A macro, not a
 * function, so that a failure names the test's own line. */
#define CHECK_LINE(text, start, part)                                            \
    do {                                                                         \
        char check_line_[256];                                                   \
        CHECK(find_line((text), (start), check_line_, sizeof check_line_) != NULL); \
        CHECK_HAS(check_line_, (part));                                          \
    } while (0)

/* Depth 0 a little faster, depth 1 selected, depth 2 broken. */
static void test_table(void)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_result *result = NULL;
    char line[256];
    char *text;

    fake_model_setup(&m);
    m.base_first = 1293000;
    m.base_second = 1293000;
    m.depth_latency[0] = 1234000;
    m.depth_latency[1] = 987000;
    m.depth_fail[2] = TW_ECALLBACK;
    CHECK_INT(fake_model_tweak(&m, &cfg, &result, NULL), TW_OK);
    text = tw_result_format(result, NULL);
    CHECK(text != NULL);
    if (text != NULL) {
        printf("%s\n", text);
    }
    CHECK_HAS(text, "depth  modules  failed  search ms  spread  search  confirmed  status");
    CHECK(find_line(text, "        0", line, sizeof line) != NULL);
    CHECK_HAS(line, "1.234");
    CHECK_HAS(line, "1.05x");
    CHECK(strchr(line, '>') == NULL);
    CHECK_LINE(text, ">       1", "      3       0      0.987      0%   1.31x          -  selected");
    CHECK_LINE(text, "        2", "skipped: model broke at depth 2");
    CHECK(find_line(text, "  untuned", line, sizeof line) != NULL);
    CHECK_HAS(line, "1.293");
    CHECK_HAS(line, "1.00x");
    CHECK_HAS(text, "selected depth 1: 1.31x faster than untuned");
    tw_free(text);
    fake_model_teardown(&m, result);
}

static void test_budget_and_untuned(void)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_result *result = NULL;
    char *text;

    fake_model_setup(&m);
    m.depth_latency[0] = 2000;
    m.tune_cost[ROOT] = 5000000;
    cfg.time_budget_ns = 1000000;
    CHECK_INT(fake_model_tweak(&m, &cfg, &result, NULL), TW_OK);
    text = tw_result_format(result, NULL);
    CHECK_LINE(text, "        1", "time budget used up");
    CHECK_LINE(text, "        0", "0.50x");
    CHECK(text != NULL && strchr(text, '>') == NULL);
    CHECK_HAS(text, "no depth beat the untuned model: it stays untuned");
    tw_free(text);
    /* a caller that keeps something else names what stays untuned */
    text = tw_result_format_as(result, "its modules stay untuned; a loop runs", NULL);
    CHECK_HAS(text, "no depth beat the untuned model: its modules stay untuned; a loop runs\n");
    CHECK(text != NULL && strstr(text, "it stays untuned") == NULL);
    tw_free(text);
    fake_model_teardown(&m, result);
}

/* A side-by-side interval wholly below 1 is "slower", not "within noise". */
static void test_slower_is_called_slower(void)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_tweak_ops ops;
    tw_result *result = NULL;
    tw_confirmation c;
    char *text;

    fake_model_setup(&m);
    m.depth_latency[0] = m.depth_latency[1] = 1100;
    m.depth_latency[2] = 990;   /* the search: 1 % faster */
    m.wrapped_latency = 950;    /* side by side: the untuned model is faster */
    ops = fake_model_ops(&m);
    ops.deactivate = model_deactivate;
    CHECK_INT(tw_tweak_run(&m.host, m.tree, &cfg, &ops, &result, NULL), TW_OK);
    tw_result_confirmation(result, &c);
    CHECK_INT(c.quality, TW_QUALITY_CONSISTENT);
    CHECK(c.speedup_high < 1.0);
    text = tw_result_format(result, NULL);
    CHECK_LINE(text, "        2", "slower side by side");
    CHECK_HAS(text, "depth 2 was slower than the untuned model, measured side by side (0.96x, "
                    "from 0.96x to 0.96x): it stays untuned");
    CHECK(text != NULL && strstr(text, "within noise") == NULL);
    tw_free(text);
    fake_model_teardown(&m, result);
}

/* time_budget=0 (the binding passes 1 ns): nothing is tried, and the last
 * line says so instead of "no depth beat the untuned model". */
static void test_nothing_tried_for_the_budget(void)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_result *result = NULL;
    char *text;

    fake_model_setup(&m);
    cfg.time_budget_ns = 1;
    CHECK_INT(fake_model_tweak(&m, &cfg, &result, NULL), TW_OK);
    text = tw_result_format(result, NULL);
    CHECK_HAS(text, "no depth was tried: the time budget was 0: it stays untuned\n");
    CHECK(text != NULL && strstr(text, "beat") == NULL);
    tw_free(text);
    fake_model_teardown(&m, result);

    /* a budget the untuned measurement alone used up */
    fake_model_setup(&m);
    cfg.time_budget_ns = 500;
    CHECK_INT(fake_model_tweak(&m, &cfg, &result, NULL), TW_OK);
    text = tw_result_format_as(result, "its modules stay untuned", NULL);
    CHECK_HAS(text, "no depth was tried: the time budget (5e-07 s) was used up before the first "
                    "depth: its modules stay untuned\n");
    tw_free(text);
    fake_model_teardown(&m, result);
}

static void test_dry_run_table(void)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_result *result = NULL;
    char *text;

    fake_model_setup(&m);
    cfg.dry_run = 1;
    CHECK_INT(fake_model_tweak(&m, &cfg, &result, NULL), TW_OK);
    text = tw_result_format(result, NULL);
    if (text != NULL) {
        printf("%s\n", text);
    }
    CHECK_LINE(text, "        0", "      1       -          -       -       -          -  dry run");
    CHECK_LINE(text, "        2", "      3       -          -       -       -          -  dry run");
    CHECK_LINE(text, "  untuned", "not measured");
    CHECK_HAS(text, "dry run: nothing was built or measured");
    tw_free(text);
    fake_model_teardown(&m, result);
}

/* A multi-line callback message keeps its row on one line. */
static tw_code multi_line_tune(void *ctx, size_t node, size_t *count, tw_error *err)
{
    (void)ctx;
    (void)node;
    (void)count;
    return tw_error_set(err, TW_ECALLBACK, "first line\nsecond line");
}

/* The tweak of the fake model whose every module search fails in `tune` (its
 * groups() callback); *text gets
 * the table (tw_free it). The caller tears the model down with the result. */
static tw_result *run_failing(fake_model *m, tw_code (*tune)(void *, size_t, size_t *, tw_error *),
                              char **text)
{
    tw_tweak_config cfg = fake_model_config();
    tw_tweak_ops ops;
    tw_result *result = NULL;

    fake_model_setup(m);
    ops = fake_model_ops(m);
    ops.modules.groups = tune;
    CHECK_INT(tw_tweak_run(&m->host, m->tree, &cfg, &ops, &result, NULL), TW_OK);
    *text = tw_result_format(result, NULL);
    return result;
}

static void test_multi_line_error(void)
{
    fake_model m;
    char *text;
    tw_result *result = run_failing(&m, multi_line_tune, &text);

    CHECK_LINE(text, "        0", "skipped: first line ...");
    CHECK_STR(fake_model_row(result, 0).error, "first line\nsecond line");
    tw_free(text);
    fake_model_teardown(&m, result);
}

/* A long message: the row shows its start, cut between words. */
static tw_code long_tune(void *ctx, size_t node, size_t *count, tw_error *err)
{
    (void)ctx;
    (void)node;
    (void)count;
    return tw_error_set(err, TW_ECALLBACK, "%s", "alpha beta gamma delta epsilon zeta eta theta "
                        "iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi "
                        "omega and then some more words that do not fit");
}

static void test_long_error_is_cut_between_words(void)
{
    fake_model m;
    char *text;
    char line[512];
    tw_result *result = run_failing(&m, long_tune, &text);

    CHECK(find_line(text, "        0", line, sizeof line) != NULL);
    CHECK_HAS(line, "skipped: alpha beta");
    CHECK_HAS(line, "rho sigma ...");
    CHECK(strstr(line, "fit") == NULL);
    CHECK_HAS(fake_model_row(result, 0).error, "do not fit");
    tw_free(text);
    fake_model_teardown(&m, result);
}

static void test_accessors(void)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_result *result = NULL;
    tw_row row;
    tw_stats stats;
    tw_error err;
    const char *error = NULL;
    int measured = 1;

    fake_model_setup(&m);
    CHECK_INT(fake_model_tweak(&m, &cfg, &result, NULL), TW_OK);
    CHECK_INT(tw_result_row(result, 3, &row, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "row 3 is out of range");
    CHECK_INT(tw_result_module(result, 99, &error), 0);
    CHECK_STR(error, "");
    tw_result_baseline(result, &stats, &measured);
    CHECK_INT(measured, 1);
    CHECK_NEAR(stats.median_ns, 1000, 1e-9);
    fake_model_teardown(&m, result);

    CHECK(tw_result_format(NULL, &err) == NULL);
    CHECK_INT(err.code, TW_EINVAL);
    CHECK_INT(tw_result_selected(NULL), -1);
    CHECK_INT(tw_result_row_count(NULL), 0);
    tw_result_baseline(NULL, &stats, &measured);
    CHECK_INT(measured, 0);
    tw_result_destroy(NULL);
    tw_free(NULL);
}

/* The outcome alone is the table's last lines, the same words: and a tweak whose
 * every depth was skipped for one reason says that reason. */
static void test_outcome_alone(void)
{
    fake_model m;
    tw_tweak_config cfg = fake_model_config();
    tw_result *result = NULL;
    char *text;
    char *outcome;

    fake_model_setup(&m);
    m.depth_latency[0] = 1000000;
    m.depth_latency[1] = 500000;
    m.depth_latency[2] = 800000;
    m.base_first = m.base_second = 1000000;
    CHECK_INT(fake_model_tweak(&m, &cfg, &result, NULL), TW_OK);
    text = tw_result_format(result, NULL);
    outcome = tw_result_outcome_as(result, NULL, NULL);
    CHECK(text != NULL && outcome != NULL);
    if (text != NULL && outcome != NULL) {
        CHECK(strlen(text) > strlen(outcome));
        CHECK_STR(text + strlen(text) - strlen(outcome), outcome);
        CHECK_HAS(outcome, "depth 1: 2.00x faster than untuned");
        CHECK(strstr(outcome, "untuned  ") == NULL); /* no row of the table */
    }
    tw_free(text);
    tw_free(outcome);
    fake_model_teardown(&m, result);

    fake_model_setup(&m);
    cfg.max_depth = 0;
    m.depth_fail[0] = TW_ECALLBACK;
    CHECK_INT(fake_model_tweak(&m, &cfg, &result, NULL), TW_OK);
    outcome = tw_result_outcome_as(result, "its modules stay untuned", NULL);
    CHECK_STR(outcome, "every depth was skipped: model broke at depth 0: its modules stay untuned\n");
    tw_free(outcome);
    fake_model_teardown(&m, result);
    CHECK(tw_result_outcome_as(NULL, NULL, NULL) == NULL);
}

/* A message longer than its slot, cut inside a character: what is kept is
 * whole characters (a reader decoding UTF-8 strictly gets no error). */
static void test_cut_message_keeps_whole_characters(void)
{
    tw_error err;
    char text[3 * TW_MSG_SIZE];
    size_t i, n, len;

    for (n = 0; n < 4; n++) {
        memset(text, 'a', n);
        for (i = n; i + 3 < sizeof text; i += 3) {
            memcpy(text + i, "\xe2\x82\xac", 3); /* the euro sign, three bytes */
        }
        text[i] = '\0';
        tw_error_set(&err, TW_ECALLBACK, "%s", text);
        len = strlen(err.msg);
        CHECK(len > TW_MSG_SIZE - 5 && len < TW_MSG_SIZE);
        CHECK_INT((int)((len - n) % 3), 0);
    }
    tw_error_set(&err, TW_ECALLBACK, "%s", "short \xc3\xa9");
    CHECK_STR(err.msg, "short \xc3\xa9");
}

int main(void)
{
    test_cut_message_keeps_whole_characters();
    test_long_error_is_cut_between_words();
    test_table();
    test_budget_and_untuned();
    test_outcome_alone();
    test_dry_run_table();
    test_multi_line_error();
    test_accessors();
    test_slower_is_called_slower();
    test_nothing_tried_for_the_budget();
    return CHECK_SUMMARY("test_result");
}
