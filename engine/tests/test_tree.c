/*
 * test_tree.c - the module tree: depths, parents, cuts, distinct depths,
 * errors and the text view.
 */
#include "check.h"
#include "fake.h"
#include "tweak.h"

/* Builds a finished tree of `n` paths (calls 1, time 1 ms each). */
static tw_tree *build_tree(fake_env *env, const char *const *paths, size_t n)
{
    tw_host host = fake_host(env);
    tw_tree *tree = tw_tree_create(&host, NULL);
    size_t i;

    CHECK(tree != NULL);
    for (i = 0; tree != NULL && i < n; i++) {
        CHECK_INT(tw_tree_add(tree, paths[i], 1, 1000000, NULL, NULL), TW_OK);
    }
    if (tree != NULL) {
        CHECK_INT(tw_tree_finish(tree, NULL), TW_OK);
    }
    return tree;
}

static long find(const tw_tree *tree, const char *path)
{
    long i = tw_tree_find(tree, path);

    CHECK(i >= 0);
    return i;
}

/* ModuleList "layers" is never called: layers.0 is depth 1, its mlp depth 2. */
static void test_uncalled_containers(void)
{
    static const char *const paths[] = {"layers.0.mlp", "", "layers.0", "layers.1",
                                        "layers.1.mlp", "head"};
    fake_env env;
    tw_tree *tree;

    fake_env_init(&env);
    tree = build_tree(&env, paths, 6);
    CHECK_INT(tw_tree_size(tree), 6);
    CHECK_INT(tw_tree_depth(tree, (size_t)find(tree, "")), 0);
    CHECK_INT(tw_tree_depth(tree, (size_t)find(tree, "layers.0")), 1);
    CHECK_INT(tw_tree_depth(tree, (size_t)find(tree, "layers.0.mlp")), 2);
    CHECK_INT(tw_tree_depth(tree, (size_t)find(tree, "head")), 1);
    CHECK_INT(tw_tree_parent(tree, (size_t)find(tree, "layers.0")), find(tree, ""));
    CHECK_INT(tw_tree_parent(tree, (size_t)find(tree, "layers.0.mlp")), find(tree, "layers.0"));
    CHECK_INT(tw_tree_parent(tree, (size_t)find(tree, "")), -1);
    CHECK_INT(tw_tree_child_count(tree, (size_t)find(tree, "")), 3);
    CHECK_INT(tw_tree_max_depth(tree), 2);
    CHECK_INT(tw_tree_find(tree, "layers"), -1);
    /* indices follow the order of adding */
    CHECK_INT(find(tree, "layers.0.mlp"), 0);
    CHECK_STR(tw_tree_path(tree, 1), "");
    CHECK(tw_tree_path(tree, 6) == NULL);
    CHECK_INT(tw_tree_depth(tree, 99), -1);
    tw_tree_destroy(tree);
    CHECK_INT(env.live, 0);
}

/* "layer1" is not a parent of "layer10": parents go by dotted names. */
static void test_dotted_prefix(void)
{
    static const char *const paths[] = {"", "layer1", "layer10", "layer10.conv",
                                        "layer1.conv", "a.b.c"};
    fake_env env;
    tw_tree *tree;

    fake_env_init(&env);
    tree = build_tree(&env, paths, 6);
    CHECK_INT(tw_tree_parent(tree, (size_t)find(tree, "layer10")), find(tree, ""));
    CHECK_INT(tw_tree_depth(tree, (size_t)find(tree, "layer10")), 1);
    CHECK_INT(tw_tree_parent(tree, (size_t)find(tree, "layer10.conv")), find(tree, "layer10"));
    CHECK_INT(tw_tree_parent(tree, (size_t)find(tree, "layer1.conv")), find(tree, "layer1"));
    CHECK_INT(tw_tree_child_count(tree, (size_t)find(tree, "layer1")), 1);
    /* neither "a" nor "a.b" was called: a.b.c hangs from the root */
    CHECK_INT(tw_tree_depth(tree, (size_t)find(tree, "a.b.c")), 1);
    tw_tree_destroy(tree);
}

