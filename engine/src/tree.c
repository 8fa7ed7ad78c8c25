/*
 * tree.c - the tree of called modules, its cuts and its text view.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct tw_node {
    char *path;
    uint64_t calls;
    uint64_t time_ns;
    long parent;
    long first_child;   /* children in the order of adding, for the text view */
    long last_child;
    long next_sibling;
    size_t child_count;
    int depth;
} tw_node;

struct tw_tree {
    tw_host host;
    tw_node *nodes;
    size_t size;
    size_t cap;
    size_t *sorted;     /* node indices by path, for lookups; set by finish */
    int finished;
    int max_depth;
};

tw_tree *tw_tree_create(const tw_host *host, tw_error *err)
{
    tw_host resolved;
    tw_tree *tree;

    tw_host_resolve(host, &resolved);
    tree = tw_host_alloc(&resolved, sizeof *tree);
    if (tree == NULL) {
        tw_error_set(err, TW_ENOMEM, "out of memory creating a module tree");
        goto cleanup;
    }
    memset(tree, 0, sizeof *tree);
    tree->host = resolved;
    tree->max_depth = -1;
cleanup:
    return tree;
}

void tw_tree_destroy(tw_tree *tree)
{
    size_t i;

    if (tree == NULL) {
        goto cleanup;
    }
    for (i = 0; i < tree->size; i++) {
        tw_host_release(&tree->host, tree->nodes[i].path);
    }
    tw_host_release(&tree->host, tree->nodes);
    tw_host_release(&tree->host, tree->sorted);
    tw_host_release(&tree->host, tree);
cleanup:
    return;
}

int tw_tree_is_finished(const tw_tree *tree)
{
    return tree != NULL && tree->finished;
}

/* A path is "" or dot-separated non-empty names, as PyTorch names modules;
 * an empty name would make the parent of a node ambiguous. */
static int tw_check_path_shape(const char *path)
{
    size_t len = strlen(path);
    int ok = 1;

    if (len == 0) {
        goto cleanup;
    }
    if (path[0] == '.' || path[len - 1] == '.' || strstr(path, "..") != NULL) {
        ok = 0;
    }
cleanup:
    return ok;
}

/* Before finish there is no index, so a duplicate is found by a scan. */
static long tw_find_by_scan(const tw_tree *tree, const char *path)
{
    long found = -1;
    size_t i;

    for (i = 0; i < tree->size; i++) {
        if (strcmp(tree->nodes[i].path, path) == 0) {
            found = (long)i;
            break;
        }
    }
    return found;
}

static tw_code tw_grow_nodes(tw_tree *tree, tw_error *err)
{
    tw_code rc = TW_OK;
    size_t cap;
    tw_node *nodes;

    if (tree->size < tree->cap) {
        goto cleanup;
    }
    cap = tree->cap == 0 ? 16 : tree->cap * 2;
    nodes = tw_host_alloc_array(&tree->host, cap, sizeof *nodes);
    if (nodes == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory adding a module to the tree");
        goto cleanup;
    }
    if (tree->size > 0) {
        memcpy(nodes, tree->nodes, tree->size * sizeof *nodes);
    }
    tw_host_release(&tree->host, tree->nodes);
    tree->nodes = nodes;
    tree->cap = cap;
cleanup:
    return rc;
}

tw_code tw_tree_add(tw_tree *tree, const char *path, uint64_t calls,
                    uint64_t time_ns, size_t *index, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_node *node;
    char *copy;

    if (tree == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "tree is NULL: create it with tw_tree_create");
        goto cleanup;
    }
    if (tree->finished) {
        rc = tw_error_set(err, TW_ESTATE,
                          "the tree is finished: add every module before tw_tree_finish");
        goto cleanup;
    }
    if (path == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "module path is NULL: pass \"\" for the root");
        goto cleanup;
    }
    if (!tw_check_path_shape(path)) {
        rc = tw_error_set(err, TW_EINVAL,
                          "module path \"%s\" has an empty name: use dotted names "
                          "such as \"layers.0.mlp\"", path);
        goto cleanup;
    }
    if (tw_find_by_scan(tree, path) >= 0) {
        rc = tw_error_set(err, TW_EINVAL,
                          "module path \"%s\" was already added: every path must be unique",
                          path);
        goto cleanup;
    }
    rc = tw_grow_nodes(tree, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    copy = tw_host_strdup(&tree->host, path);
    if (copy == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory adding module \"%s\"", path);
        goto cleanup;
    }
    node = &tree->nodes[tree->size];
    memset(node, 0, sizeof *node);
    node->path = copy;
    node->calls = calls;
    node->time_ns = time_ns;
    node->parent = -1;
    node->first_child = -1;
    node->last_child = -1;
    node->next_sibling = -1;
    node->depth = -1;
    if (index != NULL) {
        *index = tree->size;
    }
    tree->size++;
