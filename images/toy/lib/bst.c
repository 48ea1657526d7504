/* lib/bst.c: an unbalanced binary search tree with recursive walks
 * (the ramfs directory is kept in one, keyed by name hash). */
#include <toy.h>

noinline struct bst_node *bst_insert(struct bst_node *root, struct bst_node *node)
{
	if (!root) {
		node->left = node->right = NULL;
		return node;
	}
	if (node->key < root->key)
		root->left = bst_insert(root->left, node);
	else
		root->right = bst_insert(root->right, node);
	return root;
}

noinline struct bst_node *bst_find(struct bst_node *root, u64 key)
{
	while (root && root->key != key)
		root = key < root->key ? root->left : root->right;
	return root;
}

noinline unsigned int bst_count(const struct bst_node *root)
{
	if (!root)
		return 0;
	return 1 + bst_count(root->left) + bst_count(root->right);
}

noinline unsigned int bst_depth(const struct bst_node *root)
{
	unsigned int l, r;

	if (!root)
		return 0;
	l = bst_depth(root->left);
	r = bst_depth(root->right);
	return 1 + (l > r ? l : r);
}

noinline u64 bst_sum(const struct bst_node *root)
{
	if (!root)
		return 0;
	return bst_sum(root->left) ^ (root->key * 31 + root->value) ^ (bst_sum(root->right) << 1);
}

/* Deliberately naive: the workload uses it as a recursive compute kernel. */
noinline u64 fib(unsigned int n)
{
	if (n < 2)
		return n;
	return fib(n - 1) + fib(n - 2);
}