static void test_cuts(void)
{
    /* root: a (leaf), b -> b.x (leaf), b.y -> b.y.z */
    static const char *const paths[] = {"", "a", "b", "b.x", "b.y", "b.y.z"};
    fake_env env;
    tw_tree *tree;
    size_t out[8];
    size_t count = 99;
    int depths[8];
    tw_error err;

    fake_env_init(&env);
    tree = build_tree(&env, paths, 6);
    CHECK_INT(tw_tree_cut(tree, 0, out, 8, &count, NULL), TW_OK);
    CHECK_INT(count, 1);
    CHECK_INT(out[0], 0);
    CHECK_INT(tw_tree_cut(tree, 1, out, 8, &count, NULL), TW_OK);
    CHECK_INT(count, 2);
    CHECK_INT(out[0], 1);
    CHECK_INT(out[1], 2);
    /* depth 2: the leaf "a" from depth 1 stays in the cut */
    CHECK_INT(tw_tree_cut(tree, 2, out, 8, &count, NULL), TW_OK);
    CHECK_INT(count, 3);
    CHECK_INT(out[0], 1);
    CHECK_INT(out[1], 3);
    CHECK_INT(out[2], 4);
    CHECK_INT(tw_tree_cut(tree, 3, out, 8, &count, NULL), TW_OK);
    CHECK_INT(count, 3);
    CHECK_INT(out[2], 5);
    /* a small cap still reports the full size */
    CHECK_INT(tw_tree_cut(tree, 2, out, 1, &count, NULL), TW_OK);
    CHECK_INT(count, 3);
    CHECK_INT(tw_tree_cut(tree, -1, out, 8, &count, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "depth (-1)");

    /* depths 4 and 5 repeat the cut at 3 and are dropped */
    CHECK_INT(tw_tree_distinct_depths(tree, 0, 5, depths, 8, &count, NULL), TW_OK);
    CHECK_INT(count, 4);
    CHECK_INT(depths[0], 0);
    CHECK_INT(depths[3], 3);
    CHECK_INT(tw_tree_distinct_depths(tree, 1, -1, depths, 8, &count, NULL), TW_OK);
    CHECK_INT(count, 3);
    CHECK_INT(depths[0], 1);
    CHECK_INT(depths[2], 3);
    /* below the deepest, the leaves still form one cut: it is kept once */
    CHECK_INT(tw_tree_distinct_depths(tree, 4, 9, depths, 8, &count, NULL), TW_OK);
    CHECK_INT(count, 1);
    CHECK_INT(depths[0], 4);
    CHECK_INT(tw_tree_distinct_depths(tree, 3, 1, depths, 8, &count, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "min_depth (3) is greater than max_depth (1)");
    CHECK_INT(tw_tree_distinct_depths(tree, -1, 1, depths, 8, &count, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "min_depth (-1) is negative: the root is depth 0");
    /* both queries check their output array alike */
    CHECK_INT(tw_tree_cut(tree, 1, NULL, 8, &count, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "out is NULL but cap is 8");
    CHECK_INT(count, 0);
    CHECK_INT(tw_tree_distinct_depths(tree, 0, 1, NULL, 8, &count, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "out is NULL but cap is 8");
    CHECK_INT(count, 0);
    tw_tree_destroy(tree);
}

/* A root without children: every cut is the root, kept once. */
static void test_single_node(void)
{
    static const char *const paths[] = {""};
    fake_env env;
    tw_tree *tree;
    size_t out[2];
    size_t count;
    int depths[4];

    fake_env_init(&env);
    tree = build_tree(&env, paths, 1);
    CHECK_INT(tw_tree_cut(tree, 2, out, 2, &count, NULL), TW_OK);
    CHECK_INT(count, 1);
    CHECK_INT(tw_tree_distinct_depths(tree, 0, 3, depths, 4, &count, NULL), TW_OK);
    CHECK_INT(count, 1);
    CHECK_INT(depths[0], 0);
    tw_tree_destroy(tree);
}

static void test_errors(void)
{
    fake_env env;
    tw_host host;
    tw_tree *tree;
    tw_error err;
    size_t index = 99;
    size_t count;

    fake_env_init(&env);
    host = fake_host(&env);
    tree = tw_tree_create(&host, &err);
    CHECK(tree != NULL);
    CHECK_INT(tw_tree_add(tree, "x", 1, 0, &index, &err), TW_OK);
    CHECK_INT(index, 0);
    CHECK_INT(tw_tree_add(tree, "x", 1, 0, NULL, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "\"x\" was already added");
    CHECK_INT(err.code, TW_EINVAL);
    CHECK_INT(tw_tree_add(tree, NULL, 1, 0, NULL, &err), TW_EINVAL);
    CHECK_INT(tw_tree_add(tree, "a..b", 1, 0, NULL, &err), TW_EINVAL);
    CHECK_INT(tw_tree_cut(tree, 0, NULL, 0, &count, &err), TW_ESTATE);
    CHECK(tw_tree_format(tree, &err) == NULL);
    CHECK_INT(tw_tree_max_depth(tree), -1);
    CHECK_INT(tw_tree_finish(tree, &err), TW_EINVAL);
    CHECK_HAS(err.msg, "no root");
    CHECK_INT(tw_tree_add(tree, "", 1, 0, &index, &err), TW_OK);
    CHECK_INT(index, 1);
    CHECK_INT(tw_tree_finish(tree, &err), TW_OK);
    CHECK_INT(tw_tree_finish(tree, &err), TW_ESTATE);
    CHECK_INT(tw_tree_add(tree, "y", 1, 0, NULL, &err), TW_ESTATE);
    CHECK_INT(tw_tree_size(tree), 2);
    tw_tree_destroy(tree);
    tw_tree_destroy(NULL);
    CHECK_INT(env.live, 0);
}

static void test_format(void)
{
    static const char *const paths[] = {"", "layers.0", "layers.0.mlp", "layers.1", "head"};
    fake_env env;
    tw_tree *tree;
    char *text;

    fake_env_init(&env);
    tree = build_tree(&env, paths, 5);
    text = tw_tree_format(tree, NULL);
    CHECK(text != NULL);
    CHECK_HAS(text, "(root)");
    CHECK_HAS(text, "\n  layers.0 ");
    CHECK_HAS(text, "\n    layers.0.mlp ");
    CHECK_HAS(text, "1.000");
    /* the walk is depth first: mlp comes before layers.1 */
    CHECK(text != NULL && strstr(text, "layers.0.mlp") < strstr(text, "layers.1"));
    if (text != NULL) {
        printf("%s", text);
    }
    tw_free(text);
    tw_tree_destroy(tree);
    CHECK_INT(env.live, 0);
}

int main(void)
{
    test_uncalled_containers();
    test_dotted_prefix();
    test_cuts();
    test_single_node();
    test_errors();
    test_format();
    return CHECK_SUMMARY("test_tree");
}