cleanup:
    return rc;
}

/* qsort has no context argument, so the sort keys carry their path. */
typedef struct tw_sort_key {
    const char *path;
    size_t index;
} tw_sort_key;

static int tw_compare_keys(const void *a, const void *b)
{
    const tw_sort_key *ka = a;
    const tw_sort_key *kb = b;

    return strcmp(ka->path, kb->path);
}

/* Binary search of the sorted index for `path` of length `len`. */
static long tw_find_sorted(const tw_tree *tree, const char *path, size_t len)
{
    size_t lo = 0;
    size_t hi = tree->size;
    long found = -1;

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const char *cand = tree->nodes[tree->sorted[mid]].path;
        int c = strncmp(cand, path, len);

        if (c == 0 && cand[len] != '\0') {
            c = 1; /* cand is longer, so it sorts after path */
        }
        if (c == 0) {
            found = (long)tree->sorted[mid];
            break;
        }
        if (c < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return found;
}

/* The nearest called ancestor: strip one dotted name at a time, so "layer1"
 * is never taken for the parent of "layer10". */
static long tw_find_parent(const tw_tree *tree, const char *path)
{
    size_t len = strlen(path);
    long parent = -1;

    while (len > 0 && parent < 0) {
        while (len > 0 && path[len - 1] != '.') {
            len--;
        }
        len = len > 0 ? len - 1 : 0;
        parent = tw_find_sorted(tree, path, len);
    }
    return parent;
}

static void tw_link_child(tw_tree *tree, size_t parent, size_t child)
{
    tw_node *p = &tree->nodes[parent];

    TW_ASSERT(parent < tree->size && child < tree->size && parent != child);
    if (p->last_child < 0) {
        p->first_child = (long)child;
    } else {
        tree->nodes[p->last_child].next_sibling = (long)child;
    }
    p->last_child = (long)child;
    p->child_count++;
}

tw_code tw_tree_finish(tw_tree *tree, tw_error *err)
{
    tw_code rc = TW_OK;
    tw_sort_key *keys = NULL;
    size_t i;
    long root;

    if (tree == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "tree is NULL: create it with tw_tree_create");
        goto cleanup;
    }
    if (tree->finished) {
        rc = tw_error_set(err, TW_ESTATE, "the tree is already finished");
        goto cleanup;
    }
    root = tw_find_by_scan(tree, "");
    if (root < 0) {
        rc = tw_error_set(err, TW_EINVAL,
                          "the tree has no root: add the model itself with path \"\"");
        goto cleanup;
    }
    keys = tw_host_alloc_array(&tree->host, tree->size, sizeof *keys);
    tree->sorted = tw_host_alloc_array(&tree->host, tree->size, sizeof *tree->sorted);
    if (keys == NULL || tree->sorted == NULL) {
        rc = tw_error_set(err, TW_ENOMEM, "out of memory finishing the module tree");
        goto cleanup;
    }
    for (i = 0; i < tree->size; i++) {
        keys[i].path = tree->nodes[i].path;
        keys[i].index = i;
    }
    qsort(keys, tree->size, sizeof *keys, tw_compare_keys);
    for (i = 0; i < tree->size; i++) {
        tree->sorted[i] = keys[i].index;
    }
    for (i = 0; i < tree->size; i++) {
        tree->nodes[i].parent = (long)i == root ? -1 : tw_find_parent(tree, tree->nodes[i].path);
    }
    /* Children in the order of adding, so the text view follows the model. */
    for (i = 0; i < tree->size; i++) {
        if (tree->nodes[i].parent >= 0) {
            tw_link_child(tree, (size_t)tree->nodes[i].parent, i);
        }
    }
    /* A parent's path is a prefix of its child's, so it sorts first and its
     * depth is known when the child's is computed. */
    tree->max_depth = 0;
    for (i = 0; i < tree->size; i++) {
        tw_node *node = &tree->nodes[tree->sorted[i]];

        node->depth = node->parent < 0 ? 0 : tree->nodes[node->parent].depth + 1;
        if (node->depth > tree->max_depth) {
            tree->max_depth = node->depth;
        }
    }
    tree->finished = 1;
cleanup:
    if (rc != TW_OK && tree != NULL) {
        tw_host_release(&tree->host, tree->sorted);
        tree->sorted = NULL;
    }
    if (tree != NULL) {
        tw_host_release(&tree->host, keys);
    }
    return rc;
}

size_t tw_tree_size(const tw_tree *tree)
{
    return tree != NULL ? tree->size : 0;
}

int tw_tree_max_depth(const tw_tree *tree)
{
    return (tree != NULL && tree->finished) ? tree->max_depth : -1;
}

static const tw_node *tw_get_node(const tw_tree *tree, size_t index)
{
    return (tree != NULL && index < tree->size) ? &tree->nodes[index] : NULL;
}

const char *tw_tree_path(const tw_tree *tree, size_t index)
{
    const tw_node *node = tw_get_node(tree, index);

    return node != NULL ? node->path : NULL;
}

int tw_tree_depth(const tw_tree *tree, size_t index)
{
    const tw_node *node = tw_get_node(tree, index);

    return node != NULL ? node->depth : -1;
}

long tw_tree_parent(const tw_tree *tree, size_t index)
{
    const tw_node *node = tw_get_node(tree, index);

    return node != NULL ? node->parent : -1;
}

size_t tw_tree_child_count(const tw_tree *tree, size_t index)
{
    const tw_node *node = tw_get_node(tree, index);

    return node != NULL ? node->child_count : 0;
}

uint64_t tw_tree_calls(const tw_tree *tree, size_t index)
{
    const tw_node *node = tw_get_node(tree, index);

    return node != NULL ? node->calls : 0;
}

uint64_t tw_tree_time_ns(const tw_tree *tree, size_t index)
{
    const tw_node *node = tw_get_node(tree, index);

    return node != NULL ? node->time_ns : 0;
}

long tw_tree_find(const tw_tree *tree, const char *path)
{
    long found = -1;

    if (tree == NULL || path == NULL) {
        goto cleanup;
    }
    found = tree->finished ? tw_find_sorted(tree, path, strlen(path))
                           : tw_find_by_scan(tree, path);
cleanup:
    return found;
}

static tw_code tw_check_finished(const tw_tree *tree, tw_error *err)
{
    tw_code rc = TW_OK;

    if (tree == NULL) {
        rc = tw_error_set(err, TW_EINVAL, "tree is NULL: create it with tw_tree_create");
    } else if (!tree->finished) {
        rc = tw_error_set(err, TW_ESTATE,
                          "the tree is not finished: call tw_tree_finish first");
    }
    return rc;
}

static int tw_in_cut(const tw_node *node, int depth)
{
    return node->depth == depth || (node->depth < depth && node->child_count == 0);
}

/* The arguments every depth query of a finished tree takes: the depth it starts
 * at (`name`, for the message: 0 is the root) and its output array (`has_out`,
 * needed when cap > 0). */
static tw_code tw_check_depth_query(const tw_tree *tree, const char *name, int depth,
                                    int has_out, size_t cap, tw_error *err)
{
    tw_code rc;

    rc = tw_check_finished(tree, err);
    if (rc != TW_OK) {
        return rc;
    }
    if (depth < 0) {
        return tw_error_set(err, TW_EINVAL, "%s (%d) is negative: the root is depth 0", name,
                            depth);
    }
    if (cap > 0 && !has_out) {
        return tw_error_set(err, TW_EINVAL, "out is NULL but cap is %zu", cap);
    }
    return TW_OK;
}

tw_code tw_tree_cut(const tw_tree *tree, int depth, size_t *out, size_t cap,
                    size_t *count, tw_error *err)
{
    tw_code rc;
    size_t n = 0;
    size_t i;

    rc = tw_check_depth_query(tree, "depth", depth, out != NULL, cap, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    for (i = 0; i < tree->size; i++) {
        if (tw_in_cut(&tree->nodes[i], depth)) {
            if (n < cap) {
                out[n] = i;
            }
            n++;
        }
    }
cleanup:
    TW_ASSERT(rc != TW_OK || n <= tree->size);
    if (count != NULL) {
        *count = rc == TW_OK ? n : 0;
    }
    return rc;
}

tw_code tw_tree_distinct_depths(const tw_tree *tree, int min_depth, int max_depth,
                                int *out, size_t cap, size_t *count, tw_error *err)
{
    tw_code rc;
    size_t n = 0;
    size_t cut_size;
    int last;
    int d;

    rc = tw_check_depth_query(tree, "min_depth", min_depth, out != NULL, cap, err);
    if (rc != TW_OK) {
        goto cleanup;
    }
    if (max_depth >= 0 && min_depth > max_depth) {
        rc = tw_error_set(err, TW_EINVAL,
                          "min_depth (%d) is greater than max_depth (%d): lower min_depth "
                          "or raise max_depth", min_depth, max_depth);
        goto cleanup;
    }
    last = max_depth < 0 ? tree->max_depth : max_depth;
    if (last < min_depth) {
        last = min_depth; /* the deepest lies above min_depth: its leaves still form a cut */
    }
    for (d = min_depth; d <= last; d++) {
        tw_tree_cut(tree, d, NULL, 0, &cut_size, NULL);
        /* The cut at d differs from the cut at d - 1 exactly when a node lies
         * at depth d (its parent leaves the cut, it enters); cuts only grow
         * finer, so differing from the previous depth is differing from all. */
        if (cut_size == 0 || (d > min_depth && d > tree->max_depth)) {
            continue;
        }
        if (n < cap) {
            out[n] = d;
        }
        n++;
    }
cleanup:
    if (count != NULL) {
        *count = rc == TW_OK ? n : 0;
    }
    return rc;
}

/* Depth-first in the order of adding, without a stack: go down to the first
 * child, else to the next sibling, else up until an ancestor has one. */
static long tw_next_in_walk(const tw_tree *tree, long i)
{
    const tw_node *node = &tree->nodes[i];

    if (node->first_child >= 0) {
        return node->first_child;
    }
    while (i >= 0 && tree->nodes[i].next_sibling < 0) {
        i = tree->nodes[i].parent;
    }
    return i >= 0 ? tree->nodes[i].next_sibling : -1;
}

char *tw_tree_format(const tw_tree *tree, tw_error *err)
{
    tw_buf buf;
    char *text = NULL;
    size_t width = 6; /* "(root)" */
    size_t i;
    long root;
    long at;

    if (tw_check_finished(tree, err) != TW_OK) {
        goto cleanup;
    }
    tw_buf_init(&buf, &tree->host);
    for (i = 0; i < tree->size; i++) {
        size_t w = 2 * (size_t)tree->nodes[i].depth + strlen(tree->nodes[i].path);

        width = w > width ? w : width;
    }
    root = tw_find_sorted(tree, "", 0);
    tw_buf_appendf(&buf, "%-*s  %10s  %12s\n", (int)width, "module", "calls", "time ms");
    for (at = root; at >= 0; at = tw_next_in_walk(tree, at)) {
        const tw_node *node = &tree->nodes[at];
        const char *name = node->path[0] == '\0' ? "(root)" : node->path;
        int pad = (int)(width - 2 * (size_t)node->depth);

        tw_buf_appendf(&buf, "%*s%-*s  %10llu  %12.3f\n", 2 * node->depth, "", pad, name,
                       (unsigned long long)node->calls, (double)node->time_ns / 1e6);
    }
    text = tw_buf_take(&buf);
    if (text == NULL) {
        tw_error_set(err, TW_ENOMEM, "out of memory formatting the module tree");
    }
cleanup:
    return text;
}
